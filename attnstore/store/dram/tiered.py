"""DramTiered: the DRAM tier, read-ahead and buffered hit counts in front of any backend's own reads and writes.

A backend takes it on by inheriting it (before ``MapStoreBase``), calling
:meth:`DramTiered._start_tier` when it opens and :meth:`DramTiered._stop_tier`
when it closes, and giving it five hooks: how to load one entry's maps, one
layer of them, which ids are live, how to write buffered hit counts, and whether
it may. Every read of maps then goes through the tier, every hit is buffered,
and prefetch, served-maps admission and the background thread's health are
answered here, the same for every backend.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Iterable, Mapping

import numpy as np

from attnstore.errors import MapShapeError
from attnstore.store.arrays import NamespaceState
from attnstore.store.dram.hit_buffer import HitBuffer
from attnstore.store.dram.hot_maps import HotMaps
from attnstore.store.reports import DramStats, PrefetchReport

PendingHits = Mapping[tuple[str, int], tuple[int, float]]  # (namespace, id) -> (hits, last hit)
_PREFETCH_THREAD = "attnstore-prefetch"


class DramTiered:
    """The DRAM tier and the hit buffer of a backend (see the module docstring)."""

    _hot: HotMaps
    _hits: HitBuffer

    def _start_tier(self, *, dram_bytes: int, prefetch_queue: int, hit_flush_count: int,
                    hit_flush_seconds: float) -> None:
        """Open the tier (``dram_bytes`` 0: no DRAM tier and no prefetch; hits are buffered either way)."""
        self._hits = HitBuffer(hit_flush_count, hit_flush_seconds)
        self._hot = HotMaps(self._load_maps, capacity_bytes=dram_bytes, prefetch_queue=prefetch_queue)

    def _stop_tier(self) -> None:
        """Stop prefetching and empty the tier (the backend flushes buffered hits itself, as it may)."""
        self._hot.close()

    # ---- the backend's hooks ----------------------------------------------------------------------

    @abstractmethod
    def _state(self, name: str) -> NamespaceState:
        """The namespace's layout and arrays (raises NamespaceNotFoundError)."""

    @abstractmethod
    def _load_maps(self, namespace: str, entry_id: int) -> np.ndarray:
        """One entry's maps ``(layers, heads, L, L)`` fp16 from the backend itself (raises as ``read_maps``)."""

    @abstractmethod
    def _load_layer(self, namespace: str, entry_id: int, layer: int) -> np.ndarray:
        """One layer ``(heads, L, L)`` fp16 from the backend itself; ``layer`` is in range."""

    @abstractmethod
    def _live_ids(self, namespace: str, ids: list[int]) -> list[int]:
        """Those of ``ids`` a live entry has, in order; one read for the lot."""

    @abstractmethod
    def _write_hits(self, pending: PendingHits) -> None:
        """Add buffered hit counts to the stored ones (``pending`` may be empty); raise to keep them buffered."""

    @abstractmethod
    def _writes_hits(self) -> bool:
        """Whether buffered counts are written when due (a read-only store keeps them in memory)."""

    # ---- reads ------------------------------------------------------------------------------------

    def read_maps(self, namespace: str, entry_id: int, *, cache: bool = True) -> np.ndarray:
        """See :meth:`MapStoreBase.read_maps`: from DRAM, else loaded (and admitted when ``cache``)."""
        return self._hot.maps(namespace, entry_id, cache=cache)  # (layers, heads, L, L)

    def read_layer(self, namespace: str, entry_id: int, layer: int) -> np.ndarray:
        """See :meth:`MapStoreBase.read_layer`: from DRAM when the whole entry is there."""
        layers = self._state(namespace).layout.layers
        if not 0 <= layer < layers:
            raise MapShapeError(f"layer {layer} is out of range: namespace {namespace!r} has {layers} layers")
        return self._hot.layer(namespace, entry_id, layer, lambda: self._load_layer(namespace, entry_id, layer))

    def _pending_hits(self, namespace: str, entry_id: int) -> tuple[int, float]:
        """Hits counted here and not yet written, and the last one's time, for :meth:`MapStoreBase.entry`."""
        return self._hits.get(namespace, entry_id)

    # ---- hits -------------------------------------------------------------------------------------

    def record_hits(self, namespace: str, ids: Iterable[int]) -> None:
        """See :meth:`MapStoreBase.record_hits`: counted in memory, written once ``hit_flush_count`` entries are
        pending or ``hit_flush_seconds`` have passed (checked on the next call), and before eviction, compaction
        and close."""
        self._state(namespace)
        due = self._hits.add(namespace, ids, time.time())
        if due and self._writes_hits():
            self.flush_hits()

    def flush_hits(self) -> None:
        """Write buffered hit counts now; they stay buffered if the write fails."""
        with self._hits.draining() as pending:
            self._write_hits(pending)

    # ---- prefetch and admission -------------------------------------------------------------------

    def prefetch(self, namespace: str, ids: Iterable[int]) -> PrefetchReport:
        """See :meth:`MapStoreBase.prefetch`. Entries already in DRAM are skipped; ids are checked against the
        live entries here, in one read, so the worker queues only entries that exist and unknown ids cost a
        count, not a log line each."""
        self._state(namespace)
        wanted = list(dict.fromkeys(int(i) for i in ids))
        known = self._live_ids(namespace, wanted) if wanted else []
        return PrefetchReport(queued=self._hot.prefetch(namespace, known), unknown=len(wanted) - len(known))

    def maps_served(self, namespace: str, ids: Iterable[int]) -> None:
        """See :meth:`MapStoreBase.maps_served`: admitted to DRAM on a second serve (``hot_maps``)."""
        self._hot.served(namespace, ids)

    def wait_prefetch(self, timeout: float | None = None) -> bool:
        """See :meth:`MapStoreBase.wait_prefetch`."""
        return self._hot.wait_prefetch(timeout)

    def dead_threads(self) -> list[str]:
        """See :meth:`MapStoreBase.dead_threads`: the prefetch worker, the only long-lived one."""
        return [] if self._hot.alive else [_PREFETCH_THREAD]

    def background_errors(self) -> dict[str, int]:
        """See :meth:`MapStoreBase.background_errors`: the prefetch worker's."""
        return {_PREFETCH_THREAD: self._hot.prefetch_errors}

    # ---- forgetting -------------------------------------------------------------------------------

    def _forget(self, namespace: str, ids: Iterable[int]) -> None:
        """Entries gone from the store (deleted, evicted, vanished) leave DRAM and the hit buffer."""
        ids = list(ids)
        self._hot.discard(namespace, ids)
        self._hits.drop(namespace, ids)

    def _forget_namespace(self, namespace: str) -> None:
        """A dropped namespace's entries leave DRAM (all of it: rare admin work) and the hit buffer."""
        self._hot.clear()
        self._hits.drop_namespace(namespace)

    def _forget_all(self) -> None:
        """Every entry leaves DRAM and every buffered count is dropped (the store was replaced under us)."""
        self._hot.clear()
        self._hits.drain()

    def _tier_stats(self) -> tuple[int, DramStats]:
        """Entries with buffered hits, and the DRAM tier's usage, for :meth:`MapStoreBase.stats`."""
        return len(self._hits), self._hot.stats()
