"""The write path, inside one write transaction: add, delete, hit flush, byte-cap eviction.

Two-phase ingest: an entry's stored objects (``zarr_layout``) go in first, its record last, all in one
LMDB transaction. Readers find entries through their record only, so nothing of
an entry is visible before the commit, and a crash (even SIGKILL) before the
commit leaves no trace: LMDB discards the uncommitted pages.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

import crc32c
import lmdb
import numpy as np

from attnstore.errors import ChecksumError
from attnstore.store.arrays import NamespaceState
from attnstore.store.entry_record import EntryRecord
from attnstore.store.eviction import (
    EntryCandidate,
    by_recency,
    least_recent_first,
    plan_eviction,
)
from attnstore.store.lmdb.chunks.keys import delete_chunk, drop_chunk_keys, eviction_candidates, total_bytes
from attnstore.store.lmdb.env import Databases, items_with_prefix
from attnstore.store.lmdb.prefix_blocks import drop_prefix_keys
from attnstore.store.lmdb.records import (
    META_EVICTED_BYTES,
    META_EVICTED_ENTRIES,
    META_NEXT_ID,
    BucketRecord,
    HitRecord,
    bucket_key,
    decode_u64,
    encode_u64,
    entry_key,
    hash_key,
    length_key,
    ns_prefix,
    read_counter,
    split_entry_key,
    split_length_key,
    stored_bytes,
    write_counter,
)
from attnstore.store.namespace_rules import outputs_only_feature_error
from attnstore.store.reports import FeaturesReport
from attnstore.store.validate import PreparedEntry
from attnstore.store.zarr_layout import node_key

logger = logging.getLogger(__name__)

# A new bucket gets this many slots; full buckets double.
MIN_CAPACITY = 64

def load_bucket(txn: lmdb.Transaction, db: Databases, namespace: str, length: int) -> BucketRecord:
    """A bucket's record; an empty one if the bucket does not exist yet."""
    raw = txn.get(bucket_key(namespace, length), db=db.buckets)
    return BucketRecord(0, 0, 0, 0, 0) if raw is None else BucketRecord.from_bytes(raw)


def find_existing(txn: lmdb.Transaction, db: Databases, namespace: str, token_hash: bytes) -> int | None:
    """Id of the live entry with ``token_hash``, or None."""
    raw = txn.get(hash_key(namespace, token_hash), db=db.hashes)
    if raw is None:
        return None
    entry_id = decode_u64(raw)
    return entry_id if txn.get(entry_key(namespace, entry_id), db=db.entries) is not None else None


def raw_nbytes(state: NamespaceState, length: int, has_outputs: bool, has_maps: bool = True) -> int:
    """fp16 bytes of an entry's maps (and outputs): the basis of compression ratios."""
    maps = state.layout.map_nbytes(length) if has_maps else 0
    return maps + (state.layout.outputs_nbytes(length) if has_outputs else 0)


