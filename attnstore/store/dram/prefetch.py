"""Prefetch: a background thread that loads listed entries into the DRAM cache."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable

from attnstore.errors import AttnStoreError

logger = logging.getLogger(__name__)


class Prefetcher:
    """Runs ``load(namespace, entry_id)`` for queued entries on one worker thread.

    The worker opens its own LMDB read transactions (inside ``load``), since LMDB
    transactions stay on the thread that opened them. Errors are logged and
    counted, never raised: a failed prefetch only means a later read goes to LMDB.

    Args:
        load: loads one entry into the DRAM cache; may raise AttnStoreError.
        max_queue: entries waiting at most; further submissions are dropped.
    """

    def __init__(self, load: Callable[[str, int], None], *, max_queue: int = 4096) -> None:
        self._load = load
        self._max_queue = max_queue
        self._queue: deque[tuple[str, int]] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.loaded = 0
        self.failed = 0  # loads that raised, expected or not
        self.unexpected = 0  # of those, the ones that were not AttnStoreError (bugs: logged with a traceback)
        self.dropped = 0

    def submit(self, namespace: str, ids: Iterable[int]) -> int:
        """Queue entries for loading; returns how many were queued (the rest dropped)."""
        queued = 0
        with self._cond:
            if self._closed:
                return 0
            for entry_id in ids:
                if len(self._queue) >= self._max_queue:
                    self.dropped += 1
                    continue
                self._queue.append((namespace, int(entry_id)))
                queued += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="attnstore-prefetch", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return queued

    @property
    def alive(self) -> bool:
        """False when the worker was started and has died (closing is not dying)."""
        with self._cond:
            return self._closed or self._thread is None or self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the queue is empty and the worker idle; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout=timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker, dropping what is still queued."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                namespace, entry_id = self._queue.popleft()
                self._busy = True
            try:
                self._load(namespace, entry_id)
                self.loaded += 1
            except AttnStoreError as exc:
                self.failed += 1
                logger.warning("prefetch of entry %s in namespace %r failed: %s", entry_id, namespace, exc)
            except Exception:
                # The worker must survive anything: an unexpected error is a bug to log, not a reason to stop.
                self.failed += 1
                self.unexpected += 1
                logger.exception("prefetch of entry %s in namespace %r failed unexpectedly", entry_id, namespace)
