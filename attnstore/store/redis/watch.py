"""What can change under a running daemon on a Redis store: the store's identity and Redis's eviction policy.

**Identity.** The store marker (``{P}:store``) carries a random id written when
the store is created. Redis may lose every key (restarted without persistence,
FLUSHALL, a failover to an empty replica): the namespaces may then be made again
and filled with other entries under the same ids, since the id counters went too.
A daemon that kept its DRAM cache, buffered hits and indexes would serve the old
store's maps for the new store's ids. So the marker is read again at every step
of the index follower and before every write; when it is gone or holds another
id, everything cached from the old store is dropped (``RedisMapStore``) and the
indexes are rebuilt (``NamespaceIndexes``). A daemon started with ``--create``
writes a new marker (a new identity) and serves the new store; one without
refuses writes and reports the store lost (health NOT_SERVING) until a marker
is back.

**Eviction policy.** Only entries carry a TTL, so ``volatile-*`` policies evict
entries alone; an ``allkeys-*`` policy evicts namespace records, indexes and id
counters too, and ids are then reused. The policy of every primary is read
every ``POLICY_SECONDS``: under an unsafe one writes are refused and health says
NOT_SERVING until it is changed back.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any

from redis.exceptions import RedisError

from attnstore.protocol.records import FORMAT_VERSION
from attnstore.store.redis.connection import RedisConnection, translated
from attnstore.store.redis.keys import StoreKeys

log = logging.getLogger(__name__)

POLICY_SECONDS = 1.0  # how often the eviction policy is read (one CONFIG GET per primary)


def new_marker() -> str:
    """The store marker of a new store: its format version, when it was made, and a random identity."""
    return json.dumps({"format_version": FORMAT_VERSION, "created": time.time(), "id": uuid.uuid4().hex})


def marker_identity(raw: bytes | str) -> str:
    """The identity a store marker holds (a marker written before identities: its creation time)."""
    data = json.loads(raw)
    return str(data.get("id") or f"created={data['created']!r}")


class StoreWatch:
    """Reads a Redis store's identity and eviction policy again; thread-safe.

    Args:
        connection: the store's client.
        keys: the store's key names.
        identity: the identity of the marker the store was opened with.
        create: write a new marker when it is gone (the daemon runs with ``--create``).
    """

    def __init__(self, connection: RedisConnection, keys: StoreKeys, identity: str, *, create: bool) -> None:
        self._redis = connection
        self._keys = keys
        self._create = create
        self._lock = threading.Lock()
        self._identity: str | None = identity
        self._lost: str | None = None  # why the store cannot be trusted (its marker is gone)
        self._unsafe: str | None = None  # an allkeys-* policy, described
        self._policy_read = 0.0  # monotonic time of the last read of the policy
        self._resets = 0

    @property
    def identity(self) -> str | None:
        """The identity of the store as last read; None while its marker is gone."""
        with self._lock:
            return self._identity

    @property
    def resets(self) -> int:
        """How often the identity changed under this process."""
        with self._lock:
            return self._resets

    def problem(self) -> str | None:
        """Why the store must not take writes now (marker gone, unsafe policy), or None."""
        with self._lock:
            return self._lost or self._unsafe

    def check_identity(self) -> bool:
        """Read the marker again (writing a new one where it is gone and ``create``); True when the identity
        changed since the last read (everything cached from the store must go).

        Raises:
            UnavailableError: Redis cannot be reached.
        """
        with translated("reading the store marker"):
            raw = self._redis.client.get(self._keys.store)
            if raw is None and self._create:
                self._redis.client.set(self._keys.store, new_marker(), nx=True)
                raw = self._redis.client.get(self._keys.store)
        identity = None if raw is None else marker_identity(bytes(raw))
        with self._lock:
            changed, before = identity != self._identity, self._identity
            self._identity = identity
            self._lost = None if identity is not None else (
                "the store's marker is gone from Redis (it lost its data: restarted without persistence, flushed,"
                " or failed over to an empty replica): writes are refused; restore the store, or restart a daemon"
                " with --create to start an empty one"
            )
            self._resets += changed
        if changed:
            log.error("event=store_reset identity_before=%s identity=%s detail='the Redis store is not the one this"
                      " daemon cached: its DRAM cache, hit counts and indexes are dropped and rebuilt'",
                      before, identity)
        return changed

    def check_policy(self, *, force: bool = False) -> None:
        """Read every primary's maxmemory-policy again, at most every ``POLICY_SECONDS`` unless ``force``."""
        now = time.monotonic()
        with self._lock:
            if not force and now - self._policy_read < POLICY_SECONDS:
                return
            self._policy_read = now
        policies = _policies(self._redis)
        if policies is None:
            return  # CONFIG refused (a managed Redis): the policy cannot be watched
        bad = sorted({p for p in policies if p.startswith("allkeys")})
        unsafe = None if not bad else (
            f"Redis evicts any key under maxmemory-policy {','.join(bad)}: namespace records, indexes and id counters"
            " may go and ids be reused, so writes are refused; set volatile-lru (only entries carry a TTL) or"
            " noeviction"
        )
        with self._lock:
            before, self._unsafe = self._unsafe, unsafe
        if unsafe != before:
            if unsafe:
                log.error("event=redis_policy_unsafe policy=%s health=NOT_SERVING detail='writes are refused'",
                          ",".join(bad))
            else:
                log.warning("event=redis_policy_safe detail='writes are taken again'")


def _policies(connection: RedisConnection) -> list[str] | None:
    """The maxmemory-policy of every primary; None when CONFIG is refused."""
    found = []
    for server in connection.primaries():
        try:
            reply: Any = server.config_get("maxmemory-policy")
        except RedisError as exc:
            log.debug("CONFIG GET maxmemory-policy failed: %r", exc)
            return None
        found.append(str(reply.get("maxmemory-policy", "")))
    return found
