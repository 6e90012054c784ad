"""Verify: walk every entry and chunk of a generation and report what is damaged."""

from __future__ import annotations

import time

import crc32c
import lmdb

from attnstore.errors import ChecksumError
from attnstore.store.arrays import NamespaceState
from attnstore.store.lmdb.catalog import namespace_names
from attnstore.store.lmdb.env import Generation, items_with_prefix
from attnstore.store.lmdb.records import EntryRecord, decode_u64, hash_key, length_key, ns_prefix, split_entry_key
from attnstore.store.reports import CorruptEntry, VerifyReport
from attnstore.store.zarr_layout import parse_chunk_key

# Reasons listed per corrupt entry at most (the first ones say enough).
_MAX_REASONS = 3


def _check_entry(
    txn: lmdb.Transaction, gen: Generation, state: NamespaceState, record: EntryRecord
) -> tuple[list[str], int]:
    """Problems of one entry and the number of chunks checked."""
    db, name, length = gen.db, state.name, record.length
    problems: list[str] = []
    arrays = state.arrays(length)
    n_arrays = len(arrays)
    checked = 0
    if len(record.crcs) != state.layout.layers * n_arrays:
        problems.append(f"record has {len(record.crcs)} chunk crcs, expected {state.layout.layers * n_arrays}")
    else:
        for k, array in enumerate(arrays):
            for layer, key in enumerate(array.chunk_keys(name, length, record.slot, state.layout.layers)):
                chunk = txn.get(key, db=db.zarr)
                checked += 1
                if chunk is None:
                    problems.append(f"layer {layer} {array.name} chunk is missing")
                elif crc32c.crc32c(chunk) != record.crcs[layer * n_arrays + k]:
                    problems.append(f"layer {layer} {array.name} chunk: crc32c mismatch")
    if record.outputs_crc is not None:
        (key,) = state.outputs(length).chunk_keys(name, length, record.slot, 1)
        chunk = txn.get(key, db=db.zarr)
        checked += 1
        if chunk is None or crc32c.crc32c(chunk) != record.outputs_crc:
            problems.append("outputs chunk is missing or fails its crc32c check")
    found = txn.get(hash_key(name, record.token_hash), db=db.hashes)
    if found is None or decode_u64(found) != record.id:
        problems.append("exact-tier index does not point to the entry")
    if txn.get(length_key(name, length, record.id), db=db.lengths) is None:
        problems.append("by-length index lacks the entry")
    return problems, checked


def verify_generation(gen: Generation, states: dict[str, NamespaceState]) -> VerifyReport:
    """Check every record, chunk checksum and index key of ``gen`` in one snapshot.

    Args:
        gen: the generation to walk.
        states: every namespace of ``gen`` by name.

    Returns:
        The corrupt entries (with reasons) and the count of orphan chunks.
    """
    start = time.perf_counter()
    corrupt: list[CorruptEntry] = []
    entries = chunks = 0
    live: set[tuple[str, str, int, int]] = set()  # (namespace, array, length, slot)
    with gen.env.begin(buffers=True) as txn:
        for name in namespace_names(txn, gen.db):
            state = states[name]
            with txn.cursor(db=gen.db.entries) as cursor:
                for key, raw in items_with_prefix(cursor, ns_prefix(name)):
                    entries += 1
                    entry_id = split_entry_key(key)[1]
                    try:
                        record = EntryRecord.from_bytes(raw)
                    except ChecksumError as exc:
                        corrupt.append(CorruptEntry(name, entry_id, f"record: {exc}"))
                        continue
                    if record.id != entry_id:
                        corrupt.append(CorruptEntry(name, entry_id, f"record holds id {record.id}"))
                        continue
                    problems, checked = _check_entry(txn, gen, state, record)
                    chunks += checked
                    live.update((name, a.name, record.length, record.slot) for a in state.all_arrays(record.length))
                    if problems:
                        corrupt.append(CorruptEntry(name, entry_id, "; ".join(problems[:_MAX_REASONS])))
        orphans = 0
        with txn.cursor(db=gen.db.zarr) as cursor:
            for chunk_key in cursor.iternext(keys=True, values=False):
                parsed = parse_chunk_key(bytes(chunk_key))
                if parsed is not None and parsed not in live:
                    orphans += 1
    return VerifyReport(
        entries_checked=entries,
        chunks_checked=chunks,
        corrupt=tuple(corrupt),
        orphan_chunks=orphans,
        seconds=time.perf_counter() - start,
    )
