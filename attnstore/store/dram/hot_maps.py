"""Hot maps: decoded entries held in DRAM in front of a backend, filled by reads and by prefetch.

Backend-neutral: a backend hands in how to load one entry's maps (all layers)
and, per read, how to load one layer; this object decides when DRAM answers
instead. Reads of a whole entry admit it; ``prefetch`` loads entries on a
background thread (its own transactions: LMDB's stay on the thread that opened
them). Arrays handed out are copies that belong to the caller.

Admission of served maps (``served``): an entry whose maps are sent to a client
layer by layer is admitted on its second serve. The first serve only remembers
its key among the last :data:`SERVED_HISTORY`; a second serve while remembered
queues it for loading in the background. Entries that keep hitting thus come
from DRAM from their third serve on, while one-off hits (a scan of distinct
inputs) never push them out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

import numpy as np

from attnstore.store.dram.entries import DramEntries
from attnstore.store.dram.prefetch import Prefetcher
from attnstore.store.reports import DramStats

LoadMaps = Callable[[str, int], np.ndarray]  # (namespace, id) -> (layers, heads, L, L) fp16

# Entries served once, remembered for admission on a second serve: keys only, a few hundred KiB at most.
SERVED_HISTORY = 4096


class HotMaps:
    """A byte-bounded DRAM cache of decoded entries with a prefetch thread.

    Args:
        load_maps: loads one entry's maps from the backend.
        capacity_bytes: DRAM cache capacity (0 turns the cache and prefetch off).
        prefetch_queue: entries waiting for prefetch at most; more are dropped.
    """

    def __init__(self, load_maps: LoadMaps, *, capacity_bytes: int, prefetch_queue: int) -> None:
        self._load_maps = load_maps
        self._dram = DramEntries(capacity_bytes)
        self._prefetcher = Prefetcher(self._prefetch_one, max_queue=prefetch_queue)
        self._served_once: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._served_lock = threading.Lock()

    def maps(self, namespace: str, entry_id: int, *, cache: bool = True) -> np.ndarray:
        """One entry's maps ``(layers, heads, L, L)``: from DRAM, else loaded (and admitted when ``cache``)."""
        key = (namespace, entry_id)
        cached = self._dram.get(key)
        if cached is not None:
            return cached.copy()
        epoch = self._dram.epoch
        maps = self._load_maps(namespace, entry_id)
        if cache and maps.nbytes <= self._dram.capacity_bytes:
            self._dram.put(key, maps.copy(), epoch)
        return maps

    def layer(self, namespace: str, entry_id: int, layer: int, load_layer: Callable[[], np.ndarray]) -> np.ndarray:
        """One layer ``(heads, L, L)`` of an entry: from DRAM when the entry is there, else ``load_layer()``."""
        cached = self._dram.get((namespace, entry_id))
        if cached is not None:
            return cached[layer].copy()
        return load_layer()

    def prefetch(self, namespace: str, ids: Iterable[int]) -> int:
        """Load entries into DRAM in the background; returns how many were queued (not those already
        there, nor those past the queue's bound, nor any without a DRAM cache)."""
        if not self._dram.capacity_bytes:
            return 0
        return self._prefetcher.submit(namespace, (i for i in ids if (namespace, int(i)) not in self._dram))

    def served(self, namespace: str, ids: Iterable[int]) -> None:
        """Entries whose maps were just sent to a client: each one served for the second time is admitted.

        Admitted means queued for loading in the background (see the module docstring).
        """
        if not self._dram.capacity_bytes:
            return
        again: list[int] = []
        with self._served_lock:
            for entry_id in ids:
                key = (namespace, int(entry_id))
                if key in self._dram:
                    continue
                if key in self._served_once:
                    del self._served_once[key]
                    again.append(key[1])
                else:
                    self._served_once[key] = None
                    if len(self._served_once) > SERVED_HISTORY:
                        self._served_once.popitem(last=False)
        if again:
            self._prefetcher.submit(namespace, again)

    def wait_prefetch(self, timeout: float | None = None) -> bool:
        """Block until queued prefetches are done; False on timeout."""
        return self._prefetcher.wait(timeout)

    @property
    def alive(self) -> bool:
        """Whether the prefetch thread still runs (or has not been needed yet)."""
        return self._prefetcher.alive

    @property
    def prefetch_errors(self) -> int:
        """Unexpected errors the prefetch thread caught (logged with their traceback) and survived."""
        return self._prefetcher.unexpected

    def discard(self, namespace: str, ids: Iterable[int]) -> None:
        """Forget entries that were deleted or evicted."""
        self._dram.discard((namespace, int(i)) for i in ids)

    def clear(self) -> None:
        """Forget every entry (also those served once: their ids may stand for other entries now)."""
        self._dram.clear()
        with self._served_lock:
            self._served_once.clear()

    def stats(self) -> DramStats:
        """Usage of the DRAM cache."""
        return self._dram.stats()

    def close(self) -> None:
        """Stop prefetching and empty the cache."""
        self._prefetcher.close()
        self._dram.clear()

    def _prefetch_one(self, namespace: str, entry_id: int) -> None:
        key = (namespace, entry_id)
        if key in self._dram:
            return
        epoch = self._dram.epoch
        self._dram.put(key, self._load_maps(namespace, entry_id), epoch)
