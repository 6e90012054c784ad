"""Verify: walk every entry, stored object, prefix block and chunk of a generation and report what is damaged.

Besides each entry's checksums, verify checks the database's own structure: it
walks every sub-database key by key and compares the keys it reached with the
count LMDB keeps in the sub-database's root record, and each namespace's
entries with its bucket records' live counts. A damaged branch page can hide a
whole subtree from cursors while every count still says it is there; a damaged
page can also make the walk itself fail. Both are reported as problems, never
raised. Projectors are checked against the crc32c recorded with them.
"""

from __future__ import annotations

import dataclasses
import struct
import time
from collections.abc import Callable

import lmdb

from attnstore.errors import AttnStoreError, ChecksumError, StoreFullError
from attnstore.store.arrays import NamespaceState
from attnstore.store.entry_check import entry_problems
from attnstore.store.entry_record import EntryRecord
from attnstore.store.lmdb.catalog import decode_namespace, namespace_names
from attnstore.store.lmdb.chunks.keys import chunk_findings
from attnstore.store.lmdb.env import DB_NAMES, Generation, items_with_prefix
from attnstore.store.lmdb.live import LiveGeneration
from attnstore.store.lmdb.prefix_blocks import prefix_problems
from attnstore.store.lmdb.records import BucketRecord, decode_u64, hash_key, length_key, ns_prefix, split_entry_key
from attnstore.store.reports import ChunkCheck, CorruptEntry, VerifyReport
from attnstore.store.zarr_layout import ZarrArray, parse_object_key

# Reasons listed per corrupt entry at most (the first ones say enough).
_MAX_REASONS = 3


def _check_entry(
    txn: lmdb.Transaction, gen: Generation, state: NamespaceState, record: EntryRecord
) -> tuple[list[str], int]:
    """Problems of one entry (its stored objects, see ``entry_check``, and its index keys) and the number of
    objects checked."""
    db, name, length = gen.db, state.name, record.length
    keys = {array.name: array.object_keys(name, length, record.slot, state.layout.layers)
            for array in state.arrays(length)}

    def read(array: ZarrArray, layer: int) -> bytes | memoryview | None:
        return txn.get(keys[array.name][layer], db=db.zarr)

    outputs = None
    if record.outputs_crc is not None:
        (key,) = state.outputs(length).object_keys(name, length, record.slot, 1)
        outputs = txn.get(key, db=db.zarr)
    problems, checked = entry_problems(state, record, read, outputs)
    found = txn.get(hash_key(name, record.token_hash), db=db.hashes)
    if found is None or decode_u64(found) != record.id:
        problems.append("exact-tier index does not point to the entry")
    if txn.get(length_key(name, length, record.id), db=db.lengths) is None:
        problems.append("by-length index lacks the entry")
    return problems, checked


# Meta key of verify's write probe: the time of the last verify that could write.
META_VERIFIED = b"verified"

StatesOf = Callable[[lmdb.Transaction, Generation], dict[str, NamespaceState]]


def verify_live(live: LiveGeneration, states_of: StatesOf, *, probe_write: bool) -> VerifyReport:
    """Verify the live generation: every entry and structure, then (``probe_write``) one small write,
    and any fault the store met earlier.

    Args:
        live: the store's live generation.
        states_of: every namespace's state, read in a transaction.
        probe_write: commit one small write: damage on the write path (the free-page list) shows only there.
    """
    start = time.perf_counter()
    with live.held() as gen:
        try:
            with gen.env.begin() as txn:
                states = states_of(txn, gen)
        except (lmdb.Error, AttnStoreError) as exc:  # the catalog itself is damaged: nothing to walk by
            problem = f"the namespace catalog cannot be read ({type(exc).__name__}: {exc}): it is damaged"
            report = VerifyReport(0, 0, (), 0, time.perf_counter() - start, (problem,))
        else:
            report = verify_generation(gen, states)
    if probe_write and report.ok:
        report = dataclasses.replace(report, problems=_write_probe(live))
    fault = live.fault()
    if fault is not None:  # damage an earlier call met stays damage, even where this walk did not pass
        report = dataclasses.replace(report, problems=(*report.problems, f"the store failed earlier: {fault}"))
    return report


def _write_probe(live: LiveGeneration) -> tuple[str, ...]:
    try:
        with live.write() as (gen, txn):
            txn.put(META_VERIFIED, struct.pack("<d", time.time()), db=gen.db.meta)
    except StoreFullError:
        return ()  # a full disk or map is no damage (writes say so themselves)
    except AttnStoreError as exc:
        return (f"a write probe failed ({type(exc).__name__}: {exc})",)
    return ()


