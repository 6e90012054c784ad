"""Admission of written-back rows: a missed row is admitted once enough distinct callers asked for it.

The daemon counts, per namespace, the callers that asked its exact tier about a
token sequence and missed (``attnstore.store.admission``: fixed memory, counts
that fade by windows) and marks a missed row *admit* once ``admit_after`` distinct
callers have asked, this one included. A caller is an identity, never an address
(its token's name, or its client certificate; see ``attnstore.server.auth``), and
only callers that may write are counted (a read token's asks count nothing), so
one writer (asking about its own rows any number of times, from any number of
hosts or connections, helped by any number of read tokens) counts once: with
``admit_after`` >= 2 it cannot admit a row no other writer asked for, and
``admit_after`` - 1 colluding writers cannot either. ``admit_after`` 1 admits
every miss (it trusts every writer), 0 turns write-back off.

Where the store is shared by several daemons (Redis) the counts live in the
store, so the daemon that takes a row's WriteBack sees the asks every daemon
answered; otherwise they live in this process and a restart starts them afresh
(at worst a row waits for ``admit_after`` - 1 more callers).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from attnstore.errors import ConfigError, StorageError, StoreFullError
from attnstore.store.admission import AdmissionCounts, MemoryCounts, SketchShape

log = logging.getLogger(__name__)

_LOG_SECONDS = 30.0  # a store that keeps refusing the counts is reported this often


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """The admission rule and the size of its counts."""

    admit_after: int = 2  # distinct callers before a missed row is admitted; 1 admits every miss; 0: write-back off
    shape: SketchShape = SketchShape()  # the counts' sizes (per namespace in a shared store)

    def __post_init__(self) -> None:
        if isinstance(self.admit_after, bool) or not isinstance(self.admit_after, int) or self.admit_after < 0:
            raise ConfigError(f"admit_after must be an int >= 0 (0 turns write-back off), got {self.admit_after!r}")


@dataclass(frozen=True, slots=True)
class AdmissionStats:
    """What the admission rule has done since the daemon started."""

    asked: int  # missed rows counted (with a token hash)
    admitted: int  # missed rows marked admit
    windows: int  # windows this daemon turned (counts older than two windows are forgotten)
    sketch_bytes: int  # memory of the counts (in the store, per namespace, when shared)
    shared: bool  # the counts live in the store every daemon of the fleet reads
    failed: int = 0  # lookups whose asks could not be counted (a full or failing shared store): none admitted


class Admission:
    """The admission rule over a set of counts; thread-safe.

    Args:
        config: the rule and the counts' sizes.
        counts: where the counts live; None keeps them in this process.
    """

    def __init__(self, config: AdmissionConfig | None = None, counts: AdmissionCounts | None = None) -> None:
        self.config = config or AdmissionConfig()
        self._shared = counts is not None
        self._counts = counts if counts is not None else MemoryCounts(self.config.shape)
        self._lock = threading.Lock()
        self._asked = 0
        self._admitted = 0
        self._failed = 0  # lookups whose asks could not be counted (a full or failing shared store)
        self._failure_logged = float("-inf")

    @property
    def enabled(self) -> bool:
        """Whether write-back is on (``admit_after`` > 0)."""
        return self.config.admit_after > 0

    def observe(
        self, namespace: str, token_hashes: Sequence[bytes | None], missed: Sequence[bool], caller: str | None = ""
    ) -> list[bool]:
        """Count ``caller`` asking about each missed row; which rows are admitted.

        Args:
            namespace: the namespace asked.
            token_hashes: each row's exact-tier key; None (no key) is neither counted nor admitted.
            missed: whether each row missed the exact tier (only a miss is counted, and admitted).
            caller: who asks (``attnstore.server.auth.Caller.key``); each counts once per row. None: a caller
                that cannot write (a read token): nothing is counted and no row is admitted for it.

        Raises:
            UnavailableError: shared counts cannot be reached.
        """
        rows = [i for i, key in enumerate(token_hashes) if key and missed[i]]
        admitted = [False] * len(token_hashes)
        if not rows or not self.enabled or caller is None:
            return admitted
        try:
            counts = self._counts.observe(namespace, [token_hashes[i] or b"" for i in rows], caller)
        except (StoreFullError, StorageError) as exc:
            # Counting writes to a shared store: a full or failing one costs these rows their admission,
            # never the lookup its answer (reads go on when Redis is full).
            self._count_failed(namespace, exc)
            return admitted
        for i, count in zip(rows, counts, strict=True):
            admitted[i] = count >= self.config.admit_after
        with self._lock:
            self._asked += len(rows)
            self._admitted += sum(admitted)
        return admitted

    def _count_failed(self, namespace: str, exc: Exception) -> None:
        now = time.monotonic()
        with self._lock:
            self._failed += 1
            due = now - self._failure_logged >= _LOG_SECONDS
            if due:
                self._failure_logged = now
        if due:
            log.warning("event=admission_not_counted namespace=%s failed=%d error=%s detail='rows are not admitted"
                        " while the store refuses the counts'", namespace, self._failed, exc)

    def admitted(self, namespace: str, token_hashes: Sequence[bytes]) -> list[bool]:
        """Whether each row is admitted now (counting nothing): what a WriteBack is judged on.

        Raises:
            UnavailableError: shared counts cannot be reached.
        """
        if not token_hashes:
            return []
        return [n >= self.config.admit_after for n in self._counts.counts(namespace, token_hashes)]

    def count(self, namespace: str, token_hash: bytes) -> int:
        """How many distinct callers asked about ``token_hash`` (never below the truth within two windows)."""
        return self._counts.counts(namespace, [token_hash])[0]

    def stats(self) -> AdmissionStats:
        """Counters since start."""
        with self._lock:
            return AdmissionStats(self._asked, self._admitted, self._counts.windows, self._counts.shape.nbytes,
                                  self._shared, self._failed)
