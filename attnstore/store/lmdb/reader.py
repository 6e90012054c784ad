"""The read path: stored objects' bytes straight from LMDB into one contiguous buffer, and per-bucket statistics.

Everything here runs inside one read transaction opened with ``buffers=True``
on the calling thread: ``txn.get`` returns a memoryview into LMDB's map (no
copy), each stored object is checked against its crc32c and decoded straight into its
slice of the caller's buffer. zarr's async machinery is never involved.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Executor, wait

import crc32c
import lmdb
import numpy as np

from attnstore.errors import ChecksumError, EntryNotFoundError
from attnstore.protocol.records import FORMAT_VERSION, EntryRef
from attnstore.store.arrays import NamespaceState
from attnstore.store.entry_record import EntryRecord, check_map_record
from attnstore.store.lmdb.chunks.keys import chunk_usage
from attnstore.store.lmdb.env import Databases, Generation, items_with_prefix
from attnstore.store.lmdb.ingest import find_existing
from attnstore.store.lmdb.prefix_blocks import prefix_usage
from attnstore.store.lmdb.records import (
    META_EVICTED_BYTES,
    META_EVICTED_ENTRIES,
    BucketRecord,
    HitRecord,
    bucket_key,
    entry_key,
    ns_prefix,
    read_counter,
    split_entry_key,
    split_length_key,
)
from attnstore.store.lmdb.settings import StoreSettings
from attnstore.store.reports import BucketStats, DramStats, NamespaceStats, StoreStats, with_chunk_usage
from attnstore.store.zarr_layout import ZarrArray

logger = logging.getLogger(__name__)

# Below this many bytes a second thread costs more than it saves.
_PARALLEL_BYTES = 1 << 20


def load_record(txn: lmdb.Transaction, db: Databases, namespace: str, entry_id: int) -> EntryRecord:
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


def find_ref(txn: lmdb.Transaction, db: Databases, namespace: str, token_hash: bytes) -> EntryRef | None:
    """The live entry stored for ``token_hash`` with its length, or None (a corrupt record is never served)."""
    entry_id = find_existing(txn, db, namespace, token_hash)
    if entry_id is None:
        return None
    try:
        return EntryRef(entry_id, load_record(txn, db, namespace, entry_id).length)
    except ChecksumError:
        return None  # verify reports it


def load_token_ids(txn: lmdb.Transaction, db: Databases, namespace: str, entry_id: int) -> np.ndarray | None:
    """An entry's token ids, or None when it was deleted meanwhile or its record is corrupt (verify reports it)."""
    try:
        return load_record(txn, db, namespace, entry_id).token_ids
    except (EntryNotFoundError, ChecksumError):
        return None


