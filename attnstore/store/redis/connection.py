"""The one client every call to a Redis store goes through, with failovers waited out and errors translated.

Where the store lives (its URL, ``RedisLocation``) is ``urls``'.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.retry import Retry

from attnstore.errors import StorageError, StoreFullError, UnavailableError
from attnstore.store.redis.urls import RedisLocation

log = logging.getLogger(__name__)


# redis-py's own retries of a command are few and quick (a dropped connection); waiting out a failover
# is ``RetryingClient``'s, above them.
_RETRIES = 2
_BACKOFF = ExponentialWithJitterBackoff(base=0.02, cap=0.1)
_CLIENT_DEFAULTS: dict[str, Any] = {"socket_timeout": 10.0, "socket_connect_timeout": 2.0}

# Failures that pass: the server is unreachable, loading, or failing over.
_TRANSIENT: tuple[type[BaseException], ...] = (
    redis.ConnectionError, redis.TimeoutError, ClusterError, TryAgainError, ReadOnlyError, RedisClusterException,
)


@dataclass(frozen=True, slots=True)
class RetryTotals:
    """What waiting out failures has cost since the store was opened (the daemon's Redis metrics)."""

    retries: int  # commands (or pipelines) sent again after a transient failure
    waited_out: int  # calls that failed transiently, then succeeded
    gave_up: int  # calls still failing after the failover wait: they raised (the RPC answered UNAVAILABLE)


@dataclass(frozen=True, slots=True)
class NodeMemory:
    """One Redis primary's memory, from ``INFO memory``."""

    node: str  # HOST:PORT
    used_bytes: int  # used_memory
    max_bytes: int  # maxmemory; 0: none set


@dataclass(frozen=True, slots=True)
class RedisStats:
    """A Redis-backed store's client figures: failures waited out, and each primary's memory."""

    retries: RetryTotals
    nodes: tuple[NodeMemory, ...]  # the primaries that answered INFO
    resets: int = 0  # times the store was found replaced under this process (its identity changed)
    unsafe: bool = False  # writes are refused now: the store's marker is gone, or an allkeys-* policy runs


# ---- waiting out failovers ----------------------------------------------------------------------
#
# A Redis Cluster replica takes over a dead master about cluster-node-timeout after it died (plus an
# election); redis-py retries a few times at once and then gives up, so without this a failover would
# surface as errors. A pipeline is recorded and replayed whole on a fresh pipeline, since redis-py drops
# the queued commands of one that failed. Every command our code sends may then run twice when a
# connection breaks after Redis ran it: each is idempotent, or harmless twice (an id counter skips ids;
# a hit count is a statistic), or checked by its caller (see ``ingest``).

FAILOVER_SECONDS = 20.0  # a failover with cluster-node-timeout up to about 15 s costs latency, not errors
# One server has no replica to take over: only a blip or a quick restart is worth waiting for.
SERVER_FAILOVER_SECONDS = 2.0
_FIRST_PAUSE = 0.05
_MAX_PAUSE = 1.0

# Failures worth waiting out: the server is unreachable, loading, or its slots are moving to a replica.
RETRIED: tuple[type[BaseException], ...] = (
    redis.ConnectionError, redis.TimeoutError, ClusterDownError, ClusterError, TryAgainError, ReadOnlyError,
)
T = TypeVar("T")


_RACES = (AttributeError, ValueError, RuntimeError)
_RETRIED_OR_RACE: tuple[type[BaseException], ...] = (*RETRIED, *_RACES)


def _dropped_under_us(exc: AttributeError | ValueError | RuntimeError) -> bool:
    """Whether ``exc`` is redis-py's race, not a bug of ours: at a failover one thread's cluster client
    resets the connection pools and disconnects connections another thread is reading from, whose
    parser then finds its buffer gone ("'NoneType' object has no attribute 'readline'") or its socket
    file closed ("I/O operation on closed file"); or it reloads the slot map, iterating the node table
    while another thread's MOVED reply adds to it ("dictionary changed size during iteration", redis-py
    5.3's ``NodesManager.initialize``)."""
    message = str(exc)
    if isinstance(exc, AttributeError):
        return "'NoneType' object has no attribute" in message
    if isinstance(exc, RuntimeError):
        return "dictionary changed size during iteration" in message
    return "I/O operation on closed file" in message


class RetryCounts:
    """Thread-safe counters behind :class:`RetryTotals`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._retries = self._waited_out = self._gave_up = 0

    def note(self, *, retries: int = 0, waited_out: int = 0, gave_up: int = 0) -> None:
        """Add to the counts."""
        with self._lock:
            self._retries += retries
            self._waited_out += waited_out
            self._gave_up += gave_up

    def totals(self) -> RetryTotals:
        """The counts now."""
        with self._lock:
            return RetryTotals(self._retries, self._waited_out, self._gave_up)


class Outage:
    """Whether Redis is known to be down: a call waited the whole failover time in vain and none succeeded since.

    While it is, calls are not waited out: each makes one attempt, so every RPC answers UNAVAILABLE at
    once and clients compute their rows instead of each waiting out a failover that did not come. The
    first call that succeeds (the index follower tries every 0.25 s) ends it. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._down = False

    def budget(self, seconds: float) -> float:
        """How long a call starting now may wait out failures: ``seconds``, or none while Redis is known down."""
        with self._lock:
            return 0.0 if self._down else seconds

    def note(self, *, succeeded: bool) -> None:
        """A call succeeded, or gave up after its whole budget."""
        with self._lock:
            was, self._down = self._down, not succeeded
        if was != self._down:
            if self._down:
                log.warning("event=redis_down detail='calls fail at once (UNAVAILABLE) until Redis answers again'")
            else:
                log.warning("event=redis_back detail='calls wait out failovers again'")


def retried(
    call: Callable[[], T], seconds: float, counts: RetryCounts | None = None, outage: Outage | None = None
) -> T:
    """``call()``, sent again after a transient failure until ``seconds`` have passed (then its error).

    ``counts`` (if given) notes each resend, and whether the call then succeeded or gave up; ``outage``
    (if given) cuts the wait to one attempt while Redis is known down, and learns of each outcome.
    """
    budget = seconds if outage is None else outage.budget(seconds)
    deadline = time.monotonic() + budget
    pause = _FIRST_PAUSE
    attempts = 0
    while True:
        try:
            result = call()
        except _RETRIED_OR_RACE as exc:
            if isinstance(exc, _RACES) and not _dropped_under_us(exc):
                raise
            if time.monotonic() + pause > deadline:
                if counts is not None:
                    counts.note(gave_up=1)
                if outage is not None and budget:  # waited the whole failover time: Redis is down
                    outage.note(succeeded=False)
                raise
            log.debug("redis call failed (%r); again in %.2fs", exc, pause)
            time.sleep(pause * (0.5 + random.random() / 2))
            pause = min(pause * 2, _MAX_PAUSE)
            attempts += 1
            if counts is not None:
                counts.note(retries=1)
            continue
        if attempts and counts is not None:
            counts.note(waited_out=1)
        if outage is not None:
            outage.note(succeeded=True)
        return result


class RetryingPipeline:
    """A recorded pipeline: commands are queued here and replayed on a new redis-py pipeline per attempt."""

    def __init__(
        self, client: Any, seconds: float, options: dict[str, Any], counts: RetryCounts, outage: Outage
    ) -> None:
        self._client = client
        self._seconds = seconds
        self._options = options
        self._counts = counts
        self._outage = outage
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

        return retried(attempt, self._seconds, self._counts, self._outage)


class RetryingClient:
    """A redis-py client whose commands are retried through failovers, and fail at once while Redis is known
    down (see the module docstring and :class:`Outage`)."""

    def __init__(self, client: Any, seconds: float = FAILOVER_SECONDS) -> None:
        self.raw = client
        self._seconds = seconds
        self.counts = RetryCounts()
        self.outage = Outage()

    def pipeline(self, **options: Any) -> RetryingPipeline:
        """A recorded pipeline (``transaction=True`` is one MULTI/EXEC, on one slot in a cluster)."""
        return RetryingPipeline(self.raw, self._seconds, options, self.counts, self.outage)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.raw, name)
        if not callable(attribute) or name in ("close", "scan_iter", "get_node_from_key", "get_primaries"):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            return retried(lambda: getattr(self.raw, name)(*args, **kwargs), self._seconds, self.counts,
                           self.outage)

        return call


