"""Admission counts: how many distinct callers asked the exact tier about a token sequence, in fixed memory.

A row is worth writing back once several callers ask for it. Counting *distinct*
callers (a caller is a token's identity, never an address: see ``attnstore.server.auth``) rather than
asks keeps one client from admitting rows by asking twice: a writer's own lookups
count once, whatever it sends.

The counts are a count-min sketch with conservative update (``depth`` rows of
``width`` uint16 counters, saturating) over ``(namespace, token hash)``, beside a
Bloom filter of the ``(namespace, token hash, caller)`` pairs already counted, so a
caller's second ask adds nothing. Both are keyed with a random salt, so a client
cannot grind token sequences whose counters collide with a popular row's. Estimates
are never below the true count (collisions only admit early) and a false positive
of the filter only delays a row by one caller.

Counts fade by windows: every ``window`` counted asks the current sketch and filter
become the previous ones and a fresh pair starts. A row's count is its count in the
current window plus the previous one, and a pair in either filter is not counted
again, so counts older than two windows are forgotten and flooding the daemon with
asks to turn the windows cannot let one caller count twice: its pair stays known
for as long as its count does.

:class:`MemoryCounts` keeps them in this process (one daemon); a store that several
daemons share keeps them in the store (``MapStoreBase.admission_counts``: Redis), so
every daemon judges a WriteBack on the fleet's asks.
"""

from __future__ import annotations

import hashlib
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from attnstore.errors import ConfigError

SEEN_HASHES = 3  # bits set per (row, caller) pair in the filter
COUNTER_MAX = 0xFFFF  # counters saturate here (uint16)


