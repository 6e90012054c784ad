"""Fixtures of the store suites: one factory of every map store backend, so each suite runs on all of them.

The suites consult a store's capabilities (``supports_*``) and parts (``prefixes``, ``chunks``), never its
backend. Where a test must damage
stored bytes behind a store's back, the factory's ``corrupt_prefix_part`` and ``corrupt_chunk_layer`` do it
the backend's way: this file is the one place that knows which backend it made.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from attnstore.store import LmdbMapStore, MapStoreBase, MemoryMapStore
from attnstore.store.dram.cache import DramCache
from attnstore.store.eviction import DEFAULT_LOW_WATER

StoreFactory = Callable[..., MapStoreBase]


@pytest.fixture(params=["lmdb", "memory", "redis", "redis-cluster"])
def make_store(request, tmp_path) -> StoreFactory:
    opened: list[MapStoreBase] = []

    def factory(max_bytes: int | None = None, evict_low_water: float = DEFAULT_LOW_WATER) -> MapStoreBase:
        if request.param == "lmdb":
            path = tmp_path / f"store{len(opened)}"
            lmdb_store = LmdbMapStore.open(path, create=True, max_bytes=max_bytes, evict_low_water=evict_low_water)
            store = DramCache(lmdb_store, dram_bytes=1 << 20)
        elif request.param.startswith("redis"):
            from attnstore.store.redis.mapstore import RedisMapStore
            from attnstore.store.redis.urls import RedisSettings

            servers = request.getfixturevalue("redis_cluster" if request.param == "redis-cluster" else "redis_server")
            settings = RedisSettings(max_bytes=max_bytes, evict_low_water=evict_low_water)
            store = DramCache(RedisMapStore.open(servers.url(), create=True, settings=settings), dram_bytes=1 << 20)
        else:
            store = MemoryMapStore(max_bytes=max_bytes, evict_low_water=evict_low_water)
        opened.append(store)
        return store

    factory.corrupt_prefix_part = _CORRUPTORS.get(request.param)  # type: ignore[attr-defined]
    factory.corrupt_chunk_layer = _CHUNK_CORRUPTORS.get(request.param.split("-")[0])  # type: ignore[attr-defined]
    factory.cut_chunk_record = _RECORD_CUTTERS.get(request.param.split("-")[0])  # type: ignore[attr-defined]
    yield factory
    for store in opened:
        store.close()


def _backend(store: MapStoreBase) -> MapStoreBase:
    """The backend itself, out of the DRAM cache the factory may have put in front."""
    return store.inner if isinstance(store, DramCache) else store


def _corrupt_memory_prefix_part(store: MapStoreBase, namespace: str, chain_hash: bytes, part: int) -> None:
    parts = store.prefixes._prefix[namespace].parts[chain_hash]  # type: ignore[union-attr]
    parts[part] = b"\x00" + parts[part][1:]


def _corrupt_lmdb_prefix_part(store: MapStoreBase, namespace: str, chain_hash: bytes, part: int) -> None:
    from attnstore.store.lmdb.prefix_blocks import part_key

    with _backend(store)._live.write() as (gen, txn):  # type: ignore[attr-defined]
        raw = bytearray(txn.get(part_key(namespace, chain_hash, part), db=gen.db.prefix))
        raw[0] ^= 0xFF
        txn.put(part_key(namespace, chain_hash, part), bytes(raw), db=gen.db.prefix)


# Flips the first byte of one stored part of a prefix block, per backend that stores prefix blocks.
_CORRUPTORS = {"memory": _corrupt_memory_prefix_part, "lmdb": _corrupt_lmdb_prefix_part}


def _corrupt_memory_chunk_layer(store: MapStoreBase, namespace: str, key: bytes, layer: int) -> None:
    pieces = store.chunks._chunks[namespace].pieces[key]  # type: ignore[union-attr]
    pieces[layer] = bytes([pieces[layer][0] ^ 0xFF]) + pieces[layer][1:]


def _corrupt_lmdb_chunk_layer(store: MapStoreBase, namespace: str, key: bytes, layer: int) -> None:
    """Flips a byte of the layer in the data file itself (every copy of it there: LMDB keeps freed pages)."""
    from attnstore.store.lmdb.chunks.keys import piece_key

    with _backend(store)._live.read() as (gen, txn):  # type: ignore[attr-defined]
        piece = bytes(txn.get(piece_key(namespace, key, layer), db=gen.db.chunks))
        path = gen.data_path
    data = path.read_bytes()
    offset = data.find(piece)
    assert offset >= 0, "the layer's bytes are not in the data file"
    with path.open("r+b") as file:
        while offset >= 0:
            file.seek(offset)
            file.write(bytes([piece[0] ^ 0xFF]))
            offset = data.find(piece, offset + 1)


def _corrupt_redis_chunk_layer(store: MapStoreBase, namespace: str, key: bytes, layer: int) -> None:
    """Writes the layer back with its first byte flipped, with Redis's own HSET."""
    hash_key = _backend(store)._keys.namespace(namespace).chunk(key)  # type: ignore[attr-defined]
    client = _backend(store)._redis.client  # type: ignore[attr-defined]
    piece = bytes(client.hget(hash_key, str(layer)))
    client.hset(hash_key, str(layer), bytes([piece[0] ^ 0xFF]) + piece[1:])


# Flips the first byte of one stored layer of a chunk entry, per backend, through the backend's own storage.
_CHUNK_CORRUPTORS = {"memory": _corrupt_memory_chunk_layer, "lmdb": _corrupt_lmdb_chunk_layer,
                     "redis": _corrupt_redis_chunk_layer}


def _cut_lmdb_chunk_record(store: MapStoreBase, namespace: str, key: bytes) -> None:
    from attnstore.store.lmdb.chunks.keys import record_key

    with _backend(store)._live.write() as (gen, txn):  # type: ignore[attr-defined]
        raw = bytes(txn.get(record_key(namespace, key), db=gen.db.chunks))
        txn.put(record_key(namespace, key), raw[:7], db=gen.db.chunks)


def _cut_redis_chunk_record(store: MapStoreBase, namespace: str, key: bytes) -> None:
    records = _backend(store)._keys.namespace(namespace).chunks  # type: ignore[attr-defined]
    client = _backend(store)._redis.client  # type: ignore[attr-defined]
    client.hset(records, key, bytes(client.hget(records, key))[:7])


# Cuts a chunk's stored record short, per backend that keeps records as bytes (memory keeps objects).
_RECORD_CUTTERS = {"lmdb": _cut_lmdb_chunk_record, "redis": _cut_redis_chunk_record}