def write_entry(
    txn: lmdb.Transaction, db: Databases, state: NamespaceState, entry: PreparedEntry, entry_id: int, now: float
) -> EntryRecord:
    """Write one entry: its stored objects first, adjacent, then its record and index keys.

    Returns:
        The entry's record.
    """
    name, length, layers = state.name, entry.length, state.layout.layers
    bucket = load_bucket(txn, db, name, length)
    slot = bucket.next_slot
    capacity = bucket.capacity
    if slot >= capacity:
        capacity = max(MIN_CAPACITY, 2 * capacity)
        for array in state.all_arrays(length):
            txn.put(node_key(array.path(name, length)), array.metadata(capacity, layers), db=db.zarr)
    crcs: list[int] = []
    nbytes = 0
    arrays = state.arrays(length)
    # An outputs-only entry (written back for the exact tier) has no maps: crcs stays empty.
    for layer in range(layers if entry.maps is not None else 0):
        assert entry.maps is not None
        stored_objects = state.codec.encode_layer(entry.maps[layer])  # one per array
        for array, stored in zip(arrays, stored_objects, strict=True):
            txn.put(array.object_key(name, length, slot, layer), stored, db=db.zarr)
            crcs.append(crc32c.crc32c(stored))
            nbytes += len(stored)
    outputs_crc = None
    if entry.outputs is not None:
        stored = entry.outputs.data.cast("B")
        (key,) = state.outputs(length).object_keys(name, length, slot, layers)
        txn.put(key, stored, db=db.zarr)
        outputs_crc = crc32c.crc32c(stored)
        nbytes += len(stored)
    record = EntryRecord(
        id=entry_id,
        slot=slot,
        length=length,
        created=now,
        token_hash=entry.token_hash,
        crcs=tuple(crcs),
        nbytes=nbytes,
        outputs_crc=outputs_crc,
        feature=entry.feature,
        token_ids=entry.token_ids,
        writer=entry.writer,
    )
    txn.put(entry_key(name, entry_id), record.to_bytes(), db=db.entries)
    txn.put(hash_key(name, entry.token_hash), encode_u64(entry_id), db=db.hashes)
    txn.put(length_key(name, length, entry_id), b"", db=db.lengths)
    bucket = BucketRecord(
        next_slot=slot + 1,
        capacity=capacity,
        live=bucket.live + 1,
        stored_bytes=bucket.stored_bytes + nbytes,
        raw_bytes=bucket.raw_bytes + raw_nbytes(state, length, outputs_crc is not None, entry.maps is not None),
    )
    txn.put(bucket_key(name, length), bucket.to_bytes(), db=db.buckets)
    return record


def write_entries(
    txn: lmdb.Transaction, db: Databases, state: NamespaceState, entries: list[PreparedEntry], now: float
) -> tuple[list[int], list[int], list[int]]:
    """Write a batch; an entry whose token hash is stored already (or earlier in the batch) is skipped.

    A stored entry without a feature vector (its projector was replaced) takes a
    duplicate's, so ingesting again with the new projector brings it back to the map tier.

    Returns:
        The id of every entry in input order (existing ids for duplicates), the new ids,
        and the stored ids that took a duplicate's feature vector.
    """
    next_id = read_counter(txn, db, META_NEXT_ID, 1)
    ids: list[int] = []
    new: dict[bytes, int] = {}
    featured: list[int] = []
    for entry in entries:
        existing = new.get(entry.token_hash)
        if existing is None:
            existing = find_existing(txn, db, state.name, entry.token_hash)
            if existing is not None and entry.feature is not None \
                    and _add_feature(txn, db, state.name, existing, entry):
                featured.append(existing)
        if existing is not None:
            ids.append(existing)
            continue
        write_entry(txn, db, state, entry, next_id, now)
        new[entry.token_hash] = next_id
        ids.append(next_id)
        next_id += 1
    write_counter(txn, db, META_NEXT_ID, next_id)
    return ids, list(new.values()), featured


def _add_feature(txn: lmdb.Transaction, db: Databases, namespace: str, entry_id: int, entry: PreparedEntry) -> bool:
    """Give a stored entry without a feature vector ``entry``'s; False when it has one, has no maps (or is
    unreadable)."""
    key = entry_key(namespace, entry_id)
    raw = txn.get(key, db=db.entries)
    assert raw is not None  # found live by find_existing in this transaction
    try:
        record = EntryRecord.from_bytes(raw)
    except ChecksumError:
        return False  # never rewrite a corrupt record (verify reports it)
    if record.feature is not None or not record.crcs:
        return False  # it has one, or it is outputs-only: never searched, it has nothing to replay
    txn.put(key, replace(record, feature=entry.feature).to_bytes(), db=db.entries)
    return True


def set_features(
    txn: lmdb.Transaction, db: Databases, namespace: str, entry_ids: list[int], features: np.ndarray
) -> FeaturesReport:
    """Give each live entry its row of ``features`` (replacing the vector it has); see ``MapStoreBase.set_features``.

    Ids without a readable record are reported missing (a corrupt one is never served; verify reports it).

    Raises:
        MapShapeError: an entry stores outputs only (raised before anything is put: the caller aborts).
    """
    records: list[tuple[bytes, EntryRecord, np.ndarray]] = []
    missing: list[int] = []
    for entry_id, row in zip(entry_ids, features, strict=True):
        key = entry_key(namespace, entry_id)
        raw = txn.get(key, db=db.entries)
        try:
            record = None if raw is None else EntryRecord.from_bytes(raw)
        except ChecksumError:
            record = None
        if record is None:
            missing.append(entry_id)
            continue
        if not record.crcs:
            raise outputs_only_feature_error(namespace, entry_id)
        records.append((key, record, row))
    for key, record, row in records:
        txn.put(key, replace(record, feature=row.copy()).to_bytes(), db=db.entries)
    return FeaturesReport([r.id for _, r, _ in records], [r.length for _, r, _ in records], missing)