@dataclass(frozen=True, slots=True)
class SketchShape:
    """Sizes of the admission counts (per namespace in a shared store, for all namespaces in memory).

    Raises:
        ConfigError: a size out of range.
    """

    depth: int = 4  # hash rows of the sketch: more rows, fewer over-estimates
    width: int = 1 << 18  # counters per row (uint16)
    seen_bits: int = 1 << 23  # bits of the filter of counted (row, caller) pairs
    window: int = 1 << 20  # counted asks per window; counts older than two windows are forgotten

    def __post_init__(self) -> None:
        if not 1 <= self.depth <= 8:
            raise ConfigError(f"admission sketch depth must be in 1..8, got {self.depth}")
        for name in ("width", "seen_bits"):
            value = getattr(self, name)
            if value < 8 or value & (value - 1):
                raise ConfigError(f"admission sketch {name} must be a power of two >= 8, got {value}")
        if self.window < 1:
            raise ConfigError(f"admission window must be >= 1 asks, got {self.window}")

    @property
    def nbytes(self) -> int:
        """Memory of the counts: two windows of counters and filter bits."""
        return 2 * (self.depth * self.width * 2 + self.seen_bits // 8)


@dataclass(frozen=True, slots=True)
class Hashed:
    """One ask, hashed: its counters (one per sketch row) and its filter bits."""

    slots: tuple[int, ...]  # (depth,) counter index within each row
    bits: tuple[int, ...]  # (SEEN_HASHES,) bit index in the filter


def hashed(shape: SketchShape, salt: bytes, namespace: str, token_hash: bytes, caller: str) -> Hashed:
    """The counters and filter bits of ``caller`` asking about ``token_hash`` in ``namespace``."""
    key = hashlib.blake2b(namespace.encode(), key=salt, digest_size=32).digest()
    row = hashlib.blake2b(token_hash, key=key, digest_size=4 * shape.depth).digest()
    slots = np.frombuffer(row, dtype="<u4") & (shape.width - 1)
    pair = hashlib.blake2b(token_hash + b"\0" + caller.encode(), key=key, digest_size=4 * SEEN_HASHES).digest()
    bits = np.frombuffer(pair, dtype="<u4") & (shape.seen_bits - 1)
    return Hashed(tuple(int(s) for s in slots), tuple(int(b) for b in bits))


def new_salt() -> bytes:
    """A random key for the hashes: clients cannot predict which rows share counters."""
    return os.urandom(16)


class AdmissionCounts(ABC):
    """Distinct callers per (namespace, token hash) over the last two windows. Thread-safe."""

    def __init__(self, shape: SketchShape) -> None:
        self.shape = shape

    @abstractmethod
    def observe(self, namespace: str, token_hashes: Sequence[bytes], caller: str) -> list[int]:
        """Count ``caller`` asking about each hash (once per pair); each hash's count after it.

        Raises:
            UnavailableError: a shared store cannot be reached.
        """

    @abstractmethod
    def counts(self, namespace: str, token_hashes: Sequence[bytes]) -> list[int]:
        """Each hash's count now, counting nothing.

        Raises:
            UnavailableError: a shared store cannot be reached.
        """

    @property
    @abstractmethod
    def windows(self) -> int:
        """Windows turned so far (by this process)."""


class MemoryCounts(AdmissionCounts):
    """The counts in this process's memory (``shape.nbytes``, fixed whatever the traffic)."""

    def __init__(self, shape: SketchShape | None = None) -> None:
        super().__init__(shape or SketchShape())
        self._salt = new_salt()
        self._lock = threading.Lock()
        self._counts = [self._zero_counts(), self._zero_counts()]  # current, previous: (depth, width) uint16
        self._seen = [self._zero_bits(), self._zero_bits()]  # current, previous: (seen_bits / 8,) uint8
        self._asks = 0  # counted in the current window
        self._windows = 0

    def _zero_counts(self) -> np.ndarray:
        return np.zeros((self.shape.depth, self.shape.width), dtype=np.uint16)

    def _zero_bits(self) -> np.ndarray:
        return np.zeros(self.shape.seen_bits // 8, dtype=np.uint8)

    def observe(self, namespace: str, token_hashes: Sequence[bytes], caller: str) -> list[int]:
        """See :meth:`AdmissionCounts.observe`."""
        asks = [hashed(self.shape, self._salt, namespace, key, caller) for key in token_hashes]
        rows = np.arange(self.shape.depth)
        found = []
        with self._lock:
            if self._asks >= self.shape.window:
                self._turn_window()
            current, previous = self._counts
            for ask in asks:
                slots = np.array(ask.slots)
                estimate = int(current[rows, slots].min())
                if not (self._has(self._seen[0], ask.bits) or self._has(self._seen[1], ask.bits)):
                    for bit in ask.bits:
                        self._seen[0][bit >> 3] |= np.uint8(1 << (bit & 7))
                    # Conservative update: raise only the counters at the minimum, so collisions inflate less.
                    estimate = min(estimate + 1, COUNTER_MAX)
                    np.maximum.at(current, (rows, slots), np.uint16(estimate))
                found.append(estimate + int(previous[rows, slots].min()))
            self._asks += len(asks)
        return found

    def counts(self, namespace: str, token_hashes: Sequence[bytes]) -> list[int]:
        """See :meth:`AdmissionCounts.counts`."""
        rows = np.arange(self.shape.depth)
        slots = [np.array(hashed(self.shape, self._salt, namespace, key, "").slots) for key in token_hashes]
        with self._lock:
            return [sum(int(counts[rows, s].min()) for counts in self._counts) for s in slots]

    @property
    def windows(self) -> int:
        """See :meth:`AdmissionCounts.windows`."""
        with self._lock:
            return self._windows

    def _turn_window(self) -> None:
        # Callers hold the lock.
        self._counts = [self._zero_counts(), self._counts[0]]
        self._seen = [self._zero_bits(), self._seen[0]]
        self._asks = 0
        self._windows += 1

    @staticmethod
    def _has(bits: np.ndarray, positions: tuple[int, ...]) -> bool:
        return all(bits[p >> 3] & (1 << (p & 7)) for p in positions)
