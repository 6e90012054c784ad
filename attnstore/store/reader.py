"""The hot read path: chunk bytes straight from LMDB into one contiguous buffer.

Everything here runs inside one read transaction opened with ``buffers=True``
on the calling thread: ``txn.get`` returns a memoryview into LMDB's map (no
copy), each chunk is checked against its crc32c and decoded straight into its
slice of the caller's buffer. zarr's async machinery is never involved.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import crc32c
import numpy as np

from attnstore.errors import ChecksumError, EntryNotFoundError
from attnstore.store.catalog import NamespaceState
from attnstore.store.lmdb_env import Databases, items_with_prefix
from attnstore.store.records import (
    EntryRecord,
    HitRecord,
    bucket_key,
    entry_key,
    ns_prefix,
    split_entry_key,
    split_length_key,
)

logger = logging.getLogger(__name__)


def load_record(txn, db: Databases, namespace: str, entry_id: int) -> EntryRecord:
    """The record of a live entry.

    Raises:
        EntryNotFoundError: no live entry has that id.
        ChecksumError: the record itself is corrupt.
    """
    raw = txn.get(entry_key(namespace, entry_id), db=db.entries)
    if raw is None:
        raise EntryNotFoundError(f"no entry {entry_id} in namespace {namespace!r}")
    try:
        return EntryRecord.from_bytes(raw)
    except ChecksumError as exc:
        raise ChecksumError(f"entry {entry_id} of namespace {namespace!r}: {exc}") from None


def entry_page(
    txn, db: Databases, namespace: str, length: int | None, start: bytes | None, limit: int
) -> tuple[list[tuple[EntryRecord, HitRecord]], bytes | None]:
    """Up to ``limit`` live entries in id order (one bucket if ``length``), from key ``start``.

    Corrupt records are skipped with a warning (verify lists them).

    Returns:
        The page and the key to resume from, or None when the scan is done.
    """
    index = db.entries if length is None else db.lengths
    prefix = ns_prefix(namespace) if length is None else bucket_key(namespace, length)
    with txn.cursor(db=index) as cursor:
        keys = []
        for key, _ in items_with_prefix(cursor, prefix, start=start):
            keys.append(key)
            if len(keys) == limit:
                break
    page = []
    for key in keys:
        entry_id = split_entry_key(key)[1] if length is None else split_length_key(key)[1]
        try:
            record = load_record(txn, db, namespace, entry_id)
        except (EntryNotFoundError, ChecksumError) as exc:
            logger.warning("listing namespace %r: skipping entry %s: %s", namespace, entry_id, exc)
            continue
        page.append((record, load_hits(txn, db, namespace, entry_id)))
    return page, (keys[-1] + b"\x00" if len(keys) == limit else None)


def load_hits(txn, db: Databases, namespace: str, entry_id: int) -> HitRecord:
    """Flushed hit counters of one entry."""
    return HitRecord.from_bytes(txn.get(entry_key(namespace, entry_id), db=db.hits))


def decode_layers(
    txn,
    db: Databases,
    state: NamespaceState,
    record: EntryRecord,
    layers: Iterable[int],
    out: np.ndarray,
) -> None:
    """Decode the listed layers of one entry into ``out``, checking every chunk's crc32c.

    Args:
        txn: read transaction opened with ``buffers=True``.
        db: the generation's sub-databases.
        state: the entry's namespace.
        record: the entry's record (slot, crcs).
        layers: layer indices, in the order of ``out``'s first axis.
        out: contiguous ``(n_layers, heads, L, L)`` fp16 buffer.

    Raises:
        ChecksumError: a chunk is missing, fails its crc32c or does not decode.
    """
    arrays = state.arrays(record.length)
    n_arrays = len(arrays)
    if len(record.crcs) != state.layout.layers * n_arrays:
        raise ChecksumError(
            f"entry {record.id} of namespace {state.name!r}: record has {len(record.crcs)} chunk crcs,"
            f" expected {state.layout.layers * n_arrays}"
        )
    codec = state.codec
    name, length, slot = state.name, record.length, record.slot
    if codec.raw_fp16:
        # The chunk is the fp16 bytes: checked in LMDB's map (which pulls it into
        # cache), then one memcpy into the buffer, no codec call.
        (array,) = arrays
        dst = memoryview(out).cast("B")
        size = array.chunk_nbytes
        for i, layer in enumerate(layers):
            chunk = txn.get(array.chunk_key(name, length, slot, layer), db=db.zarr)
            if chunk is None:
                raise _missing_error(state, record, layer, array.name)
            if crc32c.crc32c(chunk) != record.crcs[layer]:
                raise _crc_error(state, record, layer, array.name)
            if len(chunk) != size:
                raise ChecksumError(
                    f"entry {record.id} of namespace {name!r}: layer {layer} chunk has {len(chunk)} bytes,"
                    f" expected {size}"
                )
            dst[i * size : (i + 1) * size] = chunk
        return
    per_layer = []
    for layer in layers:
        chunks = []
        for k, array in enumerate(arrays):
            chunk = txn.get(array.chunk_key(name, length, slot, layer), db=db.zarr)
            if chunk is None:
                raise _missing_error(state, record, layer, array.name)
            if crc32c.crc32c(chunk) != record.crcs[layer * n_arrays + k]:
                raise _crc_error(state, record, layer, array.name)
            chunks.append(chunk)
        per_layer.append(chunks)
    codec.decode_into(per_layer, out)


def _missing_error(state: NamespaceState, record: EntryRecord, layer: int, array: str) -> ChecksumError:
    return ChecksumError(f"entry {record.id} of namespace {state.name!r}: layer {layer} {array} chunk is missing")


def _crc_error(state: NamespaceState, record: EntryRecord, layer: int, array: str) -> ChecksumError:
    return ChecksumError(
        f"entry {record.id} of namespace {state.name!r}: layer {layer} {array} chunk fails its crc32c check"
    )


def read_outputs(txn, db: Databases, state: NamespaceState, record: EntryRecord) -> np.ndarray | None:
    """The entry's final outputs ``(L, hidden)`` fp16 (a copy), or None if it has none.

    Raises:
        ChecksumError: the outputs chunk is missing or fails its crc32c.
    """
    if record.outputs_crc is None:
        return None
    array = state.outputs(record.length)
    (key,) = array.chunk_keys(state.name, record.length, record.slot, 1)
    chunk = txn.get(key, db=db.zarr)
    if chunk is None or crc32c.crc32c(chunk) != record.outputs_crc or len(chunk) != array.chunk_nbytes:
        raise ChecksumError(
            f"entry {record.id} of namespace {state.name!r}: outputs chunk is missing or fails its crc32c check"
        )
    return np.frombuffer(chunk, dtype="<f2").reshape(record.length, state.layout.hidden).astype(np.float16)
