"""Calls to Redis that outlast a failover: each command (or pipeline) is sent again until it succeeds or
``FAILOVER_SECONDS`` pass.

A Redis Cluster replica takes over a dead master about ``cluster-node-timeout``
after it died (plus an election); redis-py retries a few times at once and
then gives up, so without this a failover would surface as errors. A pipeline
is recorded and replayed whole on a fresh pipeline, since redis-py drops the
queued commands of one that failed.

Every command our code sends may run twice when a connection breaks after
Redis ran it: each is idempotent, or harmless twice (an id counter skips ids;
a hit count is a statistic), or checked by its caller (see ``ingest``).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.exceptions import ClusterDownError, ClusterError, ReadOnlyError, TryAgainError

log = logging.getLogger(__name__)

FAILOVER_SECONDS = 20.0  # a failover with cluster-node-timeout up to about 15 s costs latency, not errors
_FIRST_PAUSE = 0.05
_MAX_PAUSE = 1.0

# Failures worth waiting out: the server is unreachable, loading, or its slots are moving to a replica.
RETRIED: tuple[type[BaseException], ...] = (
    redis.ConnectionError, redis.TimeoutError, ClusterDownError, ClusterError, TryAgainError, ReadOnlyError,
)
T = TypeVar("T")


def retried(call: Callable[[], T], seconds: float) -> T:
    """``call()``, sent again after a transient failure until ``seconds`` have passed (then its error)."""
    deadline = time.monotonic() + seconds
    pause = _FIRST_PAUSE
    while True:
        try:
            return call()
        except RETRIED as exc:
            if time.monotonic() + pause > deadline:
                raise
            log.debug("redis call failed (%r); again in %.2fs", exc, pause)
            time.sleep(pause * (0.5 + random.random() / 2))
            pause = min(pause * 2, _MAX_PAUSE)


class RetryingPipeline:
    """A recorded pipeline: commands are queued here and replayed on a new redis-py pipeline per attempt."""

    def __init__(self, client: Any, seconds: float, options: dict[str, Any]) -> None:
        self._client = client
        self._seconds = seconds
        self._options = options
        self._queued: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Callable[..., RetryingPipeline]:
        def queue(*args: Any, **kwargs: Any) -> RetryingPipeline:
            self._queued.append((name, args, kwargs))
            return self

        return queue

    def execute(self) -> list[Any]:
        """Send every queued command; their replies in order."""
        queued, self._queued = self._queued, []

        def attempt() -> list[Any]:
            pipe = self._client.pipeline(**self._options)
            for name, args, kwargs in queued:
                getattr(pipe, name)(*args, **kwargs)
            return list(pipe.execute())

        return retried(attempt, self._seconds)


class RetryingClient:
    """A redis-py client whose commands are retried through failovers (see the module docstring)."""

    def __init__(self, client: Any, seconds: float = FAILOVER_SECONDS) -> None:
        self.raw = client
        self._seconds = seconds

    def pipeline(self, **options: Any) -> RetryingPipeline:
        """A recorded pipeline (``transaction=True`` is one MULTI/EXEC, on one slot in a cluster)."""
        return RetryingPipeline(self.raw, self._seconds, options)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.raw, name)
        if not callable(attribute) or name in ("close", "scan_iter", "get_node_from_key", "get_primaries"):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            return retried(lambda: getattr(self.raw, name)(*args, **kwargs), self._seconds)

        return call
