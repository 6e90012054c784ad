"""MapStore: attention maps in a zarr v3 layout on LMDB, with a DRAM tier and prefetch.

See DESIGN.md "Map store". One store is a directory of generations (see
``lmdb_env``); one process writes, any number read. Reads run on the calling
thread inside one LMDB read transaction; writes are serialised by a lock and
each ``ingest``/``delete`` call is one transaction, so it is all-or-nothing.

Entry ids come from a persisted uint64 counter starting at 1 (0 stays free to
mean "no entry" on the wire) and are never reused, also not after compaction.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import lmdb
import numpy as np
import torch

from attnstore.errors import (
    ChecksumError,
    ConfigError,
    EntryNotFoundError,
    MapShapeError,
    NamespaceExistsError,
    NamespaceNotFoundError,
    ReadOnlyStoreError,
    StoreFullError,
    StoreNotFoundError,
    StoreOpenError,
)
from attnstore.store.base import MapStoreBase
from attnstore.store.lmdb.catalog import NamespaceState, load_namespace, namespace_names, put_namespace, put_projector
from attnstore.store.lmdb.compaction import write_next_generation
from attnstore.store.dram_tier import DramTier
from attnstore.store.hit_buffer import HitBuffer
from attnstore.store.lmdb.ingest import (
    META_EVICTED_BYTES,
    META_EVICTED_ENTRIES,
    evict_over_cap,
    find_existing,
    flush_hits,
    read_counter,
    write_entries,
)
from attnstore.store.lmdb.ingest import delete_entry as delete_in_txn
from attnstore.store.lmdb.ingest import drop_namespace_keys
from attnstore.protocol.records import (
    FORMAT_VERSION,
    TOKEN_HASH_BYTES,
    EntryInfo,
    NamespaceInfo,
    NamespaceLayout,
    NewEntry,
    check_namespace_name,
)
from attnstore.store.lmdb.env import (
    CURRENT_FILE,
    Generation,
    acquire_writer_lock,
    current_signature,
    is_disk_full,
    read_current,
    release_lock,
    remove_unused_generations,
)
from attnstore.store.lmdb.opening import create_store, open_live
from attnstore.store.prefetch import Prefetcher
from attnstore.store.lmdb.reader import decode_layers, entry_page, load_hits, load_record, read_outputs
from attnstore.store.lmdb.records import EntryRecord
from attnstore.store.reports import CompactReport, StoreStats, VerifyReport
from attnstore.store.lmdb.settings import (
    DEFAULT_DRAM_BYTES,
    DEFAULT_HIT_FLUSH_COUNT,
    DEFAULT_HIT_FLUSH_SECONDS,
    DEFAULT_MAP_SIZE,
    StoreSettings,
)
from attnstore.store.lmdb.stats import live_lengths, namespace_stats
from attnstore.store.validate import prepare_entry
from attnstore.store.lmdb.verify import verify_generation

if TYPE_CHECKING:
    from attnstore.store.lmdb.zarr_store import LMDBZarrStore

logger = logging.getLogger(__name__)

# Records per read transaction when listing entries (no transaction spans a yield).
_PAGE = 256


class MapStore(MapStoreBase):
    """The LMDB-backed map store. Open with :meth:`open`; use as a context manager.

    Hit counters: :meth:`record_hits` counts in memory. The counts are written in
    one transaction when ``hit_flush_count`` distinct entries are pending or
    ``hit_flush_seconds`` have passed (checked on the next ``record_hits``), and
    before byte-cap eviction, compaction and close. :meth:`entry` includes
    counts not yet written. A read-only store keeps its counts in memory.

    DRAM tier: reads look there first; a read that goes to LMDB admits the entry
    (a second copy, owned by the tier). Returned tensors always belong to the caller.
    """

    def __init__(self, root: Path, gen: Generation, *, writer_fd: int | None, settings: StoreSettings) -> None:
        self._root = root
        self._gen = gen
        self._writer_fd = writer_fd
        self._settings = settings
        self._gen_lock = threading.Lock()
        self._write_lock = threading.RLock()
        self._states: dict[str, NamespaceState] = {}
        self._dram = DramTier(settings.dram_bytes)
        self._hits = HitBuffer(settings.hit_flush_count, settings.hit_flush_seconds)
        self._prefetcher = Prefetcher(self._prefetch_one, max_queue=settings.prefetch_queue)
        self._read_helper = ThreadPoolExecutor(1, thread_name_prefix="attnstore-read")
        self._current_sig = current_signature(root)
        self._closed = False

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        create: bool = False,
        map_size: int = DEFAULT_MAP_SIZE,
        dram_bytes: int = DEFAULT_DRAM_BYTES,
        max_bytes: int | None = None,
        readonly: bool = False,
        hit_flush_count: int = DEFAULT_HIT_FLUSH_COUNT,
        hit_flush_seconds: float = DEFAULT_HIT_FLUSH_SECONDS,
    ) -> MapStore:
        """Open (or create) the store in directory ``path``.

        Args:
            path: store directory.
            create: create the store if it does not exist.
            map_size: LMDB map size in bytes (address space; the file grows as used).
            dram_bytes: DRAM tier capacity in bytes (0 disables it).
            max_bytes: cap on live entries' stored bytes; None for no cap.
            readonly: open without writing (no writer lock; any number of readers).
            hit_flush_count: see the class docstring.
            hit_flush_seconds: see the class docstring.

        Raises:
            StoreNotFoundError: no store at ``path`` and ``create`` is False.
            StoreOpenError: another writer holds the store, or this process has it open.
            FormatVersionError: the store is in a format version this code does not read.
            ConfigError: invalid settings.
        """
        settings = StoreSettings(
            map_size=map_size,
            dram_bytes=dram_bytes,
            max_bytes=max_bytes,
            readonly=readonly,
            hit_flush_count=hit_flush_count,
            hit_flush_seconds=hit_flush_seconds,
        )
        if readonly and create:
            raise ConfigError("MapStore.open(): create=True and readonly=True exclude each other")
        root = Path(path)
        exists = (root / CURRENT_FILE).exists()
        if not exists and not create:
            raise StoreNotFoundError(f"no map store at {root} (no {CURRENT_FILE} file); pass create=True to make one")
        writer_fd = None
        if not readonly:
            root.mkdir(parents=True, exist_ok=True)
            writer_fd = acquire_writer_lock(root)
        try:
            gen = open_live(root, settings) if (root / CURRENT_FILE).exists() else create_store(root, settings)
            if writer_fd is not None:
                remove_unused_generations(root, keep=gen.name)
        except BaseException:
            if writer_fd is not None:
                release_lock(writer_fd)
            raise
        return cls(root, gen, writer_fd=writer_fd, settings=settings)

    # ------------------------------------------------------------------ plumbing

    @property
    def path(self) -> Path:
        """The store directory."""
        return self._root

    @property
    def generation(self) -> str:
        """Name of the generation this store reads now."""
        return self._gen.name

    @property
    def readonly(self) -> bool:
        """True if opened read-only."""
        return self._settings.readonly

    def _acquire(self) -> Generation:
        with self._gen_lock:
            if self._closed:
                raise StoreOpenError(f"map store {self._root} is closed")
            if self._settings.readonly:
                self._follow_current()
            return self._gen.acquire()

    def _follow_current(self) -> None:
        # A read-only store sees the writer's compactions: reopen when CURRENT changed.
        try:
            signature = current_signature(self._root)
        except FileNotFoundError:
            return
        if signature == self._current_sig:
            return
        name = read_current(self._root)
        if name != self._gen.name:
            new = open_live(self._root, self._settings)
            old, self._gen = self._gen, new
            old.release()
            logger.info("map store %s: now reading %s", self._root, new.name)
        self._current_sig = signature

    @contextmanager
    def _read_txn(self) -> Iterator[tuple[Generation, object]]:
        gen = self._acquire()
        try:
            with gen.env.begin(buffers=True) as txn:
                yield gen, txn
        finally:
            gen.release()

    @contextmanager
    def _write_txn(self) -> Iterator[tuple[Generation, object]]:
        self._check_writable()
        with self._write_lock:
            gen = self._acquire()
            try:
                with gen.env.begin(write=True) as txn:
                    yield gen, txn
            except lmdb.Error as exc:
                if is_disk_full(exc):
                    raise self._full_error(exc) from None
                raise
            finally:
                gen.release()

    def _full_error(self, exc: Exception) -> StoreFullError:
        return StoreFullError(
            f"map store {self._root} is full (map_size {self._settings.map_size} bytes): {exc}; nothing of the"
            " failed write is visible. Reopen with a larger map_size, or compact first (a full map has no free"
            " page even for a delete), then delete entries and compact again"
        )

    def _check_writable(self) -> None:
        if self._settings.readonly:
            raise ReadOnlyStoreError(f"map store {self._root} is open read-only")

    def _state(self, name: str) -> NamespaceState:
        state = self._states.get(name)
        if state is None:
            state = self._states.setdefault(name, NamespaceState.of(self.get_namespace(name)))
        return state

    def _state_in(self, txn, gen: Generation, name: str) -> NamespaceState:
        state = self._states.get(name)
        if state is None:
            info = load_namespace(txn, gen.db, name)
            if info is None:
                raise NamespaceNotFoundError(f"no namespace {name!r} in map store {self._root}")
            state = self._states.setdefault(name, NamespaceState.of(info))
        return state

    def _all_states(self, txn, gen: Generation) -> dict[str, NamespaceState]:
        return {name: self._state_in(txn, gen, name) for name in namespace_names(txn, gen.db)}

    # ---------------------------------------------------------------- namespaces

    def create_namespace(self, name: str, *, model: str, fingerprint: str, layout: NamespaceLayout) -> NamespaceInfo:
        """See :meth:`MapStoreBase.create_namespace`; also raises ReadOnlyStoreError."""
        check_namespace_name(name)
        if not isinstance(layout, NamespaceLayout):
            raise ConfigError(f"layout must be a NamespaceLayout, got {type(layout).__name__}")
        if not isinstance(model, str) or not isinstance(fingerprint, str) or not fingerprint:
            raise ConfigError(
                f"model and fingerprint must be strings (fingerprint non-empty), got {model!r}, {fingerprint!r}"
            )
        with self._write_txn() as (gen, txn):
            existing = load_namespace(txn, gen.db, name)
            if existing is not None:
                if (existing.model, existing.fingerprint, existing.layout) == (model, fingerprint, layout):
                    return existing
                raise NamespaceExistsError(
                    f"namespace {name!r} exists with model {existing.model!r}, fingerprint {existing.fingerprint!r},"
                    f" {existing.layout}; requested model {model!r}, fingerprint {fingerprint!r}, {layout}"
                )
            info = NamespaceInfo(name, model, fingerprint, layout, FORMAT_VERSION, time.time(), None)
            put_namespace(txn, gen.db, info)
        logger.info("created namespace %r (%s, codec %s)", name, model, layout.codec)
        return info

    def get_namespace(self, name: str) -> NamespaceInfo:
        """See :meth:`MapStoreBase.get_namespace`."""
        with self._read_txn() as (gen, txn):
            info = load_namespace(txn, gen.db, name)
            if info is None:
                raise NamespaceNotFoundError(
                    f"no namespace {name!r} in map store {self._root}; existing: {namespace_names(txn, gen.db)}"
                )
        return info

    def list_namespaces(self) -> list[NamespaceInfo]:
        """See :meth:`MapStoreBase.list_namespaces`."""
        with self._read_txn() as (gen, txn):
            return [load_namespace(txn, gen.db, name) for name in namespace_names(txn, gen.db)]  # type: ignore[misc]

    def drop_namespace(self, name: str) -> None:
        """See :meth:`MapStoreBase.drop_namespace`; also raises ReadOnlyStoreError."""
        self._check_writable()
        with self._write_txn() as (gen, txn):
            self._state_in(txn, gen, name)
            drop_namespace_keys(txn, gen.db, name)
        self._states.pop(name, None)
        self._dram.clear()  # rare admin work: simpler than tracking the namespace's keys
        self._hits.drop_namespace(name)
        logger.info("dropped namespace %r", name)

    def set_projector(self, name: str, blob: bytes) -> None:
        """See :meth:`MapStoreBase.set_projector`."""
        if not isinstance(blob, bytes | bytearray | memoryview):
            raise ConfigError(f"projector blob must be bytes (safetensors), got {type(blob).__name__}")
        with self._write_txn() as (gen, txn):
            self._state_in(txn, gen, name)
            put_projector(txn, gen.db, name, bytes(blob))

    # -------------------------------------------------------------------- ingest

    def ingest(self, namespace: str, entries: Iterable[NewEntry]) -> list[int]:
        """See :meth:`MapStoreBase.ingest`. One call is one LMDB transaction: pass batches
        sized to memory (the uncommitted pages are held until the commit).
        """
        self._check_writable()
        state = self._state(namespace)
        prepared = [prepare_entry(entry, state.layout, i) for i, entry in enumerate(entries)]
        if not prepared:
            return []
        now = time.time()
        max_bytes = self._settings.max_bytes
        pending = self._hits.drain() if max_bytes is not None else {}
        try:
            with self._write_txn() as (gen, txn):
                ids, new = write_entries(txn, gen.db, state, prepared, now)
                evicted = None
                if max_bytes is not None:
                    flush_hits(txn, gen.db, pending)
                    protect = {(namespace, i) for i in new}
                    evicted = evict_over_cap(
                        txn, gen.db, self._all_states(txn, gen), max_bytes, self._settings.evict_low_water, protect
                    )
        except BaseException:
            self._hits.restore(pending)
            raise
        if evicted is not None and evicted.count:
            for name, gone in evicted.ids.items():
                self._dram.discard((name, i) for i in gone)
                self._hits.drop(name, gone)
            logger.warning(
                "map store %s over its cap of %s bytes: evicted %s least recently hit entries (%s bytes)",
                self._root,
                max_bytes,
                evicted.count,
                evicted.nbytes,
            )
        logger.debug("ingested %s entries into %r (%s new)", len(ids), namespace, len(new))
        return ids

    # --------------------------------------------------------------------- reads

    def _load_maps(self, namespace: str, entry_id: int) -> np.ndarray:
        state = self._state(namespace)
        with self._read_txn() as (gen, txn):
            record = load_record(txn, gen.db, namespace, entry_id)
            out = np.empty(state.layout.map_shape(record.length), dtype=np.float16)  # (layers, heads, L, L)
            decode_layers(txn, gen.db, state, record, range(state.layout.layers), out, self._read_helper)
        return out

    def read_maps(self, namespace: str, entry_id: int, *, cache: bool = True) -> torch.Tensor:
        """See :meth:`MapStoreBase.read_maps`.

        Args:
            namespace: namespace name.
            entry_id: entry id.
            cache: admit the entry into the DRAM tier if it came from LMDB.
        """
        key = (namespace, entry_id)
        cached = self._dram.get(key)
        if cached is not None:
            return torch.from_numpy(cached.copy())  # (layers, heads, L, L)
        epoch = self._dram.epoch
        maps = self._load_maps(namespace, entry_id)  # (layers, heads, L, L)
        if cache and maps.nbytes <= self._dram.capacity_bytes:
            self._dram.put(key, maps.copy(), epoch)
        return torch.from_numpy(maps)

    def read_layer(self, namespace: str, entry_id: int, layer: int) -> torch.Tensor:
        """See :meth:`MapStoreBase.read_layer`."""
        state = self._state(namespace)
        if not 0 <= layer < state.layout.layers:
            raise MapShapeError(
                f"layer {layer} is out of range: namespace {namespace!r} has {state.layout.layers} layers"
            )
        cached = self._dram.get((namespace, entry_id))
        if cached is not None:
            return torch.from_numpy(cached[layer].copy())  # (heads, L, L)
        with self._read_txn() as (gen, txn):
            record = load_record(txn, gen.db, namespace, entry_id)
            out = np.empty((1, state.layout.heads, record.length, record.length), dtype=np.float16)
            decode_layers(txn, gen.db, state, record, [layer], out)
        return torch.from_numpy(out[0])  # (heads, L, L)

    def read_outputs(self, namespace: str, entry_id: int) -> torch.Tensor | None:
        """See :meth:`MapStoreBase.read_outputs`."""
        state = self._state(namespace)
        with self._read_txn() as (gen, txn):
            outputs = read_outputs(txn, gen.db, state, load_record(txn, gen.db, namespace, entry_id))
        return None if outputs is None else torch.from_numpy(outputs)  # (L, hidden)

    def find_by_hash(self, namespace: str, token_hash: bytes) -> int | None:
        """See :meth:`MapStoreBase.find_by_hash`."""
        if len(token_hash) != TOKEN_HASH_BYTES:
            raise MapShapeError(f"token_hash must be {TOKEN_HASH_BYTES} bytes, got {len(token_hash)}")
        self._state(namespace)
        with self._read_txn() as (gen, txn):
            return find_existing(txn, gen.db, namespace, bytes(token_hash))

    def _info(self, namespace: str, record: EntryRecord, hits: int, last_hit: float) -> EntryInfo:
        pending_hits, pending_last = self._hits.get(namespace, record.id)
        return EntryInfo(
            id=record.id,
            length=record.length,
            token_hash=record.token_hash,
            created=record.created,
            hits=hits + pending_hits,
            last_hit=max(last_hit, pending_last),
            feature=record.feature,
            nbytes=record.nbytes,
            token_ids=record.token_ids,
        )

    def entry(self, namespace: str, entry_id: int) -> EntryInfo:
        """See :meth:`MapStoreBase.entry`."""
        self._state(namespace)
        with self._read_txn() as (gen, txn):
            record = load_record(txn, gen.db, namespace, entry_id)
            hits = load_hits(txn, gen.db, namespace, entry_id)
        return self._info(namespace, record, hits.hits, hits.last_hit)

    def token_ids(self, namespace: str, entry_ids: Sequence[int]) -> list[np.ndarray | None]:
        """See :meth:`MapStoreBase.token_ids`."""
        self._state(namespace)
        found: list[np.ndarray | None] = []
        with self._read_txn() as (gen, txn):
            for entry_id in entry_ids:
                try:
                    found.append(load_record(txn, gen.db, namespace, entry_id).token_ids)
                except (EntryNotFoundError, ChecksumError):
                    found.append(None)  # deleted meanwhile, or corrupt (verify reports it)
        return found

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
            with self._read_txn() as (gen, txn):
                page, start = entry_page(txn, gen.db, namespace, length, start, _PAGE)
            yield from (self._info(namespace, record, hits.hits, hits.last_hit) for record, hits in page)
            if start is None:
                return

    def lengths(self, namespace: str) -> list[int]:
        """See :meth:`MapStoreBase.lengths`."""
        self._state(namespace)
        with self._read_txn() as (gen, txn):
            return live_lengths(txn, gen.db, namespace)

    # -------------------------------------------------------------- hits, delete

    def record_hits(self, namespace: str, ids: Iterable[int]) -> None:
        """See :meth:`MapStoreBase.record_hits` and the class docstring for when counts are written."""
        self._state(namespace)
        due = self._hits.add(namespace, ids, time.time())
        if due and not self._settings.readonly:
            self.flush_hits()

    def flush_hits(self) -> None:
        """Write buffered hit counts now (one transaction)."""
        self._check_writable()
        pending = self._hits.drain()
        if not pending:
            return
        try:
            with self._write_txn() as (gen, txn):
                flush_hits(txn, gen.db, pending)
        except BaseException:
            self._hits.restore(pending)
            raise

    def delete(self, namespace: str, ids: Iterable[int]) -> int:
        """See :meth:`MapStoreBase.delete`; also raises ReadOnlyStoreError."""
        state = self._state(namespace)
        ids = [int(i) for i in ids]
        with self._write_txn() as (gen, txn):
            deleted = sum(delete_in_txn(txn, gen.db, state, i) is not None for i in ids)
        self._dram.discard((namespace, i) for i in ids)
        self._hits.drop(namespace, ids)
        return deleted

    # ------------------------------------------------------------------ prefetch

    def _prefetch_one(self, namespace: str, entry_id: int) -> None:
        key = (namespace, entry_id)
        if key in self._dram:
            return
        epoch = self._dram.epoch
        self._dram.put(key, self._load_maps(namespace, entry_id), epoch)

    def prefetch(self, namespace: str, ids: Iterable[int]) -> None:
        """See :meth:`MapStoreBase.prefetch`. Entries already in the DRAM tier are skipped."""
        self._state(namespace)
        if self._dram.capacity_bytes:
            self._prefetcher.submit(namespace, (i for i in ids if (namespace, int(i)) not in self._dram))

    def wait_prefetch(self, timeout: float | None = None) -> bool:
        """See :meth:`MapStoreBase.wait_prefetch`."""
        return self._prefetcher.wait(timeout)

    def dead_threads(self) -> list[str]:
        """See :meth:`MapStoreBase.dead_threads`: the prefetch worker, the only long-lived one."""
        return [] if self._prefetcher.alive else ["attnstore-prefetch"]

    # --------------------------------------------------------------------- admin

    def compact(self) -> CompactReport:
        """See :meth:`MapStoreBase.compact`. Writes a new generation and swaps it in;
        readers still on the old one finish there, and it is removed once no
        process holds it.

        Raises:
            ReadOnlyStoreError: the store is read-only.
            StoreFullError: the new generation ran out of map size (the old one stays live).
        """
        self._check_writable()
        start = time.perf_counter()
        with self._write_lock:
            self.flush_hits()
            old = self._acquire()
            try:
                with old.env.begin() as txn:
                    states = self._all_states(txn, old)
                try:
                    new, counts = write_next_generation(
                        self._root,
                        old,
                        states,
                        map_size=self._settings.map_size,
                        txn_bytes=self._settings.compact_txn_bytes,
                    )
                except lmdb.Error as exc:
                    if is_disk_full(exc):
                        raise self._full_error(exc) from None
                    raise
                with self._gen_lock:
                    retired, self._gen = self._gen, new
                    self._current_sig = current_signature(self._root)
                retired.on_closed = self._remove_retired
                retired.release()
                report = CompactReport(
                    old_generation=old.name,
                    new_generation=new.name,
                    entries=counts.entries,
                    orphan_chunks_dropped=counts.orphan_chunks_dropped,
                    bytes_before=old.file_bytes(),
                    bytes_after=new.file_bytes(),
                    seconds=time.perf_counter() - start,
                )
            finally:
                old.release()
            remove_unused_generations(self._root, keep=new.name)
        logger.info("compacted %s: %s", self._root, report)
        return report

    def _remove_retired(self) -> None:
        # Runs when the last in-process holder of a retired generation lets go.
        remove_unused_generations(self._root, keep=self._gen.name)

    def verify(self) -> VerifyReport:
        """See :meth:`MapStoreBase.verify`."""
        gen = self._acquire()
        try:
            with gen.env.begin() as txn:
                states = self._all_states(txn, gen)
            report = verify_generation(gen, states)
        finally:
            gen.release()
        if not report.ok:
            logger.warning("verify of %s found %s corrupt entries", self._root, len(report.corrupt))
        return report

    def stats(self) -> StoreStats:
        """See :meth:`MapStoreBase.stats`."""
        with self._read_txn() as (gen, txn):
            namespaces = namespace_stats(txn, gen.db, self._all_states(txn, gen))
            evicted_entries = read_counter(txn, gen.db, META_EVICTED_ENTRIES)
            evicted_bytes = read_counter(txn, gen.db, META_EVICTED_BYTES)
            generation, file_bytes = gen.name, gen.file_bytes()
        return StoreStats(
            path=str(self._root),
            generation=generation,
            format_version=FORMAT_VERSION,
            entries=sum(n.entries for n in namespaces),
            stored_bytes=sum(n.stored_bytes for n in namespaces),
            raw_bytes=sum(n.raw_bytes for n in namespaces),
            file_bytes=file_bytes,
            map_size=self._settings.map_size,
            max_bytes=self._settings.max_bytes,
            evicted_entries=evicted_entries,
            evicted_bytes=evicted_bytes,
            pending_hits=len(self._hits),
            namespaces=namespaces,
            dram=self._dram.stats(),
        )

    def zarr_store(self) -> LMDBZarrStore:
        """A read-only zarr store over the live generation, for inspection with zarr.

        Close it when done: it holds the generation open.
        """
        # zarr is needed only for inspection; importing it here keeps it off the hot path.
        from attnstore.store.lmdb.zarr_store import LMDBZarrStore

        gen = self._acquire()
        return LMDBZarrStore(gen.env, gen.db.zarr, read_only=True, on_close=gen.release)

    def close(self) -> None:
        """See :meth:`MapStoreBase.close`."""
        with self._gen_lock:
            if self._closed:
                return
        self._prefetcher.close()
        self._read_helper.shutdown(wait=True)
        if not self._settings.readonly:
            try:
                self.flush_hits()
            except (StoreFullError, StoreOpenError) as exc:
                logger.warning("map store %s: buffered hit counts lost on close: %s", self._root, exc)
        with self._gen_lock:
            self._closed = True
            gen = self._gen
        gen.release()
        if self._writer_fd is not None:
            release_lock(self._writer_fd)
            self._writer_fd = None
        self._dram.clear()

