"""Admission of written-back rows: how often the daemon was asked about a token sequence.

A row is worth writing back once it repeats: the daemon counts the token hashes
its exact tier is asked about in a count-min sketch and marks a missed row
*admit* once its hash has been asked about ``admit_after`` times (this ask
included). The sketch's memory is fixed (``depth * width`` uint32 counters,
4 MiB by default) whatever the traffic; an estimate can only be too high (hash
collisions), never too low, so a repeated row is never refused admission. To
let yesterday's popular rows fade, every counter is halved after ``aging``
counted asks (TinyLFU's reset): a row must keep repeating to stay admitted.

The counts live in memory only: a restarted daemon starts counting afresh, which
at worst delays the write-back of a row by ``admit_after - 1`` asks.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from attnstore.errors import ConfigError


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """The admission rule and the sketch's size."""

    admit_after: int = 2  # asks before a missed row is admitted; 1 admits every miss; 0 turns write-back off
    depth: int = 4  # hash rows of the sketch: more rows, fewer over-estimates
    width: int = 1 << 18  # counters per row: depth * width * 4 bytes of memory (4 MiB by default)
    aging: int = 1 << 20  # counted asks after which every counter is halved

    def __post_init__(self) -> None:
        if self.admit_after < 0:
            raise ConfigError(f"admit_after must be >= 0 (0 turns write-back off), got {self.admit_after}")
        if not 1 <= self.depth <= 8:
            raise ConfigError(f"admission sketch depth must be in 1..8, got {self.depth}")
        if self.width < 1 or self.width & (self.width - 1):
            raise ConfigError(f"admission sketch width must be a power of two, got {self.width}")
        if self.aging < 1:
            raise ConfigError(f"admission aging must be >= 1 asks, got {self.aging}")

    @property
    def nbytes(self) -> int:
        """Memory of the sketch's counters."""
        return self.depth * self.width * 4


@dataclass(frozen=True, slots=True)
class AdmissionStats:
    """What the admission rule has done since the daemon started."""

    asked: int  # token hashes counted
    admitted: int  # missed rows marked admit
    agings: int  # times every counter was halved
    sketch_bytes: int


class Admission:
    """A count-min sketch with aging over (namespace, token hash); thread-safe.

    Args:
        config: the rule and the sketch's size.
    """

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self._counts = np.zeros((self.config.depth, self.config.width), dtype=np.uint32)  # (depth, width)
        self._lock = threading.Lock()
        self._since_aging = 0
        self._asked = 0
        self._admitted = 0
        self._agings = 0

    @property
    def enabled(self) -> bool:
        """Whether write-back is on (``admit_after`` > 0)."""
        return self.config.admit_after > 0

    def observe(self, namespace: str, token_hashes: Sequence[bytes | None], missed: Sequence[bool]) -> list[bool]:
        """Count one ask of each hash; which rows are admitted (missed, and asked ``admit_after`` times).

        Args:
            namespace: the namespace asked.
            token_hashes: each row's exact-tier key; None (no key) is neither counted nor admitted.
            missed: whether each row missed the exact tier (only a miss can be admitted).
        """
        rows = [i for i, key in enumerate(token_hashes) if key]
        if not rows or not self.enabled:
            return [False] * len(token_hashes)
        slots = np.stack([self._slots(namespace, token_hashes[i] or b"") for i in rows])  # (n, depth)
        depth = np.arange(self.config.depth)
        admitted = [False] * len(token_hashes)
        with self._lock:
            for k, i in enumerate(rows):
                # Conservative update: raise only the counters at the minimum, so collisions inflate less.
                current = self._counts[depth, slots[k]]  # (depth,)
                estimate = int(current.min()) + 1
                np.maximum.at(self._counts, (depth, slots[k]), np.uint32(estimate))
                if missed[i] and estimate >= self.config.admit_after:
                    admitted[i] = True
                    self._admitted += 1
            self._asked += len(rows)
            self._since_aging += len(rows)
            if self._since_aging >= self.config.aging:
                self._counts >>= 1
                self._since_aging = 0
                self._agings += 1
        return admitted

    def count(self, namespace: str, token_hash: bytes) -> int:
        """The sketch's estimate of how often ``token_hash`` was asked about (never below the truth, until aging)."""
        slots = self._slots(namespace, token_hash)
        with self._lock:
            return int(self._counts[np.arange(self.config.depth), slots].min())

    def stats(self) -> AdmissionStats:
        """Counters since start."""
        with self._lock:
            return AdmissionStats(self._asked, self._admitted, self._agings, self.config.nbytes)

    def _slots(self, namespace: str, token_hash: bytes) -> np.ndarray:
        """The row's counter in each hash row: independent 32-bit slices of one keyed digest."""
        digest = hashlib.blake2b(token_hash, key=namespace.encode()[:64], digest_size=4 * self.config.depth).digest()
        return np.frombuffer(digest, dtype="<u4").astype(np.int64) & (self.config.width - 1)  # (depth,)
