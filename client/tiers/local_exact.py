"""The node-local exact tier: recent outputs of exact inputs, in this process, by token hash.

The cheapest hit there is: no projection, no call to the store, no forward. It
holds what this node fetched from the store's exact tier and what it computed
itself, as fp16 last hidden states (as the store keeps them), least recently
used first out once its bytes would pass the cap (``LocalOutputs``, on the
byte-bounded LRU the store's DRAM cache uses too: ``attnstore.protocol.lru``). Keys are
the namespace fingerprint and the row's token hash, so two models never share
an entry.

A row is kept the second time it is offered, not the first (a Bloom-filter
doorkeeper, as TinyLFU's): a bulk call of rows seen once, the common case for
``encode`` over a corpus, would otherwise fill the tier with rows that never
come back and hold its whole cap (256 MiB by default) for nothing; a row that
does come back is kept from its second time on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from attnstore.errors import ConfigError
from attnstore.protocol.lru import ByteLRU
from attnstore_client.call.rows import HiddenRows, Row
from attnstore_client.call.state import Call
from attnstore_client.tiers.base import Tier, TierContext


@dataclass(frozen=True, slots=True)
class LocalTierStats:
    """Usage of the node-local exact tier."""

    capacity_bytes: int
    bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int
    declined: int = 0  # offers not kept: their key's first


class _Doorkeeper:
    """Which keys were offered before: a Bloom filter of two bit positions per key, cleared when it fills."""

    _BITS = 1 << 23  # 1 MiB
    _CAPACITY = _BITS // 16  # keys remembered before it clears: about 1.4% false positives at most

    def __init__(self) -> None:
        self._bits = np.zeros(self._BITS // 8, dtype=np.uint8)
        self._keys = 0

    def seen(self, key: bytes) -> bool:
        """Whether ``key`` was offered since the last clear; remembers it either way."""
        positions = [int.from_bytes(key[-8:-4], "little") % self._BITS, int.from_bytes(key[-4:], "little") % self._BITS]
        seen = all(self._bits[p >> 3] & (1 << (p & 7)) for p in positions)
        if not seen:
            if self._keys >= self._CAPACITY:
                self._bits[:] = 0
                self._keys = 0
            for p in positions:
                self._bits[p >> 3] |= 1 << (p & 7)
            self._keys += 1
        return seen


class LocalOutputs:
    """A byte-bounded LRU of ``(L, hidden)`` fp16 outputs that keeps a key from its second offer on; thread-safe.

    Args:
        capacity_bytes: the cap (0 keeps nothing).
        admit_after: offers of a key before it is kept: 2 (the default: see the module docstring) or 1 (at once).
    """

    def __init__(self, capacity_bytes: int, *, admit_after: int = 2) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ConfigError(f"exact_cache_bytes must be an int >= 0, got {capacity_bytes!r}")
        if admit_after not in (1, 2):
            raise ConfigError(f"LocalOutputs: admit_after must be 1 or 2, got {admit_after!r}")
        self._lru: ByteLRU[bytes] = ByteLRU(capacity_bytes)
        self._declined = 0
        self._door = _Doorkeeper() if admit_after == 2 else None

    @property
    def capacity_bytes(self) -> int:
        """The cap (0 keeps nothing)."""
        return self._lru.capacity_bytes

    def get(self, key: bytes) -> np.ndarray | None:
        """The outputs stored under ``key`` (the caller must not change them), or None."""
        return self._lru.get(key)

    def put(self, key: bytes, outputs: np.ndarray) -> None:
        """Keep ``outputs`` (stored as fp16) under ``key`` if it was offered before; older entries leave to make
        room."""
        if 2 * outputs.size > self.capacity_bytes:  # its fp16 bytes
            return
        with self._lru.lock:
            if self._door is not None and key not in self._lru and not self._door.seen(key):
                self._declined += 1
                return
        self._lru.put(key, np.ascontiguousarray(outputs, dtype=np.float16))

    def clear(self) -> None:
        """Forget every entry (the counters stay)."""
        self._lru.clear()

    def stats(self) -> LocalTierStats:
        """Bytes, entries and counters now."""
        with self._lru.lock:
            counts = self._lru.counts()
            return LocalTierStats(counts.capacity_bytes, counts.bytes, counts.entries, counts.hits, counts.misses,
                                  counts.evictions, self._declined)


class LocalExactTier(Tier):
    """Serves the rows whose outputs this process holds (``LocalOutputs``), when the call uses exact tiers."""

    name: ClassVar[str] = "local_exact"

    def __init__(self, context: TierContext, outputs: LocalOutputs) -> None:
        self._context = context
        self.outputs = outputs

    def key(self, row: Row) -> bytes:
        """The row's key here: the model's fingerprint and the row's token hash."""
        return self._context.fingerprint.encode() + row.key

    def serve(self, rows: list[Row], call: Call) -> list[Row]:
        """See :meth:`Tier.serve`."""
        if not call.settings.exact:
            return rows
        found: list[tuple[Row, np.ndarray]] = []
        left: list[Row] = []
        for row in rows:
            outputs = self.outputs.get(self.key(row))
            if outputs is None:
                left.append(row)
            else:
                found.append((row, outputs))
        if found:
            hidden = HiddenRows.stacked([self._context.to_device(outputs) for _, outputs in found])
            call.deliver([row for row, _ in found], hidden, "exact")
            call.counts.local_hits += len(found)
        return left