def drop_features(txn: lmdb.Transaction, db: Databases, namespace: str) -> int:
    """Remove every stored feature vector of ``namespace`` (its projector was replaced); returns how many.

    Corrupt records are left as they are: they are never served, and verify reports them.
    """
    rewritten: list[tuple[bytes, bytes]] = []
    with txn.cursor(db=db.entries) as cursor:
        for key, raw in items_with_prefix(cursor, ns_prefix(namespace)):
            try:
                record = EntryRecord.from_bytes(raw)
            except ChecksumError:
                continue
            if record.feature is not None:
                rewritten.append((key, replace(record, feature=None).to_bytes()))
    for key, raw in rewritten:  # after the scan: a put under an open cursor would move it
        txn.put(key, raw, db=db.entries)
    return len(rewritten)


def delete_entry(txn: lmdb.Transaction, db: Databases, state: NamespaceState, entry_id: int) -> int | None:
    """Delete one entry (stored objects, record, index keys, hits); returns its stored bytes, None if absent."""
    name = state.name
    key = entry_key(name, entry_id)
    raw = txn.get(key, db=db.entries)
    if raw is None:
        return None
    try:
        record = EntryRecord.from_bytes(raw)
    except ChecksumError:
        return _delete_corrupt_record(txn, db, name, entry_id)
    length = record.length
    for array in state.all_arrays(length):
        for object_key in array.object_keys(name, length, record.slot, state.layout.layers):
            txn.delete(object_key, db=db.zarr)
    txn.delete(key, db=db.entries)
    txn.delete(key, db=db.hits)
    txn.delete(length_key(name, length, entry_id), db=db.lengths)
    hkey = hash_key(name, record.token_hash)
    found = txn.get(hkey, db=db.hashes)
    if found is not None and decode_u64(found) == entry_id:
        txn.delete(hkey, db=db.hashes)
    bucket = load_bucket(txn, db, name, length)
    bucket = replace(
        bucket,
        live=bucket.live - 1,
        stored_bytes=bucket.stored_bytes - record.nbytes,
        raw_bytes=bucket.raw_bytes - raw_nbytes(state, length, record.outputs_crc is not None, bool(record.crcs)),
    )
    txn.put(bucket_key(name, length), bucket.to_bytes(), db=db.buckets)
    return record.nbytes


def _delete_corrupt_record(txn: lmdb.Transaction, db: Databases, name: str, entry_id: int) -> int:
    # Without a readable record the slot is unknown: its stored objects become orphans
    # (invisible, dropped by compaction) and bucket totals stay as they were.
    key = entry_key(name, entry_id)
    txn.delete(key, db=db.entries)
    txn.delete(key, db=db.hits)
    with txn.cursor(db=db.lengths) as cursor:
        stale = [k for k, _ in items_with_prefix(cursor, ns_prefix(name)) if split_length_key(k)[1] == entry_id]
    for k in stale:
        txn.delete(k, db=db.lengths)
    logger.warning("deleted entry %s of namespace %r whose record was corrupt; its stored objects are orphans",
                   entry_id, name)
    return 0


def flush_hits(txn: lmdb.Transaction, db: Databases, pending: Mapping[tuple[str, int], tuple[int, float]]) -> None:
    """Add buffered hit counts to the ``hits`` db (entries deleted meanwhile are skipped)."""
    for (name, entry_id), (hits, last) in pending.items():
        key = entry_key(name, entry_id)
        if txn.get(key, db=db.entries) is None:
            continue
        current = HitRecord.from_bytes(txn.get(key, db=db.hits))
        txn.put(key, HitRecord(current.hits + hits, max(current.last_hit, last)).to_bytes(), db=db.hits)


