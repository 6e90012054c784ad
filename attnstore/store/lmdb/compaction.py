"""Copies of a generation: compaction (its live entries densely into a new one) and backup.

Ids, records, hit counters, namespaces and projectors carry over unchanged;
entries get new dense slots per length bucket, their stored objects are copied verbatim
(so their checksums still hold), and orphan objects are left behind. The new
generation is invisible until the caller swaps ``CURRENT``.

A compaction first checks that the disk has room for the copy, and a disk that
fills up meanwhile fails it cleanly (``StoreFullError``, the new generation
removed, the old one still live): its LMDB lock file is allocated before use
(see ``env``), and LMDB writes data pages with ``write``, never through the map.

**Backup** (``backup_store``): a consistent copy of a store's live generation, safe while a daemon writes to it.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import lmdb

from attnstore.errors import ChecksumError, ConfigError, StoreFullError
from attnstore.store.arrays import NamespaceState
from attnstore.store.entry_record import EntryRecord
from attnstore.store.lmdb.catalog import namespace_names
from attnstore.store.lmdb.env import (
    DATA_FILE,
    Databases,
    DbHandle,
    Generation,
    disk_full_error,
    free_disk_bytes,
    is_disk_full,
    items_with_prefix,
    next_generation_name,
    remove_unused_generations,
    write_current,
)
from attnstore.store.lmdb.ingest import raw_nbytes
from attnstore.store.lmdb.live import LiveGeneration, open_live
from attnstore.store.lmdb.records import (
    BucketRecord,
    bucket_key,
    encode_u64,
    entry_key,
    hash_key,
    length_key,
    ns_prefix,
    split_length_key,
)
from attnstore.store.lmdb.settings import StoreSettings
from attnstore.store.reports import CompactReport
from attnstore.store.zarr_layout import node_key, parse_object_key

logger = logging.getLogger(__name__)

# Bucket arrays' zarr.json are rewritten with the new capacity, not copied.
_ARRAY_META_RE = re.compile(rb"^[^/]+/[^/]+/L\d+/zarr\.json$")
# Free disk a compaction asks for beyond the live generation's used pages: B-tree pages of the copy
# may be filled differently, and the lock file and meta pages come on top.
_SPACE_MARGIN = 1.1
_SPACE_SLACK_BYTES = 4 << 20


def used_bytes(gen: Generation) -> int:
    """Bytes of the pages ``gen``'s data occupies (every sub-database's branch, leaf and overflow pages)."""
    with gen.env.begin() as txn:
        stats = [gen.env.stat(), *(txn.stat(getattr(gen.db, name)) for name in Databases.__slots__)]
    return sum((s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]) * s["psize"] for s in stats)


def check_free_space(root: Path, live: Generation) -> None:
    """Refuse a compaction the disk has no room for, before anything is written.

    Raises:
        StoreFullError: less free space than the live data needs (with a margin).
    """
    needed = int(used_bytes(live) * _SPACE_MARGIN) + _SPACE_SLACK_BYTES
    free = free_disk_bytes(root)
    if free < needed:
        logger.warning("map store %s: compaction needs %s bytes free, the disk has %s", root, needed, free)
        raise StoreFullError(
            f"the disk is too full to compact: the copy needs about {needed} bytes free on the map store's"
            f" filesystem and {free} are; nothing was changed. Free disk space first"
        )


class _BatchWriter:
    """Writes through transactions of bounded size (the target is not live yet)."""

    def __init__(self, env: lmdb.Environment, limit_bytes: int) -> None:
        self._env = env
        self._limit = limit_bytes
        self._txn = env.begin(write=True)
        self._pending = 0

    def put(self, key: bytes, value: bytes | memoryview, db: DbHandle) -> None:
        self._txn.put(key, value, db=db)
        self._pending += len(value) + len(key)
        if self._pending >= self._limit:
            self._txn.commit()
            self._txn = self._env.begin(write=True)
            self._pending = 0

    def commit(self) -> None:
        self._txn.commit()

    def abort(self) -> None:
        self._txn.abort()


@dataclass(frozen=True, slots=True)
class CompactCounts:
    """What one compaction copied and dropped."""

    entries: int
    orphan_objects_dropped: int


def compact_into(
    src: Generation, dst: Generation, states: dict[str, NamespaceState], *, txn_bytes: int = 256 << 20
) -> CompactCounts:
    """Copy the live content of ``src`` into the fresh generation ``dst``.

    Args:
        src: the live generation (read in one snapshot transaction).
        dst: a new, empty generation.
        states: every namespace of ``src`` by name.
        txn_bytes: bytes written per transaction into ``dst``.

    Returns:
        Counts of entries copied and orphan objects dropped.

    Raises:
        lmdb.MapFullError: ``dst`` ran out of map size (the caller translates it).
    """
    sdb, ddb = src.db, dst.db
    writer = _BatchWriter(dst.env, txn_bytes)
    try:
        with src.env.begin(buffers=True) as txn:
            for name in ("meta", "catalog", "projectors"):
                with txn.cursor(db=getattr(sdb, name)) as cursor:
                    for raw_key, value in cursor.iternext():
                        writer.put(bytes(raw_key), value, getattr(ddb, name))
            for source, dest in ((sdb.prefix, ddb.prefix), (sdb.chunks, ddb.chunks)):
                if source is not None and dest is not None:
                    # Prefix blocks and chunks are copied as they are: their keys hold nothing deleted (deletes
                    # and drops delete them).
                    with txn.cursor(db=source) as cursor:
                        for raw_key, value in cursor.iternext():
                            writer.put(bytes(raw_key), value, dest)
            total_objects = 0
            with txn.cursor(db=sdb.zarr) as cursor:
                for raw_key, value in cursor.iternext():
                    key = bytes(raw_key)
                    if parse_object_key(key) is not None:
                        total_objects += 1
                    elif not _ARRAY_META_RE.match(key):
                        writer.put(key, value, ddb.zarr)
            entries = copied = 0
            for name in namespace_names(txn, sdb):
                n, c = _copy_namespace(txn, sdb, ddb, writer, states[name])
                entries += n
                copied += c
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    dst.env.sync(True)
    return CompactCounts(entries=entries, orphan_objects_dropped=total_objects - copied)


def write_next_generation(
    root: Path, live: Generation, states: dict[str, NamespaceState], *, map_size: int, txn_bytes: int
) -> tuple[Generation, CompactCounts]:
    """Compact ``live`` into a new generation under ``root`` and make it current.

    The caller holds the writer lock. On any failure the new generation is
    removed and ``live`` stays current.

    Returns:
        The new generation (one reference, the caller's) and the counts.

    Raises:
        StoreFullError: the disk has no room for the copy (checked first), or filled up meanwhile.
        lmdb.MapFullError: the new generation ran out of map size (the caller translates it).
    """
    check_free_space(root, live)
    new = Generation(root, next_generation_name(root), map_size=map_size, readonly=False, create=True)
    try:
        counts = compact_into(live, new, states, txn_bytes=txn_bytes)
        write_current(root, new.name)
    except BaseException as exc:
        new.release()
        shutil.rmtree(new.path, ignore_errors=True)
        if isinstance(exc, OSError) and not isinstance(exc, StoreFullError) and is_disk_full(exc, root):
            raise disk_full_error(root) from exc  # the CURRENT file could not be written
        raise
    return new, counts


def _copy_namespace(
    txn: lmdb.Transaction, sdb: Databases, ddb: Databases, writer: _BatchWriter, state: NamespaceState
) -> tuple[int, int]:
    name, layers = state.name, state.layout.layers
    entries = copied = 0
    with txn.cursor(db=sdb.buckets) as cursor:
        lengths = [int.from_bytes(k[-4:], "big") for k, _ in items_with_prefix(cursor, ns_prefix(name))]
    for length in lengths:
        slot = stored = raw = 0
        with txn.cursor(db=sdb.lengths) as cursor:
            ids = [split_length_key(k)[1] for k, _ in items_with_prefix(cursor, bucket_key(name, length))]
        for entry_id in ids:
            key = entry_key(name, entry_id)
            raw_record = txn.get(key, db=sdb.entries)
            if raw_record is None:
                continue
            try:
                record = EntryRecord.from_bytes(raw_record)
            except ChecksumError:
                # Slot unknown: keep the record (verify keeps reporting it, the id stays taken).
                logger.warning("compaction keeps corrupt record of entry %s in %r without its stored objects",
                               entry_id, name)
                writer.put(key, raw_record, ddb.entries)
                writer.put(length_key(name, length, entry_id), b"", ddb.lengths)
                continue
            for array in state.all_arrays(length):
                old_keys = array.object_keys(name, length, record.slot, layers)
                new_keys = array.object_keys(name, length, slot, layers)
                for old_key, new_key in zip(old_keys, new_keys, strict=True):
                    value = txn.get(old_key, db=sdb.zarr)
                    if value is not None:
                        writer.put(new_key, value, ddb.zarr)
                        copied += 1
            writer.put(key, replace(record, slot=slot).to_bytes(), ddb.entries)
            writer.put(hash_key(name, record.token_hash), encode_u64(entry_id), ddb.hashes)
            writer.put(length_key(name, length, entry_id), b"", ddb.lengths)
            hits = txn.get(key, db=sdb.hits)
            if hits is not None:
                writer.put(key, hits, ddb.hits)
            slot += 1
            stored += record.nbytes
            raw += raw_nbytes(state, length, record.outputs_crc is not None, bool(record.crcs))
        entries += slot
        if slot:
            bucket = BucketRecord(next_slot=slot, capacity=slot, live=slot, stored_bytes=stored, raw_bytes=raw)
            writer.put(bucket_key(name, length), bucket.to_bytes(), ddb.buckets)
            for array in state.all_arrays(length):
                writer.put(node_key(array.path(name, length)), array.metadata(slot, layers), ddb.zarr)
    return entries, copied


def compact_live(
    live: LiveGeneration,
    states_of: Callable[[lmdb.Transaction, Generation], dict[str, NamespaceState]],
    settings: StoreSettings,
    *,
    on_retired: Callable[[], None],
) -> CompactReport:
    """Compact the live generation into a new one, swap it in and remove what nobody holds.

    The caller holds ``live.write_lock`` and has flushed buffered hits. Readers
    still on the old generation finish there; ``on_retired`` runs when the last
    of them lets go.

    Args:
        live: the store's live generation.
        states_of: every namespace's state, read in a transaction on a generation.
        settings: the store's settings (map size, transaction size).
        on_retired: called once the retired generation is closed.

    Raises:
        StoreFullError: the new generation ran out of map size or disk (the old one stays live).
    """
    start = time.perf_counter()
    with live.held() as old:
        with old.env.begin() as txn:
            states = states_of(txn, old)
        new, counts = write_next_generation(
            live.root, old, states, map_size=settings.map_size, txn_bytes=settings.compact_txn_bytes
        )
        retired = live.swap(new)
        retired.on_closed = on_retired
        retired.release()
        report = CompactReport(
            old_generation=old.name,
            new_generation=new.name,
            entries=counts.entries,
            orphan_objects_dropped=counts.orphan_objects_dropped,
            bytes_before=old.file_bytes(),
            bytes_after=new.file_bytes(),
            seconds=time.perf_counter() - start,
        )
    remove_unused_generations(live.root, keep=new.name)
    return report




@dataclass(frozen=True, slots=True)
class BackupReport:
    """What a backup copied."""

    source: str
    destination: str
    generation: str  # the live generation at the start of the copy
    file_bytes: int  # size of the copied data file
    seconds: float


def backup_store(source: str | Path, destination: str | Path, *, compact: bool = True) -> BackupReport:
    """Copy the live generation of the store at ``source`` into a new store at ``destination``.

    The copy is LMDB's ``mdb_env_copy``: one read transaction, so it holds every
    entry committed before it began and nothing written later or left
    uncommitted. Writers are not blocked. The generation is held (its shared
    flock) for the whole copy, so a compaction that swaps generations meanwhile
    cannot remove it; the backup then reflects the store as it was at its start.

    Args:
        source: store directory (a daemon may be serving it).
        destination: directory for the copy; must not exist or be empty.
        compact: leave free pages out (smaller copy, a little slower).

    Raises:
        StoreNotFoundError: no store at ``source``.
        ConfigError: ``destination`` exists and is not empty.
    """
    source, destination = Path(source), Path(destination)
    if destination.exists() and any(destination.iterdir()):
        raise ConfigError(f"backup destination {destination} is not empty; give a new directory")
    start = time.perf_counter()
    gen = open_live(source, StoreSettings(readonly=True))
    try:
        target = destination / gen.name
        target.mkdir(parents=True)
        gen.env.copy(str(target), compact=compact)
        write_current(destination, gen.name)
    finally:
        gen.release()
    report = BackupReport(
        source=str(source),
        destination=str(destination),
        generation=gen.name,
        file_bytes=(target / DATA_FILE).stat().st_size,
        seconds=time.perf_counter() - start,
    )
    logger.info("backed up %s (%s) to %s", source, gen.name, destination)
    return report
