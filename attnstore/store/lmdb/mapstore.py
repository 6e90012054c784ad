"""LmdbMapStore: attention maps in a zarr v3 layout on LMDB (``open_store`` puts a DRAM cache in front: ``store.dram``).

See DESIGN.md "Map store". One store is a directory of generations (see
``lmdb_env``); one process writes, any number read. Reads run on the calling
thread inside one LMDB read transaction; writes are serialised by a lock and
each ``ingest``/``delete`` call is one transaction, so it is all-or-nothing.

Entry ids come from a persisted uint64 counter starting at 1 (0 stays free to
mean "no entry" on the wire) and are never reused, also not after compaction.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import lmdb
import numpy as np

from attnstore.errors import (
    NamespaceNotFoundError,
    StoreFullError,
    StoreNotFoundError,
    StoreOpenError,
    shown,
)
from attnstore.protocol.mapped_pages import drop_mapped_pages
from attnstore.protocol.records import (
    FORMAT_VERSION,
    EntryInfo,
    EntryRef,
    NamespaceInfo,
    NamespaceLayout,
    NewEntry,
    TokenLimits,
)
from attnstore.store.arrays import NamespaceState
from attnstore.store.base import MapStoreBase
from attnstore.store.dram.hit_buffer import HitBuffer, PendingHits
from attnstore.store.dram.settings import DEFAULT_HIT_FLUSH_COUNT, DEFAULT_HIT_FLUSH_SECONDS
from attnstore.store.entry_record import EntryRecord
from attnstore.store.eviction import DEFAULT_LOW_WATER
from attnstore.store.lmdb.catalog import CatalogCache, create_or_match, namespace_names, put_projector
from attnstore.store.lmdb.chunks.calls import LmdbChunks
from attnstore.store.lmdb.compaction import compact_live
from attnstore.store.lmdb.env import (
    Generation,
    remove_unused_generations,
    stale_generations,
)
from attnstore.store.lmdb.ingest import delete_entry as delete_in_txn
from attnstore.store.lmdb.ingest import (
    drop_features,
    drop_namespace_keys,
    evict_over_cap,
    flush_hits,
    set_features,
    write_entries,
)
from attnstore.store.lmdb.live import LiveGeneration
from attnstore.store.lmdb.prefix_blocks import LmdbPrefixBlocks
from attnstore.store.lmdb.reader import (
    decode_layers,
    entry_page,
    find_ref,
    live_lengths,
    load_hits,
    load_record,
    load_token_ids,
    read_outputs,
    store_stats,
)
from attnstore.store.lmdb.records import entry_key
from attnstore.store.lmdb.settings import DEFAULT_MAP_SIZE, StoreSettings
from attnstore.store.lmdb.verify import verify_live
from attnstore.store.namespace_rules import check_projector_version, drops_features, projector_update
from attnstore.store.reports import (
    NO_DRAM,
    CompactReport,
    FeaturesReport,
    IngestReport,
    StoreStats,
    VerifyReport,
)
from attnstore.store.validate import prepare_entry

if TYPE_CHECKING:
    from attnstore.store.lmdb.zarr_store import LMDBZarrStore

logger = logging.getLogger(__name__)

# Records per read transaction when listing entries (no transaction spans a yield).
_PAGE = 256


class LmdbMapStore(MapStoreBase):
    """The LMDB-backed map store. Open with :meth:`open`; use as a context manager.

    Hit counts are buffered in memory (``HitBuffer``) and written in one transaction (also
    inside an ingest's, before byte-cap eviction); :meth:`entry` includes counts not yet
    written; a read-only store keeps its counts in memory. Returned arrays always belong to
    the caller.
    """

    def __init__(self, live: LiveGeneration, settings: StoreSettings) -> None:
        super().__init__()
        self._live = live
        self._root = live.root
        self._settings = settings
        self._states: dict[str, NamespaceState] = {}
        self._catalog = CatalogCache()
        self._chunks = LmdbChunks(live, settings, self.get_namespace)
        self.chunks = self._chunks
        self.prefixes = LmdbPrefixBlocks(live, self.get_namespace)
        self._hits = HitBuffer(settings.hit_flush_count, settings.hit_flush_seconds, write=self._write_hits,
                               readonly=settings.readonly)
        self._read_helper = ThreadPoolExecutor(1, thread_name_prefix="attnstore-read")

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        create: bool = False,
        map_size: int = DEFAULT_MAP_SIZE,
        max_bytes: int | None = None,
        evict_low_water: float = DEFAULT_LOW_WATER,
        readonly: bool = False,
        hit_flush_count: int = DEFAULT_HIT_FLUSH_COUNT,
        hit_flush_seconds: float = DEFAULT_HIT_FLUSH_SECONDS,
    ) -> LmdbMapStore:
        """Open (or create) the store in directory ``path``.

        Args:
            path: store directory.
            create: create the store if it does not exist.
            map_size, max_bytes, evict_low_water, readonly, hit_flush_count, hit_flush_seconds: the
                ``StoreSettings`` fields (map size in bytes, cap on live entries' bytes (None: none), the
                fraction of it eviction goes down to, read-only, when hit counts are written). A DRAM cache
                in front is ``DramCache``'s (``open_store`` adds one).

        Raises:
            StoreNotFoundError: no store at ``path`` and ``create`` is False.
            StoreOpenError: another writer holds the store, or this process has it open.
            FormatVersionError: the store is in a format version this code does not read.
            ConfigError: invalid settings.
        """
        settings = StoreSettings(map_size=map_size, max_bytes=max_bytes, evict_low_water=evict_low_water,
                                 readonly=readonly, hit_flush_count=hit_flush_count,
                                 hit_flush_seconds=hit_flush_seconds)
        return cls(LiveGeneration.open(Path(path), settings, create=create), settings)

    # ------------------------------------------------------------------ plumbing

    @property
    def path(self) -> Path:
        """The store directory."""
        return self._root

    @property
    def generation(self) -> str:
        """Name of the generation this store reads now."""
        return self._live.name

    @property
    def readonly(self) -> bool:
        """True if opened read-only."""
        return self._settings.readonly

    # ---------------------------------------------------------------- capabilities
    # Every one but a change feed and shared admission counts: one process writes an LMDB store.

    supports_outputs_only = True
    supports_compaction = True  # into a new generation, swapped in

    @property
    def supports_writes(self) -> bool:
        """See :attr:`MapStoreBase.supports_writes`: unless opened read-only."""
        return not self._settings.readonly

    def _state(self, name: str) -> NamespaceState:
        state = self._states.get(name)
        if state is None:
            with self._live.read() as (gen, txn):
                state = self._state_in(txn, gen, name)
        return state

    def _state_in(self, txn: lmdb.Transaction, gen: Generation, name: str) -> NamespaceState:
        state = self._states.get(name)
        if state is None:
            # The layout is all a state needs: a damaged projector must not stop deletes or compaction.
            info = self._catalog.require(txn, gen.db, name, check_projector=False)
            state = self._states.setdefault(name, NamespaceState.of(info))
        return state

    def _all_states(self, txn: lmdb.Transaction, gen: Generation) -> dict[str, NamespaceState]:
        return {name: self._state_in(txn, gen, name) for name in namespace_names(txn, gen.db)}

    # ---------------------------------------------------------------- namespaces

    def _create_namespace(
        self, name: str, *, model: str, fingerprint: str, layout: NamespaceLayout, limits: TokenLimits | None
    ) -> NamespaceInfo:
        """See :meth:`MapStoreBase.create_namespace`; also raises ReadOnlyStoreError."""
        wanted = NamespaceInfo(name, model, fingerprint, layout, FORMAT_VERSION, time.time(), None, limits=limits)
        with self._live.write() as (gen, txn):
            info = create_or_match(self._catalog, txn, gen.db, wanted)
        if info is wanted:
            logger.info("created namespace %r (%s, codec %s)", name, model, layout.codec)
        return info

    def get_namespace(self, name: str) -> NamespaceInfo:
        """See :meth:`MapStoreBase.get_namespace`."""
        with self._live.read() as (gen, txn):
            info = self._catalog.load(txn, gen.db, name)
            if info is None:
                raise NamespaceNotFoundError(
                    f"no namespace {shown(name)} in the map store; existing: {shown(namespace_names(txn, gen.db), 512)}"
                )
        return info

    def list_namespaces(self) -> list[NamespaceInfo]:
        """See :meth:`MapStoreBase.list_namespaces`."""
        infos = []
        with self._live.read() as (gen, txn):
            for name in namespace_names(txn, gen.db):
                # Listings carry no projector to clients: a damaged one must not hide the others.
                info = self._catalog.load(txn, gen.db, name, check_projector=False)
                assert info is not None  # the name was just read from the catalog, in the same transaction
                infos.append(info)
        return infos

    def drop_namespace(self, name: str) -> None:
        """See :meth:`MapStoreBase.drop_namespace`; also raises ReadOnlyStoreError."""
        self._live.check_writable()
        with self._live.write() as (gen, txn):
            self._state_in(txn, gen, name)
            drop_namespace_keys(txn, gen.db, name)
        self._states.pop(name, None)
        self._hits.drop_namespace(name)
        self._removed(name, None)
        logger.info("dropped namespace %r", name)

    def _set_projector(self, name: str, blob: bytes, *, replace: bool) -> NamespaceInfo:
        """See :meth:`MapStoreBase.set_projector`; also raises ReadOnlyStoreError."""
        with self._live.write() as (gen, txn):
            # Unchecked: a projector that fails its checksum can still be replaced.
            info = self._catalog.require(txn, gen.db, name, check_projector=False)
            update = projector_update(info, blob, replace=replace)
            if update is None:
                return info
            dropped = drop_features(txn, gen.db, name) if drops_features(info, blob) else 0
            put_projector(txn, gen.db, update)
        if info.projector is not None:
            logger.warning("namespace %r: projector replaced (version %s), %s stored feature vectors dropped",
                           name, update.projector_version, dropped)
        return update

    # -------------------------------------------------------------------- ingest

    def ingest(
        self, namespace: str, entries: Iterable[NewEntry], *, projector_version: int | None = None
    ) -> IngestReport:
        """See :meth:`MapStoreBase.ingest`. One call is one LMDB transaction: pass batches
        sized to memory (the uncommitted pages are held until the commit).
        """
        self._live.check_writable()
        state = self._state(namespace)
        prepared = [prepare_entry(entry, state.layout, i) for i, entry in enumerate(entries)]
        if not prepared:
            return IngestReport([], [])
        now = time.time()
        max_bytes = self._settings.max_bytes
        with self._hits.draining(take=max_bytes is not None) as pending, self._live.write() as (gen, txn):
            if projector_version is not None:
                # Inside the write: a replacement cannot slip in between the check and the entries.
                info = self._catalog.require(txn, gen.db, namespace, check_projector=False)
                check_projector_version(info, projector_version)
            ids, new, featured = write_entries(txn, gen.db, state, prepared, now)
            evicted = None
            if max_bytes is not None:
                flush_hits(txn, gen.db, pending)
                self._chunks.reads.flush(txn, gen.db.chunks)
                protect = {(namespace, i) for i in new}
                evicted = evict_over_cap(
                    txn, gen.db, self._all_states(txn, gen), max_bytes, self._settings.evict_low_water, protect
                )
        if evicted is not None and evicted.count:
            for name, gone in evicted.ids.items():
                self._forget(name, gone)
            logger.warning("map store %s over its cap of %s bytes: evicted %s least recently hit entries (%s bytes)",
                           self._root, max_bytes, evicted.count, evicted.nbytes)
        logger.debug("ingested %s entries into %r (%s new)", len(ids), namespace, len(new))
        return IngestReport(list(ids), list(new), {} if evicted is None else dict(evicted.ids), featured)

    def _set_features(
        self, namespace: str, entry_ids: list[int], features: np.ndarray, projector_version: int
    ) -> FeaturesReport:
        """See :meth:`MapStoreBase.set_features`: one write transaction; also raises ReadOnlyStoreError."""
        self._live.check_writable()
        self._state(namespace)
        with self._live.write() as (gen, txn):
            # Inside the write: a replacement cannot slip in between the check and the vectors.
            check_projector_version(self._catalog.require(txn, gen.db, namespace, check_projector=False),
                                    projector_version)
            report = set_features(txn, gen.db, namespace, entry_ids, features)
        logger.info("namespace %r: %s feature vectors set (projector version %s), %s entries gone",
                    namespace, len(report.updated), projector_version, len(report.missing))
        return report

    # --------------------------------------------------------------------- reads

    def read_maps(self, namespace: str, entry_id: int) -> np.ndarray:
        """See :meth:`MapStoreBase.read_maps`."""
        state = self._state(namespace)
        with self._live.read() as (gen, txn):
            record = load_record(txn, gen.db, namespace, entry_id)
            out = np.empty(state.layout.map_shape(record.length), dtype=np.float16)  # (layers, heads, L, L)
            decode_layers(txn, gen.db, state, record, range(state.layout.layers), out, self._read_helper)
        return out

    def _read_layer(self, namespace: str, entry_id: int, layer: int) -> np.ndarray:
        """See :meth:`MapStoreBase.read_layer`: only that layer is read."""
        state = self._state(namespace)
        with self._live.read() as (gen, txn):
            record = load_record(txn, gen.db, namespace, entry_id)
            out = np.empty((1, state.layout.heads, record.length, record.length), dtype=np.float16)
            decode_layers(txn, gen.db, state, record, [layer], out)
        return out[0]  # (heads, L, L)

    def read_outputs(self, namespace: str, entry_id: int) -> np.ndarray | None:
        """See :meth:`MapStoreBase.read_outputs`."""
        state = self._state(namespace)
        with self._live.read() as (gen, txn):
            return read_outputs(txn, gen.db, state, load_record(txn, gen.db, namespace, entry_id))  # (L, hidden)

    def _find_by_hashes(self, namespace: str, token_hashes: list[bytes]) -> list[EntryRef | None]:
        """See :meth:`MapStoreBase.find_by_hashes`."""
        self._state(namespace)
        with self._live.read() as (gen, txn):
            return [find_ref(txn, gen.db, namespace, token_hash) for token_hash in token_hashes]

    def _info(self, namespace: str, record: EntryRecord, hits: int, last_hit: float) -> EntryInfo:
        pending_hits, pending_last = self._hits.get(namespace, record.id)  # counted, not yet written
        return record.info(hits + pending_hits, max(last_hit, pending_last))

    def entry(self, namespace: str, entry_id: int) -> EntryInfo:
        """See :meth:`MapStoreBase.entry`."""
        self._state(namespace)
        with self._live.read() as (gen, txn):
            record = load_record(txn, gen.db, namespace, entry_id)
            hits = load_hits(txn, gen.db, namespace, entry_id)
        return self._info(namespace, record, hits.hits, hits.last_hit)

    def token_ids(self, namespace: str, entry_ids: Sequence[int]) -> list[np.ndarray | None]:
        """See :meth:`MapStoreBase.token_ids`."""
        self._state(namespace)
        with self._live.read() as (gen, txn):
            return [load_token_ids(txn, gen.db, namespace, entry_id) for entry_id in entry_ids]

    def entries(self, namespace: str, length: int | None = None) -> Iterator[EntryInfo]:
        """See :meth:`MapStoreBase.entries`. Corrupt records are skipped (verify lists them).

        Raises:
            NamespaceNotFoundError: at the call, not at the first ``next``.
        """
        self._state(namespace)
        return self._iter_entries(namespace, length)

    def _iter_entries(self, namespace: str, length: int | None) -> Iterator[EntryInfo]:
        start: bytes | None = None
        while True:
            with self._live.read() as (gen, txn):
                page, start = entry_page(txn, gen.db, namespace, length, start, _PAGE)
            if self._settings.readonly:
                # Reading a page of records faults in the maps around them (``protocol.mapped_pages``): given
                # back page by page, a scan of a large store (the indexes' build at open) never holds much of it.
                drop_mapped_pages(gen.path)
            yield from (self._info(namespace, record, hits.hits, hits.last_hit) for record, hits in page)
            if start is None:
                return

    def lengths(self, namespace: str) -> list[int]:
        """See :meth:`MapStoreBase.lengths`."""
        self._state(namespace)
        with self._live.read() as (gen, txn):
            return live_lengths(txn, gen.db, namespace)

    # -------------------------------------------------------------- hits, delete

    def record_hits(self, namespace: str, ids: Iterable[int]) -> None:
        """See :meth:`MapStoreBase.record_hits`: buffered (see ``HitBuffer.record``)."""
        self._state(namespace)
        self._hits.record(namespace, ids)

    def flush_hits(self) -> None:
        """Write buffered hit counts now (see ``HitBuffer.flush``)."""
        self._hits.flush()

    def _forget(self, namespace: str, ids: list[int]) -> None:
        """Entries gone from the store leave the hit buffer, and the listeners hear of it (``on_removed``)."""
        self._hits.drop(namespace, ids)
        self._removed(namespace, ids)

    def _write_hits(self, pending: PendingHits) -> None:
        """Buffered hit counts in one transaction; also raises ReadOnlyStoreError."""
        self._live.check_writable()
        if pending:
            with self._live.write() as (gen, txn):
                flush_hits(txn, gen.db, pending)

    def _delete(self, namespace: str, ids: list[int]) -> int:
        """See :meth:`MapStoreBase.delete`; also raises ReadOnlyStoreError."""
        state = self._state(namespace)
        with self._live.write() as (gen, txn):
            deleted = sum(delete_in_txn(txn, gen.db, state, i) is not None for i in ids)
        self._forget(namespace, ids)
        return deleted

    def live_ids(self, namespace: str, ids: Sequence[int]) -> list[int]:
        """See :meth:`MapStoreBase.live_ids`: one read transaction."""
        self._state(namespace)
        with self._live.read() as (gen, txn):
            return [i for i in ids if txn.get(entry_key(namespace, i), db=gen.db.entries) is not None]

    # --------------------------------------------------------------------- admin

    def compact(self) -> CompactReport:
        """See :meth:`MapStoreBase.compact`. Writes a new generation and swaps it in;
        readers still on the old one finish there, and it is removed once no
        process holds it.

        Raises:
            ReadOnlyStoreError: the store is read-only.
            StoreNotFoundError: the store's directory was removed while open.
            StoreFullError: the disk has no room for the copy, or the new generation ran out of map
                size (the old one stays live).
        """
        self._live.check_writable()
        with self._live.write_lock:
            self._live.check_present()  # a compaction must never recreate a removed store directory
            self.flush_hits()
            report = compact_live(self._live, self._all_states, self._settings, on_retired=self._remove_retired)
        logger.info("compacted %s: %s", self._root, report)
        return report

    def _remove_retired(self) -> None:
        # Runs when the last in-process holder of a retired generation lets go.
        remove_unused_generations(self._root, keep=self._live.name)

    def verify(self) -> VerifyReport:
        """See :meth:`MapStoreBase.verify`."""
        report = verify_live(self._live, self._all_states, probe_write=not self._settings.readonly)
        if not report.ok:
            logger.warning("verify of %s found %s corrupt entries and %s other problems: %s",
                           self._root, len(report.corrupt), len(report.problems), report.problems)
        return report

    def storage_fault(self) -> str | None:
        """See :meth:`MapStoreBase.storage_fault`."""
        return self._live.fault()

    def stats(self) -> StoreStats:
        """See :meth:`MapStoreBase.stats`."""
        with self._live.read() as (gen, txn):
            stats = store_stats(
                txn, gen, self._all_states(txn, gen), self._settings, pending_hits=len(self._hits), dram=NO_DRAM,
            )
        count, nbytes = stale_generations(self._root, self._live.name)
        return dataclasses.replace(stats, stale_generations=count, stale_generation_bytes=nbytes)

    def zarr_store(self) -> LMDBZarrStore:
        """A read-only zarr store over the live generation, for inspection with zarr.

        Close it when done: it holds the generation open.
        """
        # zarr is needed only for inspection; importing it here keeps it off the hot path.
        from attnstore.store.lmdb.zarr_store import LMDBZarrStore

        gen = self._live.acquire()
        return LMDBZarrStore(gen.env, gen.db.zarr, read_only=True, on_close=gen.release, records=gen.db)

    def close(self) -> None:
        """See :meth:`MapStoreBase.close`."""
        if self._live.closed:
            return
        self._read_helper.shutdown(wait=True)
        if not self._settings.readonly:
            try:
                self.flush_hits()
            except (StoreFullError, StoreOpenError, StoreNotFoundError) as exc:
                logger.warning("map store %s: buffered hit counts lost on close: %s", self._root, exc)
        self._live.close()


def open_lmdb_store(
    path: Path, *, create: bool = False, max_bytes: int | None = None, map_size: int | None = None,
    readonly: bool = False,
) -> LmdbMapStore:
    """Open the LMDB store in folder ``path`` with the daemon's sizes (None: defaults; see ``LmdbMapStore.open``)."""
    return LmdbMapStore.open(
        path, create=create, max_bytes=max_bytes, readonly=readonly,
        map_size=DEFAULT_MAP_SIZE if map_size is None else map_size,
    )