@dataclass(frozen=True, slots=True)
class Evicted:
    """Entries removed by the byte cap in one transaction."""

    ids: dict[str, list[int]]  # namespace -> ids
    nbytes: int

    @property
    def count(self) -> int:
        """Number of entries evicted."""
        return sum(len(v) for v in self.ids.values())


def evict_over_cap(
    txn: lmdb.Transaction,
    db: Databases,
    states: dict[str, NamespaceState],
    max_bytes: int,
    low_water: float,
    protect: set[tuple[str, int]],
) -> Evicted:
    """If live bytes (entries' and chunks') exceed ``max_bytes``, delete the least recently used entries and
    chunks (the later of storing and last hit or read) down to ``low_water * max_bytes``.

    Args:
        txn: write transaction.
        db: sub-databases.
        states: every namespace by name.
        max_bytes: the cap.
        low_water: fraction of the cap to evict down to, so eviction (a full
            scan of the records) runs once per batch of ingests, not per ingest.
        protect: ``(namespace, id)`` never evicted (the entries just ingested).

    Returns:
        The entries evicted (nothing when under the cap).
    """
    total = stored_bytes(txn, db) + total_bytes(txn, db.chunks)
    if total <= max_bytes:
        return Evicted({}, 0)
    entries: list[EntryCandidate] = []
    with txn.cursor(db=db.entries) as cursor:
        for key, raw in cursor.iternext():
            name, entry_id = split_entry_key(key)
            if (name, entry_id) in protect:
                continue
            try:
                record = EntryRecord.from_bytes(raw)
            except ChecksumError:
                continue
            last_hit = HitRecord.from_bytes(txn.get(key, db=db.hits)).last_hit
            entries.append(EntryCandidate(max(last_hit, record.created), name, entry_id, record.nbytes))
    chunks = eviction_candidates(txn, db.chunks, set())
    plan = plan_eviction(total, max_bytes, low_water, least_recent_first(chunks, by_recency(entries)))
    evicted: dict[str, list[int]] = {}
    freed = 0
    for victim in plan.victims:
        name, ident = victim.namespace, victim.key
        if isinstance(ident, bytes):  # a chunk's key
            assert db.chunks is not None  # it listed the chunk
            delete_chunk(txn, db.chunks, name, ident)
            continue
        nbytes = delete_entry(txn, db, states[name], ident)
        if nbytes is not None:
            freed += nbytes
            evicted.setdefault(name, []).append(ident)
    result = Evicted(evicted, freed)
    write_counter(txn, db, META_EVICTED_ENTRIES, read_counter(txn, db, META_EVICTED_ENTRIES) + result.count)
    write_counter(txn, db, META_EVICTED_BYTES, read_counter(txn, db, META_EVICTED_BYTES) + freed)
    if plan.left > max_bytes:
        logger.warning(
            "store holds %s bytes over its cap of %s even after evicting every older entry", plan.left, max_bytes
        )
    return result


def drop_namespace_keys(txn: lmdb.Transaction, db: Databases, name: str) -> int:
    """Delete every key of namespace ``name`` in one transaction; returns how many.

    Entry-keyed databases use ``name + NUL`` prefixes and zarr keys ``name + "/"``;
    neither character is allowed in a name, so no other namespace's keys match.
    """
    removed = 0
    by_prefix = (
        (ns_prefix(name), (db.entries, db.lengths, db.hashes, db.hits, db.buckets)),
        (f"{name}/".encode(), (db.zarr,)),
    )
    for prefix, handles in by_prefix:
        for handle in handles:
            with txn.cursor(db=handle) as cursor:
                keys = [key for key, _ in items_with_prefix(cursor, prefix)]
            for key in keys:
                removed += bool(txn.delete(key, db=handle))
    for handle in (db.catalog, db.projectors):
        removed += bool(txn.delete(name.encode(), db=handle))
    return removed + drop_prefix_keys(txn, db.prefix, name) + drop_chunk_keys(txn, db.chunks, name)
