"""What the daemon watches of its service: storage faults, background threads, the follower, Redis.

The service's ``monitoring`` part (over its store and index follower): the
daemon's watchdog turns health NOT_SERVING on a fault or a dead thread, and the
metrics read the rest at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from attnstore.service.follower import THREAD_NAME as FOLLOWER_THREAD
from attnstore.service.follower import FollowerStatus, IndexFollower
from attnstore.store import MapStoreBase

if TYPE_CHECKING:
    from attnstore.store.redis.connection import RedisStats


class ServiceMonitoring:
    """What the daemon watches of ``AttnStoreService``: its store's faults and threads, its follower, Redis."""

    def __init__(
        self,
        store: MapStoreBase,
        follower: IndexFollower | None,
        redis_stats: Callable[[], RedisStats] | None = None,
    ) -> None:
        """
        Args:
            store: the service's map store.
            follower: the service's index follower of a shared store's log; None for a store no one else writes.
            redis_stats: the Redis client's figures, for a store opened from a ``redis://`` URL.
        """
        self._store = store
        self._follower = follower
        self._redis_stats = redis_stats

    def serving_problem(self) -> str | None:
        """Why the store takes no writes now, while it lasts (see ``MapStoreBase.serving_problem``), or None."""
        return self._store.serving_problem()

    def storage_fault(self) -> str | None:
        """Why the store's storage can no longer be trusted, or None (see ``MapStoreBase.storage_fault``)."""
        return self._store.storage_fault()

    def dead_threads(self) -> list[str]:
        """Names of the store's and the index follower's background threads that have died."""
        dead = self._store.dead_threads()
        if self._follower is not None and not self._follower.alive:
            dead.append(FOLLOWER_THREAD)
        return dead

    def background_errors(self) -> dict[str, int]:
        """Unexpected errors the store's and the index follower's background threads caught and survived."""
        errors = self._store.background_errors()
        if self._follower is not None:
            errors[FOLLOWER_THREAD] = self._follower.status().errors
        return errors

    def follower_status(self) -> FollowerStatus | None:
        """How current the indexes are with a shared store's log; None for a store no one else writes."""
        return None if self._follower is None else self._follower.status()

    def redis_stats(self) -> RedisStats | None:
        """The Redis client's figures (failures waited out, each primary's memory) of a store the service opened
        from a ``redis://`` URL; None otherwise (see ``RedisMapStore.redis_stats``)."""
        return None if self._redis_stats is None else self._redis_stats()