# redis-py names the command of a failed pipeline with all its arguments: for an entry's HSET, kilobytes of
# binary fp16 maps, which would reach clients and split log lines.
_PIPELINE_COMMAND = re.compile(r"^Command # (\d+) \((\S*).*\) of pipeline caused error: ", re.DOTALL)
_MESSAGE_CHARS = 200


def redis_message(exc: BaseException) -> str:
    """A Redis error's message fit for clients and logs: a pipeline's failed command by name only (never its
    arguments), printable characters only, at most ``_MESSAGE_CHARS`` long."""
    text = str(exc)
    found = _PIPELINE_COMMAND.match(text)
    if found is not None:
        text = f"{found.group(2) or 'a command'} (command {found.group(1)} of a pipeline): {text[found.end():]}"
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS] + "..."


@contextmanager
def translated(what: str) -> Iterator[None]:
    """Turn redis-py's errors into AttnStore's where they enter our code, with messages cleaned
    (``redis_message``).

    Raises:
        UnavailableError: Redis is unreachable, loading or failing over (retry later).
        StoreFullError: Redis is at its maxmemory and evicts nothing more.
        StorageError: any other Redis error.
    """
    try:
        yield
    except OutOfMemoryError as exc:
        raise StoreFullError(
            f"Redis is full while {what} ({redis_message(exc)}); nothing of the failed write is visible:"
            " raise maxmemory, or set maxmemory-policy volatile-lru so Redis evicts entries"
        ) from None
    except _TRANSIENT as exc:
        raise UnavailableError(f"Redis is unavailable while {what}: {redis_message(exc)}") from exc
    except RedisError as exc:
        # Not chained: the daemon logs a StorageError with its traceback, and the cause's text is redis-py's raw one.
        raise StorageError(f"Redis failed while {what}: {type(exc).__name__}: {redis_message(exc)}") from None


