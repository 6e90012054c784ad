"""Where a chunk's stored keys and values come from: ``ChunkSource``, and its in-memory implementation.

A chunk's keys and values depend on the tokens it was computed after (the
namespace's instruction), so its key names both: ``chunk_key(context, ids)``
hashes the context's token hash and the chunk's own. The instruction itself is
stored the same way, as a chunk computed after nothing (``context=None``).

Keys are stored before RoPE (``ChunkKV``): the fusion rotates them to the
positions the chunk takes in each prompt with the model's own rotary embedding,
so reuse at any position is the computation the model itself does there, for
any RoPE scaling, with nothing composed and no position recorded.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attnstore.errors import ChecksumError, ConfigError
from attnstore.protocol.keys import chunk_key as chunk_key  # re-exported: the tiers and builds name it here

# In-memory chunks: about 1,000 SmolLM2 chunks of 40 tokens in fp16 (2 x 30 layers x 3 KV heads x 64 x 40 x 2 bytes).
DEFAULT_CHUNK_CACHE_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class ChunkKV:
    """A chunk's keys (before RoPE) and values at every layer, computed on its own after its context.

    Attributes:
        keys: ``(layers, KVH, C, d)``, not rotated.
        values: ``(layers, KVH, C, d)``.
    """

    keys: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        if self.keys.shape != self.values.shape or self.keys.dim() != 4:
            raise ConfigError(f"ChunkKV: keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)} "
                              "must both be (layers, KVH, C, d)")

    @property
    def length(self) -> int:
        """Tokens of the chunk."""
        return int(self.keys.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


@dataclass(frozen=True, slots=True)
class ChunkTokens:
    """What a chunk was computed from: its token ids, after the tokens of ``context`` (None: after nothing)."""

    ids: tuple[int, ...]
    context: tuple[int, ...] | None = None


class ChunkSource(ABC):
    """Stored chunks by key (``chunk_key``); a missing chunk is None, never an error (a damaged one is)."""

    @abstractmethod
    def get(self, key: bytes) -> ChunkKV | None:
        """The chunk stored under ``key``, or None.

        Raises:
            ChecksumError: the source holds the chunk damaged (a store's source; the message names it).
        """

    def get_many(self, keys: Sequence[bytes], damaged: set[bytes] | None = None) -> dict[bytes, ChunkKV]:
        """The chunks of ``keys`` the source holds; the keys of those it holds damaged are added to ``damaged``.

        A source over a store answers in one call; this default asks :meth:`get` for each.
        """
        found: dict[bytes, ChunkKV] = {}
        for key in keys:
            try:
                chunk = self.get(key)
            except ChecksumError:
                if damaged is not None:
                    damaged.add(key)
                continue
            if chunk is not None:
                found[key] = chunk
        return found

    @abstractmethod
    def put(self, key: bytes, chunk: ChunkKV, tokens: ChunkTokens | None = None) -> None:
        """Store ``chunk`` under ``key`` (a source may decline or evict: ``get`` is the only promise); ``tokens``
        are what it was computed from (a store's source sends them: the daemon derives the key from them)."""

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is stored (a later ``get`` may still miss if it is evicted meanwhile)."""
        return self.get(key) is not None


@dataclass(frozen=True, slots=True)
class ChunkSourceStats:
    """Usage of an in-memory chunk source."""

    capacity_bytes: int
    bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int


class MemoryChunkSource(ChunkSource):
    """Chunks in this process, least recently used first out once their bytes would pass ``capacity_bytes``.

    Args:
        capacity_bytes: the cap; a chunk larger than it is not kept.

    Raises:
        ConfigError: a negative cap.
    """

    def __init__(self, capacity_bytes: int = DEFAULT_CHUNK_CACHE_BYTES) -> None:
        if capacity_bytes < 0:
            raise ConfigError(f"MemoryChunkSource: capacity_bytes must be >= 0, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._entries: OrderedDict[bytes, ChunkKV] = OrderedDict()
        self._bytes = self._hits = self._misses = self._evictions = 0
        self._lock = threading.Lock()

    def get(self, key: bytes) -> ChunkKV | None:
        """See :meth:`ChunkSource.get`."""
        with self._lock:
            chunk = self._entries.get(key)
            if chunk is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return chunk

    def contains(self, key: bytes) -> bool:
        """See :meth:`ChunkSource.contains` (not counted as a hit or a miss)."""
        with self._lock:
            return key in self._entries

    def put(self, key: bytes, chunk: ChunkKV, tokens: ChunkTokens | None = None) -> None:
        """See :meth:`ChunkSource.put`."""
        size = chunk.nbytes
        with self._lock:
            if size > self._capacity:
                return
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            while self._entries and self._bytes + size > self._capacity:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
                self._evictions += 1
            self._entries[key] = chunk
            self._bytes += size

    def stats(self) -> ChunkSourceStats:
        """Its usage so far."""
        with self._lock:
            return ChunkSourceStats(self._capacity, self._bytes, len(self._entries), self._hits, self._misses,
                                    self._evictions)
