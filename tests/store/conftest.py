"""Fixtures of the store suites: one factory of every map store backend, so each suite runs on all of them."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from attnstore.store import MapStore, MapStoreBase, MemoryMapStore

StoreFactory = Callable[..., MapStoreBase]


@pytest.fixture(params=["lmdb", "memory", "redis", "redis-cluster"])
def make_store(request, tmp_path) -> StoreFactory:
    opened: list[MapStoreBase] = []

    def factory(max_bytes: int | None = None) -> MapStoreBase:
        if request.param == "lmdb":
            path = tmp_path / f"store{len(opened)}"
            store = MapStore.open(path, create=True, dram_bytes=1 << 20, max_bytes=max_bytes)
        elif request.param.startswith("redis"):
            from attnstore.store.redis.mapstore import RedisMapStore
            from attnstore.store.redis.settings import RedisSettings

            servers = request.getfixturevalue("redis_cluster" if request.param == "redis-cluster" else "redis_server")
            settings = RedisSettings(dram_bytes=1 << 20, max_bytes=max_bytes)
            store = RedisMapStore.open(servers.url(), create=True, settings=settings)
        else:
            store = MemoryMapStore(max_bytes=max_bytes)
        opened.append(store)
        return store

    yield factory
    for store in opened:
        store.close()
