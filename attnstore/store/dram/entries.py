"""The DRAM cache's entries: decoded maps by ``(namespace, entry id)`` in the shared byte-bounded LRU."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import numpy as np

from attnstore.protocol.lru import ByteLRU
from attnstore.store.reports import DramStats


class DramEntries(ByteLRU[Hashable]):
    """Byte-bounded LRU of decoded maps, keyed by ``(namespace, entry id)``.

    Cached arrays are made read-only; readers copy out of them. Every
    :meth:`discard` bumps an epoch, and :meth:`put` refuses an array loaded before
    the last discard, so a read racing a delete cannot cache the deleted entry.

    Args:
        capacity_bytes: most bytes of decoded maps held; 0 disables the cache.
    """

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._epoch = 0

    @property
    def epoch(self) -> int:
        """Counter bumped by every discard; pass it back to :meth:`put`."""
        return self._epoch

    def put(self, key: Hashable, array: np.ndarray, epoch: int | None = None) -> bool:
        """Cache ``array`` (taken over, made read-only) under ``key``, evicting LRU entries.

        Args:
            key: cache key.
            array: decoded maps; the cache keeps this very array.
            epoch: :attr:`epoch` read before the array was loaded; if a discard
                happened since, nothing is cached.

        Returns:
            True if cached.
        """
        with self.lock:
            if epoch is not None and epoch != self._epoch:
                return False
            if array.nbytes <= self.capacity_bytes:
                array.flags.writeable = False
            return super().put(key, array)

    def discard(self, keys: Iterable[Hashable]) -> int:
        """Drop ``keys`` if cached; returns how many were. Always bumps the epoch."""
        with self.lock:
            self._epoch += 1
            return super().discard(keys)

    def clear(self) -> None:
        """Drop everything (stats are kept)."""
        with self.lock:
            self._epoch += 1
            super().clear()

    def stats(self) -> DramStats:
        """Current usage and counters."""
        counts = self.counts()
        return DramStats(
            capacity_bytes=counts.capacity_bytes,
            bytes=counts.bytes,
            entries=counts.entries,
            hits=counts.hits,
            misses=counts.misses,
            evictions=counts.evictions,
            rejected=counts.rejected,
        )