class RedisConnection:
    """One client (a server's or a cluster's) and the few calls that differ between the two.

    Thread-safe: redis-py clients keep a connection pool per server.
    """

    def __init__(self, location: RedisLocation, *, failover_seconds: float | None = None) -> None:
        self.location = location
        retry = Retry(_BACKOFF, _RETRIES)
        options = {key: value for key, value in _CLIENT_DEFAULTS.items() if key not in location.options}
        # Typed Any on purpose: redis-py types its commands for its sync and asyncio clients at once
        # (``Awaitable[T] | T``), which would need a cast at every call; ours is always the sync client.
        raw: Any
        with translated(f"connecting to {location.display}"):
            if location.cluster:
                raw = RedisCluster.from_url(location.client_url, retry=retry, **options)
            else:
                raw = redis.Redis.from_url(
                    location.client_url, retry=retry, retry_on_error=[redis.ConnectionError, redis.TimeoutError],
                    **options,
                )
            raw.ping()  # once, not retried: a Redis that is not there at start is a configuration problem
        if failover_seconds is None:
            failover_seconds = FAILOVER_SECONDS if location.cluster else SERVER_FAILOVER_SECONDS
        self._retrying = RetryingClient(raw, failover_seconds)
        self.client: Any = self._retrying

    def retry_totals(self) -> RetryTotals:
        """What waiting out failures has cost so far."""
        return self._retrying.counts.totals()

    def eval(self, script: str, keys: Sequence[str], args: Sequence[bytes | str | int | float]) -> Any:
        """Run a Lua script on the shard of ``keys`` (all in one hash slot)."""
        return self.client.eval(script, len(keys), *keys, *args)

    def primaries(self) -> list[Any]:
        """A client of each primary (the server itself when not a cluster), for per-server admin calls."""
        raw = self.client.raw
        if isinstance(raw, RedisCluster):
            return [node.redis_connection for node in raw.get_primaries() if node.redis_connection]
        return [raw]

    def node_memory(self) -> list[NodeMemory]:
        """``INFO memory`` of every primary that answers (one that does not is left out: not retried)."""
        found = []
        for server in self.primaries():
            kwargs = server.connection_pool.connection_kwargs
            try:
                info = server.info("memory")
            except RedisError as exc:
                log.debug("INFO memory of %s:%s failed: %r", kwargs.get("host"), kwargs.get("port"), exc)
                continue
            found.append(NodeMemory(f"{kwargs.get('host')}:{kwargs.get('port')}", int(info["used_memory"]),
                                    int(info.get("maxmemory", 0))))
        return found

    def scan(self, match: str, count: int = 1000) -> Iterator[bytes]:
        """Every key matching ``match`` on every primary (SCAN: no server blocks)."""
        for server in self.primaries():
            yield from server.scan_iter(match=match, count=count)

    def close(self) -> None:
        """Close every connection."""
        self.client.raw.close()
