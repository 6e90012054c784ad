"""The thread that keeps a service's indexes current with a store that other daemons write to.

It calls ``NamespaceIndexes.follow`` every ``FOLLOW_SECONDS``: an entry ingested
through another daemon is searchable here at most about that long (plus one
read of the log) after its ingest returned. That is the staleness bound of a
stateless daemon; exact hits need no index and are current at once.
"""

from __future__ import annotations

import logging
import threading
import time

from attnstore.errors import AttnStoreError
from attnstore.service.indexes import NamespaceIndexes

log = logging.getLogger(__name__)

FOLLOW_SECONDS = 0.25  # how often the log is read: the staleness bound of the map tier across daemons
THREAD_NAME = "attnstore-index-follower"
_ERROR_LOG_SECONDS = 30.0  # a store that stays unreachable is reported this often, not on every poll


class IndexFollower:
    """Follows a store's change feed into ``indexes`` on a background thread until :meth:`stop`.

    Args:
        indexes: the service's indexes (their store has a change feed).
        interval: seconds between reads of the log.
    """

    def __init__(self, indexes: NamespaceIndexes, *, interval: float = FOLLOW_SECONDS) -> None:
        self._indexes = indexes
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """False once the thread has died (it never should: errors are logged and retried)."""
        return self._thread.is_alive() or self._stop.is_set()

    def _run(self) -> None:
        last_error = 0.0
        while not self._stop.wait(self._interval):
            try:
                self._indexes.follow()
            except AttnStoreError as exc:  # Redis unreachable or failing over: catch up on a later poll
                if time.monotonic() - last_error >= _ERROR_LOG_SECONDS:
                    last_error = time.monotonic()
                    log.warning("event=index_follow_failed error=%r detail='retrying every %.2fs'", exc,
                                self._interval)

    def stop(self) -> None:
        """Stop following and wait for the thread. Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
