"""Opening a store by its location: an LMDB folder, a ``redis://`` URL or ``memory://``, the one place that tells
them apart.

The backend gets a DRAM cache in front (``DramCache``) when ``dram_bytes`` asks for one (the default does).

What a backend needs beyond the ``MapStoreBase`` interface comes with the store in an
``OpenedStore``: the Redis client's figures (for the daemon's metrics) and what to do once
the caller has read the store through (a read-only LMDB store drops the pages it mapped in).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from attnstore.errors import ConfigError
from attnstore.protocol.mapped_pages import drop_mapped_pages
from attnstore.store.base import MapStoreBase
from attnstore.store.dram.cache import DramCache
from attnstore.store.dram.settings import DEFAULT_DRAM_BYTES
from attnstore.store.lmdb.mapstore import open_lmdb_store
from attnstore.store.memory.mapstore import MemoryMapStore
from attnstore.store.redis.urls import is_redis_url

if TYPE_CHECKING:
    from attnstore.store.redis.connection import RedisStats


MEMORY_LOCATION = "memory://"  # a new, empty in-memory store (tests, evaluations); gone when closed


@dataclass(frozen=True, slots=True)
class OpenedStore:
    """An open store and what its backend adds to the interface."""

    store: MapStoreBase
    redis_stats: Callable[[], RedisStats] | None  # the Redis client's figures; None for a store not on Redis
    # Drops the store's pages this process's reads mapped (a read-only LMDB store's, see
    # ``protocol.mapped_pages``; nothing for the other backends): after the indexes' build, and as reads go on.
    drop_mapped: Callable[[], None]


def open_store(
    location: str | Path,
    *,
    create: bool = False,
    dram_bytes: int | None = None,
    max_bytes: int | None = None,
    map_size: int | None = None,
    readonly: bool = False,
) -> OpenedStore:
    """Open the store at ``location``: an LMDB folder, a ``redis://`` URL (one Redis server, or a Redis
    Cluster with ``?cluster=1``; see ``attnstore.store.redis``), or :data:`MEMORY_LOCATION` (a new in-memory
    store, which needs no DRAM cache). None sizes take their defaults; ``dram_bytes``
    above 0 (1 GiB by default) puts a DRAM cache of that size in front of the store (``DramCache``).

    Raises:
        StoreNotFoundError: no store there and ``create`` is False.
        FormatVersionError: the store was written in an unknown format version.
        ConfigError: a malformed Redis URL, or ``map_size`` with one.
        UnavailableError: Redis cannot be reached.
    """
    dram_bytes = DEFAULT_DRAM_BYTES if dram_bytes is None else dram_bytes
    if dram_bytes < 0:
        raise ConfigError(f"open_store(): dram_bytes must be >= 0 (0: no DRAM cache), got {dram_bytes}")
    if str(location) == MEMORY_LOCATION:
        return OpenedStore(MemoryMapStore(max_bytes=max_bytes), None, lambda: None)
    if is_redis_url(location):
        # Imported here: redis-py loads only with a Redis store.
        from attnstore.store.redis.mapstore import open_redis_store

        redis = open_redis_store(str(location), create=create, max_bytes=max_bytes, map_size=map_size,
                                 readonly=readonly)
        return OpenedStore(_cached(redis, dram_bytes), redis.redis_stats, lambda: None)
    folder = Path(location)
    store = _cached(open_lmdb_store(folder, create=create, max_bytes=max_bytes, map_size=map_size,
                                    readonly=readonly), dram_bytes)

    def drop_mapped() -> None:
        if readonly:
            drop_mapped_pages(folder)  # what the reads mapped in, unasked (see ``protocol.mapped_pages``)

    return OpenedStore(store, None, drop_mapped)


def _cached(store: MapStoreBase, dram_bytes: int) -> MapStoreBase:
    """``store`` behind a DRAM cache of ``dram_bytes``, or as it is for 0."""
    return DramCache(store, dram_bytes=dram_bytes) if dram_bytes else store