def entry_page(
    txn: lmdb.Transaction, db: Databases, namespace: str, length: int | None, start: bytes | None, limit: int
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


def load_hits(txn: lmdb.Transaction, db: Databases, namespace: str, entry_id: int) -> HitRecord:
    """Flushed hit counters of one entry."""
    return HitRecord.from_bytes(txn.get(entry_key(namespace, entry_id), db=db.hits))


def decode_layers(
    txn: lmdb.Transaction[memoryview],
    db: Databases,
    state: NamespaceState,
    record: EntryRecord,
    layers: Iterable[int],
    out: np.ndarray,
    helper: Executor | None = None,
) -> None:
    """Decode the listed layers of one entry into ``out``, checking every stored object's crc32c.

    Args:
        txn: read transaction opened with ``buffers=True``.
        db: the generation's sub-databases.
        state: the entry's namespace.
        record: the entry's record (slot, crcs).
        layers: layer indices, in the order of ``out``'s first axis.
        out: contiguous ``(n_layers, heads, L, L)`` fp16 buffer.
        helper: a thread that checks and copies half of a large fp16 entry while
            the calling thread does the other half.

    Raises:
        ChecksumError: a layer's stored object is missing, fails its crc32c or does not decode.
    """
    arrays = state.arrays(record.length)
    n_arrays = len(arrays)
    check_map_record(state, record, n_arrays)
    codec = state.codec
    name, length, slot = state.name, record.length, record.slot
    if codec.raw_fp16:
        (array,) = arrays
        stored_objects = []
        for i, layer in enumerate(layers):
            stored = txn.get(array.object_key(name, length, slot, layer), db=db.zarr)
            if stored is None:
                raise _missing_error(state, record, layer, array.name)
            stored_objects.append((i, layer, stored))
        _check_and_copy(state, record, array, stored_objects, out, helper)
        return
    per_layer = []
    for layer in layers:
        layer_objects = []
        for k, array in enumerate(arrays):
            stored = txn.get(array.object_key(name, length, slot, layer), db=db.zarr)
            if stored is None:
                raise _missing_error(state, record, layer, array.name)
            if crc32c.crc32c(stored) != record.crcs[layer * n_arrays + k]:
                raise _crc_error(state, record, layer, array.name)
            layer_objects.append(stored)
        per_layer.append(layer_objects)
    codec.decode_into(per_layer, out)


def _check_and_copy(
    state: NamespaceState,
    record: EntryRecord,
    array: ZarrArray,
    stored_objects: list[tuple[int, int, memoryview]],
    out: np.ndarray,
    helper: Executor | None,
) -> None:
    # The stored object is the fp16 bytes: checked in LMDB's map (which pulls it into
    # cache), then one copy into the buffer, no codec call. crc32c and numpy's
    # copy release the GIL, so two threads halve the time of a large entry.
    dst = out.reshape(-1).view(np.uint8)
    size = array.object_nbytes

    def run(part: list[tuple[int, int, memoryview]]) -> None:
        for i, layer, stored in part:
            if crc32c.crc32c(stored) != record.crcs[layer]:
                raise _crc_error(state, record, layer, array.name)
            if len(stored) != size:
                raise ChecksumError(
                    f"entry {record.id} of namespace {state.name!r}: layer {layer} has {len(stored)} bytes,"
                    f" expected {size}"
                )
            np.copyto(dst[i * size : (i + 1) * size], np.frombuffer(stored, dtype=np.uint8))

    if helper is None or len(stored_objects) < 2 or len(stored_objects) * size < _PARALLEL_BYTES:
        run(stored_objects)
        return
    half = len(stored_objects) // 2
    future = helper.submit(run, stored_objects[half:])
    try:
        run(stored_objects[:half])
    finally:
        # The memoryviews die with the transaction: never return while the helper reads them.
        wait([future])
    future.result()


def _missing_error(state: NamespaceState, record: EntryRecord, layer: int, array: str) -> ChecksumError:
    return ChecksumError(f"entry {record.id} of namespace {state.name!r}: layer {layer} {array} are missing")


def _crc_error(state: NamespaceState, record: EntryRecord, layer: int, array: str) -> ChecksumError:
    return ChecksumError(
        f"entry {record.id} of namespace {state.name!r}: layer {layer} {array} fail their crc32c check"
    )


def read_outputs(txn: lmdb.Transaction, db: Databases, state: NamespaceState, record: EntryRecord) -> np.ndarray | None:
    """The entry's final outputs ``(L, hidden)`` fp16 (a copy), or None if it has none.

    Raises:
        ChecksumError: the outputs are missing or fail their crc32c.
    """
    if record.outputs_crc is None:
        return None
    array = state.outputs(record.length)
    (key,) = array.object_keys(state.name, record.length, record.slot, 1)
    stored = txn.get(key, db=db.zarr)
    if stored is None or crc32c.crc32c(stored) != record.outputs_crc or len(stored) != array.object_nbytes:
        raise ChecksumError(
            f"entry {record.id} of namespace {state.name!r}: outputs are missing or fail their crc32c check"
        )
    return np.frombuffer(stored, dtype="<f2").reshape(record.length, state.layout.hidden).astype(np.float16)


def namespace_stats(
    txn: lmdb.Transaction, db: Databases, states: dict[str, NamespaceState]
) -> tuple[NamespaceStats, ...]:
    """Entries and bytes of every namespace, per bucket with live entries (no record scan)."""
    result = []
    for name, state in states.items():
        buckets = []
        with txn.cursor(db=db.buckets) as cursor:
            for key, value in items_with_prefix(cursor, ns_prefix(name)):
                bucket = BucketRecord.from_bytes(value)
                if bucket.live:
                    length = int.from_bytes(key[-4:], "big")
                    buckets.append(
                        BucketStats(length, bucket.live, bucket.stored_bytes, bucket.raw_bytes, bucket.capacity)
                    )
        result.append(
            NamespaceStats(
                name=name,
                codec=state.layout.codec,
                entries=sum(b.entries for b in buckets),
                stored_bytes=sum(b.stored_bytes for b in buckets),
                raw_bytes=sum(b.raw_bytes for b in buckets),
                buckets=tuple(buckets),
            )
        )
    return tuple(result)


def live_lengths(txn: lmdb.Transaction, db: Databases, namespace: str) -> list[int]:
    """Token lengths of ``namespace`` with at least one live entry, ascending."""
    with txn.cursor(db=db.buckets) as cursor:
        return [
            int.from_bytes(key[-4:], "big")
            for key, value in items_with_prefix(cursor, ns_prefix(namespace))
            if BucketRecord.from_bytes(value).live > 0
        ]


def store_stats(
    txn: lmdb.Transaction,
    gen: Generation,
    states: dict[str, NamespaceState],
    settings: StoreSettings,
    *,
    pending_hits: int,
    dram: DramStats,
) -> StoreStats:
    """The whole store's statistics, read in ``txn`` on ``gen``."""
    namespaces = namespace_stats(txn, gen.db, states)
    prefix_blocks, prefix_bytes = prefix_usage(txn, gen.db.prefix)
    stats = StoreStats(
        path=str(gen.path.parent),
        generation=gen.name,
        format_version=FORMAT_VERSION,
        entries=sum(n.entries for n in namespaces),
        stored_bytes=sum(n.stored_bytes for n in namespaces),
        raw_bytes=sum(n.raw_bytes for n in namespaces),
        file_bytes=gen.file_bytes(),
        map_size=settings.map_size,
        max_bytes=settings.max_bytes,
        evicted_entries=read_counter(txn, gen.db, META_EVICTED_ENTRIES),
        evicted_bytes=read_counter(txn, gen.db, META_EVICTED_BYTES),
        pending_hits=pending_hits,
        namespaces=namespaces,
        dram=dram,
        prefix_blocks=prefix_blocks,
        prefix_bytes=prefix_bytes,
    )
    return with_chunk_usage(stats, chunk_usage(txn, gen.db.chunks))
