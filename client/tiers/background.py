"""A bounded queue and one thread that sends what waits in batches: what write-back of rows and of chunks share.

Both fill a cache, never data, so neither may block or fail a call: ``_offer``
never waits (a full queue drops the new item, counted), the thread takes what
else waits up to one call's worth (``batch_items`` items, ``batch_bytes`` bytes;
a bigger item goes alone) without waiting for more, and ``flush`` returns once
every queued item was sent or dropped. A subclass says what an item weighs
(``_size``) and sends a batch (``_send``), which must not raise and settles the
batch's ``pending`` count with its own.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")

# Counts every sender keeps; a subclass adds its own.
_COUNTS = ("queued", "dropped_full", "dropped_failed", "pending")


class BackgroundSender(ABC, Generic[T]):
    """The queue, the thread and the counts; subclasses call ``_start`` at the end of their ``__init__``.

    Args:
        name: the thread's name.
        max_queued: items waiting at most.
        batch_items, batch_bytes: one batch's limits (``_size`` bytes).
        counts: the subclass's own counts, kept beside ``queued``, ``dropped_full``, ``dropped_failed``
            and ``pending``.
    """

    def __init__(self, *, name: str, max_queued: int, batch_items: int, batch_bytes: int,
                 counts: Iterable[str] = ()) -> None:
        self._queue: queue.Queue[T | None] = queue.Queue(maxsize=max_queued)  # None: stop
        self._batch_items, self._batch_bytes = batch_items, batch_bytes
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._counts = dict.fromkeys((*_COUNTS, *counts), 0)
        self._disabled: str | None = None  # why sending stopped for good, if it did
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _start(self) -> None:
        self._thread.start()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued item was sent (or dropped); False on timeout, or if the thread is gone."""
        with self._idle:
            done = self._idle.wait_for(lambda: self._counts["pending"] == 0 or not self._thread.is_alive(), timeout)
            return done and self._counts["pending"] == 0

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to ``timeout`` seconds), then stop the thread."""
        self.flush(timeout)
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return  # the thread is stuck in a call: it is a daemon thread, and dies with the process
        self._thread.join(timeout)

    # ---- for subclasses -----------------------------------------------------------

    def _offer(self, item: T, **counts: int) -> bool:
        """Queue ``item`` and add ``counts``; False, counted, when sending is off or the queue is full."""
        if self._disabled is not None:
            self._add(dropped_failed=1)
            return False
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._add(dropped_full=1)
            return False
        self._add(queued=1, pending=1, **counts)
        return True

    def _add(self, **deltas: int) -> None:
        with self._idle:
            for key, n in deltas.items():
                self._counts[key] += n
            if self._counts["pending"] == 0:
                self._idle.notify_all()

    def _snapshot(self) -> dict[str, int]:
        """The counts now."""
        with self._lock:
            return dict(self._counts)

    @abstractmethod
    def _size(self, item: T) -> int:
        """Bytes ``item`` adds to a batch."""

    @abstractmethod
    def _send(self, batch: list[T]) -> None:
        """Send ``batch``; never raises, and adds ``pending=-len(batch)`` with its outcome's counts."""

    # ---- the thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch, nbytes = [item], self._size(item)
            while len(batch) < self._batch_items and nbytes < self._batch_bytes:  # what else waits, no waiting
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._send(batch)
                    return
                size = self._size(more)
                if nbytes + size > self._batch_bytes:
                    self._send(batch)
                    batch, nbytes = [], 0
                batch.append(more)
                nbytes += size
            self._send(batch)
