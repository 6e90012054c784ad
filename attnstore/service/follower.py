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
from dataclasses import dataclass

from attnstore.errors import AttnStoreError
from attnstore.service.indexes import NamespaceIndexes

log = logging.getLogger(__name__)

FOLLOW_SECONDS = 0.25  # how often the log is read: the staleness bound of the map tier across daemons
THREAD_NAME = "attnstore-index-follower"
_ERROR_LOG_SECONDS = 30.0  # a store that stays unreachable is reported this often, not on every poll


@dataclass(frozen=True, slots=True)
class FollowerStatus:
    """How current the follower is (the daemon's Redis metrics)."""

    seconds_since_read: float  # since the last read of the log that succeeded (or the indexes' build)
    changes_applied: int  # log records (one per ingest or delete call, any daemon's) applied since start
    failed_reads: int  # reads of the log that failed (Redis unreachable or failing over)
    skipped_records: int = 0  # log records that did not decode: skipped, their namespace's index rebuilt
    errors: int = 0  # steps that failed unexpectedly (a bug: logged with its traceback; the next step runs)
    resets: int = 0  # times the store was found replaced (its data lost and made anew): every index rebuilt


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
        self._last_read = time.monotonic()  # the indexes were just built from the store
        self._applied = 0
        self._failed = 0
        self._errors = 0
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def status(self) -> FollowerStatus:
        """How current the indexes are now."""
        return FollowerStatus(time.monotonic() - self._last_read, self._applied, self._failed,
                              self._indexes.skipped_records, self._errors, self._indexes.resets)

    @property
    def alive(self) -> bool:
        """False once the thread has died (it never should: every error is logged, counted and retried)."""
        return self._thread.is_alive() or self._stop.is_set()

    def _run(self) -> None:
        last_logged = 0.0
        while not self._stop.wait(self._interval):
            try:
                self._applied += self._indexes.follow()  # only this thread writes the counts
                self._last_read = time.monotonic()
            except AttnStoreError as exc:  # Redis unreachable or failing over: catch up on a later poll
                self._failed += 1
                if time.monotonic() - last_logged >= _ERROR_LOG_SECONDS:
                    last_logged = time.monotonic()
                    log.warning("event=index_follow_failed error=%r detail='retrying every %.2fs'", exc,
                                self._interval)
            except Exception as exc:
                # A bug, not an outage: dying would freeze every index of this daemon for good, so it is
                # logged with its traceback (at most every 30 s), counted, and the next step runs as usual.
                self._errors += 1
                if time.monotonic() - last_logged >= _ERROR_LOG_SECONDS:
                    last_logged = time.monotonic()
                    log.error("event=index_follow_error error=%r errors=%d detail='the follower goes on'", exc,
                              self._errors, exc_info=exc)

    def stop(self) -> None:
        """Stop following and wait for the thread. Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
