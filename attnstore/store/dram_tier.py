"""The DRAM tier: a byte-bounded, thread-safe LRU of decoded entries."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable

import numpy as np

from attnstore.store.reports import DramStats


class DramTier:
    """Byte-bounded LRU of decoded maps, keyed by ``(namespace, entry id)``.

    Cached arrays are made read-only; readers copy out of them. Every
    :meth:`discard` bumps an epoch, and :meth:`put` refuses an array loaded before
    the last discard, so a read racing a delete cannot cache the deleted entry.

    Args:
        capacity_bytes: most bytes of decoded maps held; 0 disables the tier.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[Hashable, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self._bytes = 0
        self._epoch = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._rejected = 0

    @property
    def epoch(self) -> int:
        """Counter bumped by every discard; pass it back to :meth:`put`."""
        return self._epoch

    def get(self, key: Hashable) -> np.ndarray | None:
        """The cached array (read-only) and mark it recently used, or None (counted as a miss)."""
        with self._lock:
            array = self._items.get(key)
            if array is None:
                self._misses += 1
                return None
            self._items.move_to_end(key)
            self._hits += 1
            return array

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._items

    def put(self, key: Hashable, array: np.ndarray, epoch: int | None = None) -> bool:
        """Cache ``array`` (taken over, made read-only) under ``key``, evicting LRU entries.

        Args:
            key: cache key.
            array: decoded maps; the tier keeps this very array.
            epoch: :attr:`epoch` read before the array was loaded; if a discard
                happened since, nothing is cached.

        Returns:
            True if cached.
        """
        nbytes = array.nbytes
        with self._lock:
            if epoch is not None and epoch != self._epoch:
                return False
            if nbytes > self.capacity_bytes:
                self._rejected += 1
                return False
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            while self._bytes + nbytes > self.capacity_bytes:
                _, evicted = self._items.popitem(last=False)
                self._bytes -= evicted.nbytes
                self._evictions += 1
            array.flags.writeable = False
            self._items[key] = array
            self._bytes += nbytes
            return True

    def discard(self, keys: Iterable[Hashable]) -> int:
        """Drop ``keys`` if cached; returns how many were. Always bumps the epoch."""
        dropped = 0
        with self._lock:
            self._epoch += 1
            for key in keys:
                array = self._items.pop(key, None)
                if array is not None:
                    self._bytes -= array.nbytes
                    dropped += 1
        return dropped

    def clear(self) -> None:
        """Drop everything (stats are kept)."""
        with self._lock:
            self._epoch += 1
            self._items.clear()
            self._bytes = 0

    def stats(self) -> DramStats:
        """Current usage and counters."""
        with self._lock:
            return DramStats(
                capacity_bytes=self.capacity_bytes,
                bytes=self._bytes,
                entries=len(self._items),
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                rejected=self._rejected,
            )
