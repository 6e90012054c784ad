"""The node-local exact tier: recent outputs of exact inputs, in this process, by token hash.

The cheapest hit there is: no projection, no call to the store, no forward. It
holds what this node fetched from the store's exact tier and what it computed
itself, as fp16 last hidden states (as the store keeps them), least recently
used first out once its bytes would pass the cap. Keys are the namespace
fingerprint and the row's token hash, so two models never share an entry.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from attnstore.errors import ConfigError


@dataclass(frozen=True, slots=True)
class LocalTierStats:
    """Usage of the node-local exact tier."""

    capacity_bytes: int
    bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int


class LocalExactTier:
    """A byte-bounded LRU of ``(L, hidden)`` fp16 outputs; thread-safe.

    Args:
        capacity_bytes: the cap (0 keeps nothing).
    """

    def __init__(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ConfigError(f"exact_cache_bytes must be an int >= 0, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0
        self._lock = threading.Lock()

    def get(self, key: bytes) -> np.ndarray | None:
        """The outputs stored under ``key`` (the caller must not change them), or None."""
        with self._lock:
            outputs = self._entries.get(key)
            if outputs is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return outputs

    def put(self, key: bytes, outputs: np.ndarray) -> None:
        """Keep ``outputs`` (stored as fp16) under ``key``; older entries leave to make room."""
        array = np.ascontiguousarray(outputs, dtype=np.float16)
        if array.nbytes > self.capacity_bytes:
            return
        with self._lock:
            previous = self._entries.pop(key, None)
            if previous is not None:
                self._bytes -= previous.nbytes
            self._entries[key] = array
            self._bytes += array.nbytes
            while self._bytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
                self._evictions += 1

    def clear(self) -> None:
        """Forget every entry (the counters stay)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> LocalTierStats:
        """Bytes, entries and counters now."""
        with self._lock:
            return LocalTierStats(
                self.capacity_bytes, self._bytes, len(self._entries), self._hits, self._misses, self._evictions
            )