def verify_generation(gen: Generation, states: dict[str, NamespaceState]) -> VerifyReport:
    """Check every record, stored object's checksum and index key of ``gen`` in one snapshot.

    Args:
        gen: the generation to walk.
        states: every namespace of ``gen`` by name.

    Returns:
        The corrupt entries (with reasons) and the count of orphan objects.
    """
    start = time.perf_counter()
    corrupt: list[CorruptEntry] = []
    problems: list[str] = []
    counts = [0, 0, 0]  # entries, stored objects, orphans: kept by the walk when it fails part way
    blocks_checked = 0
    chunk_check = ChunkCheck()
    try:
        with gen.env.begin(buffers=True) as txn:
            _walk_entries(txn, gen, states, corrupt, counts)
            problems += _structure_problems(txn, gen)
            problems += _projector_problems(txn, gen)
            blocks_checked, block_problems = prefix_problems(txn, gen.db.prefix)
            problems += block_problems
            checked, corrupt_chunks = chunk_findings(txn, gen.db.chunks)
            chunk_check = ChunkCheck(checked, tuple(corrupt_chunks))
    except (lmdb.Error, AttnStoreError) as exc:
        problems.append(f"the database cannot be walked ({type(exc).__name__}: {exc}): it is damaged")
    return VerifyReport(
        entries_checked=counts[0],
        objects_checked=counts[1],
        corrupt=tuple(corrupt),
        orphan_objects=counts[2],
        seconds=time.perf_counter() - start,
        problems=tuple(problems),
        prefix_blocks_checked=blocks_checked,
        chunks=chunk_check,
    )


def _walk_entries(
    txn: lmdb.Transaction, gen: Generation, states: dict[str, NamespaceState], corrupt: list[CorruptEntry],
    counts: list[int],
) -> None:
    """Check every entry's record, stored objects and index keys; count orphan objects."""
    live: set[tuple[str, str, int, int]] = set()  # (namespace, array, length, slot)
    for name in namespace_names(txn, gen.db):
        state = states[name]
        with txn.cursor(db=gen.db.entries) as cursor:
            for key, raw in items_with_prefix(cursor, ns_prefix(name)):
                counts[0] += 1
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
                counts[1] += checked
                live.update((name, a.name, record.length, record.slot) for a in state.all_arrays(record.length))
                if problems:
                    corrupt.append(CorruptEntry(name, entry_id, "; ".join(problems[:_MAX_REASONS])))
    with txn.cursor(db=gen.db.zarr) as cursor:
        for object_key in cursor.iternext(keys=True, values=False):
            parsed = parse_object_key(bytes(object_key))
            if parsed is not None and parsed not in live:
                counts[2] += 1


def _structure_problems(txn: lmdb.Transaction, gen: Generation) -> list[str]:
    """Keys a walk cannot reach: per sub-database against LMDB's count, per namespace against its buckets."""
    problems = []
    for db_name in DB_NAMES:
        db = getattr(gen.db, db_name)
        reached, disordered, previous = 0, 0, None
        with txn.cursor(db=db) as cursor:
            for raw_key in cursor.iternext(keys=True, values=False):
                key = bytes(raw_key)
                # A branch page pointing at the wrong child shows as keys out of order (or repeated).
                disordered += previous is not None and key <= previous
                reached, previous = reached + 1, key
        if disordered:
            problems.append(f"sub-database {db_name!r}: {disordered} keys out of order: a branch page is damaged")
        recorded = txn.stat(db)["entries"]
        if reached != recorded:
            problems.append(
                f"sub-database {db_name!r}: {reached} keys reachable, LMDB records {recorded}: a damaged page hides"
                f" {recorded - reached} keys"
            )
    for name in namespace_names(txn, gen.db):
        with txn.cursor(db=gen.db.buckets) as cursor:
            counted = sum(BucketRecord.from_bytes(raw).live for _, raw in items_with_prefix(cursor, ns_prefix(name)))
        with txn.cursor(db=gen.db.entries) as cursor:
            reached = sum(1 for _ in items_with_prefix(cursor, ns_prefix(name)))
        if reached != counted:
            problems.append(f"namespace {name!r}: {reached} entry records reachable, its buckets count {counted}")
    return problems


def _projector_problems(txn: lmdb.Transaction, gen: Generation) -> list[str]:
    """Namespaces whose projector fails the crc32c recorded with it (or whose record does not decode)."""
    problems = []
    for name in namespace_names(txn, gen.db):
        raw = txn.get(name.encode(), db=gen.db.catalog)
        assert raw is not None  # the name was just read from the catalog, in the same transaction
        projector = txn.get(name.encode(), db=gen.db.projectors)
        try:
            decode_namespace(name, bytes(raw), None if projector is None else bytes(projector))
        except AttnStoreError as exc:
            problems.append(str(exc))
    return problems
