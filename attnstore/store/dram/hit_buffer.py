"""Hit counters buffered in memory, so a lookup hit does not cost a write transaction."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

PendingHits = Mapping[tuple[str, int], tuple[int, float]]  # (namespace, id) -> (hits, last hit), not yet written


WriteHits = Callable[[PendingHits], None]  # writes pending counts to the store; raises to keep them pending


class HitBuffer:
    """Pending ``(hits, last_hit)`` per ``(namespace, entry id)``, thread-safe: a store's ``record_hits`` and
    ``flush_hits``, written once for every backend that buffers them.

    :meth:`add` reports when a flush is due: once ``flush_count`` distinct
    entries are pending or ``flush_seconds`` have passed since the last flush.

    Args:
        flush_count: distinct pending entries that make a flush due.
        flush_seconds: age of the oldest unflushed hit that makes a flush due.
        clock: monotonic clock, for tests.
        write: the store's write of pending counts (one transaction or round of scripts).
        readonly: the store is read-only: counts stay in memory, never written.
    """

    def __init__(
        self, flush_count: int, flush_seconds: float, clock: Callable[[], float] = time.monotonic, *,
        write: WriteHits, readonly: bool = False,
    ) -> None:
        self._flush_count = flush_count
        self._flush_seconds = flush_seconds
        self._clock = clock
        self._write = write
        self._readonly = readonly
        self._pending: dict[tuple[str, int], tuple[int, float]] = {}
        self._last_flush = clock()
        self._lock = threading.Lock()

    def add(self, namespace: str, ids: Iterable[int], when: float) -> bool:
        """Count one hit for each id at unix time ``when``; returns True when a flush is due."""
        with self._lock:
            for entry_id in ids:
                key = (namespace, int(entry_id))
                hits, _ = self._pending.get(key, (0, 0.0))
                self._pending[key] = (hits + 1, when)
            return (
                len(self._pending) >= self._flush_count
                or self._clock() - self._last_flush >= self._flush_seconds
            )

    def record(self, namespace: str, ids: Iterable[int]) -> None:
        """A store's ``record_hits``: count one hit for each id now, in memory; write every pending count once
        ``flush_count`` entries are pending or ``flush_seconds`` have passed (checked here, on the next call),
        never in a read-only store. The store also flushes before eviction, compaction and close."""
        if self.add(namespace, ids, time.time()) and not self._readonly:
            self.flush()

    def flush(self) -> None:
        """A store's ``flush_hits``: write every pending count now; they stay pending if the write raises."""
        with self.draining() as pending:
            self._write(pending)

    def get(self, namespace: str, entry_id: int) -> tuple[int, float]:
        """Pending ``(hits, last_hit)`` of one entry; ``(0, 0.0)`` if none."""
        with self._lock:
            return self._pending.get((namespace, entry_id), (0, 0.0))

    def drain(self) -> dict[tuple[str, int], tuple[int, float]]:
        """Take every pending count (the caller writes them) and restart the flush clock."""
        with self._lock:
            pending, self._pending = self._pending, {}
            self._last_flush = self._clock()
            return pending

    @contextmanager
    def draining(self, take: bool = True) -> Iterator[dict[tuple[str, int], tuple[int, float]]]:
        """Every pending count (none if not ``take``) for the caller to write; put back if the write fails."""
        pending = self.drain() if take else {}
        try:
            yield pending
        except BaseException:
            self.restore(pending)
            raise

    def restore(self, pending: dict[tuple[str, int], tuple[int, float]]) -> None:
        """Put back counts whose write failed, merged with any added since."""
        with self._lock:
            for key, (hits, last) in pending.items():
                now_hits, now_last = self._pending.get(key, (0, 0.0))
                self._pending[key] = (hits + now_hits, max(last, now_last))

    def drop(self, namespace: str, ids: Iterable[int]) -> None:
        """Forget pending counts of deleted entries."""
        with self._lock:
            for entry_id in ids:
                self._pending.pop((namespace, int(entry_id)), None)

    def drop_namespace(self, namespace: str) -> None:
        """Forget pending counts of a dropped namespace."""
        with self._lock:
            for key in [key for key in self._pending if key[0] == namespace]:
                del self._pending[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)
