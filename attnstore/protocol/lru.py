"""A byte-bounded, thread-safe LRU of numpy arrays: the one cache both sides keep in memory.

The store's DRAM cache (``attnstore.store.dram``: decoded maps by entry) and the
node's local exact tier (``attnstore_client.tiers.local_exact``: outputs by token
hash) are both this: arrays kept until their bytes would pass a cap, least
recently used first out. It lives in ``protocol`` so the client may import it
(the client imports only ``attnstore.errors`` and ``attnstore.protocol``);
it imports numpy's type alone.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class LRUCounts:
    """Usage and counters of one :class:`ByteLRU`."""

    capacity_bytes: int
    bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int  # arrays pushed out to make room
    rejected: int  # arrays larger than the whole cap, never kept


class ByteLRU(Generic[K]):
    """Arrays by key, at most ``capacity_bytes`` of them (their ``nbytes``), least recently used out first.

    Thread-safe. The cache keeps the very array it is given: callers hand over arrays they no longer
    change, and must not change what :meth:`get` returns. Subclasses that check a condition together
    with a put (``dram.entries``' epoch) take :attr:`lock` around both: it is reentrant.

    Args:
        capacity_bytes: the cap; 0 keeps nothing.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.lock = threading.RLock()
        self._items: OrderedDict[K, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evictions = self._rejected = 0

    def get(self, key: K) -> np.ndarray | None:
        """The array under ``key``, now the most recently used (a hit), or None (a miss)."""
        with self.lock:
            array = self._items.get(key)
            if array is None:
                self._misses += 1
                return None
            self._items.move_to_end(key)
            self._hits += 1
            return array

    def __contains__(self, key: object) -> bool:
        with self.lock:
            return key in self._items

    def __len__(self) -> int:
        with self.lock:
            return len(self._items)

    def put(self, key: K, array: np.ndarray) -> bool:
        """Keep ``array`` under ``key`` (replacing what was there), pushing out the least recently used to make
        room; False, counted as rejected, for an array larger than the whole cap."""
        nbytes = array.nbytes
        with self.lock:
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
            self._items[key] = array
            self._bytes += nbytes
            return True

    def discard(self, keys: Iterable[K]) -> int:
        """Drop ``keys`` where kept; returns how many were."""
        dropped = 0
        with self.lock:
            for key in keys:
                array = self._items.pop(key, None)
                if array is not None:
                    self._bytes -= array.nbytes
                    dropped += 1
        return dropped

    def clear(self) -> None:
        """Drop every array (the counters stay)."""
        with self.lock:
            self._items.clear()
            self._bytes = 0

    def counts(self) -> LRUCounts:
        """Bytes, entries and counters now."""
        with self.lock:
            return LRUCounts(self.capacity_bytes, self._bytes, len(self._items), self._hits, self._misses,
                             self._evictions, self._rejected)
