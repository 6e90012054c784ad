"""Chunk entries of the Redis store: one script per ``put_chunks`` call.

A namespace's chunks live on its shard (``keys``), so the put script stores a
call's chunks together, atomically: a client killed mid-call has sent all of the
script or none of it. Before the put, the byte cap evicts the least recently read
chunks of every namespace when the store would go over it (``chunks_to_evict``);
several writers may race there, and the cap is then passed by at most their
puts until the next one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from attnstore.errors import EntryNotFoundError, FingerprintMismatchError
from attnstore.protocol.chunks import ChunkLayout, StoredChunk
from attnstore.store.chunks.interface import StoredChunks
from attnstore.store.chunks.records import (
    ChunkRecord,
    chunk_pieces,
    chunks_to_evict,
    gather_layers,
    new_record,
    recorded_writer,
    stored_length,
    where,
)
from attnstore.store.namespace_rules import check_same_layout
from attnstore.store.redis.chunks import scripts, walks
from attnstore.store.redis.connection import RedisConnection, translated
from attnstore.store.redis.keys import StoreKeys

if TYPE_CHECKING:
    from attnstore.protocol.records import NamespaceInfo
    from attnstore.store.redis.catalog import Catalog
    from attnstore.store.redis.urls import RedisSettings

logger = logging.getLogger(__name__)


class RedisChunks(StoredChunks):
    """Chunk entries of a Redis store (its ``store.chunks``), each namespace's on its shard."""

    def __init__(self, redis: RedisConnection, keys: StoreKeys, settings: RedisSettings, catalog: Catalog,
                 namespace: Callable[[str], NamespaceInfo], check_writable: Callable[[], None],
                 entry_bytes: Callable[[], int]) -> None:
        """
        Args:
            redis, keys, settings, catalog: the store's connection, key names, settings and namespace catalog.
            namespace: the store's ``get_namespace`` (raises NamespaceNotFoundError).
            check_writable: the store's check that it takes writes (raises ReadOnlyStoreError).
            entry_bytes: the stored bytes of every registered entry of the store (for the byte cap).
        """
        self._redis = redis
        self._keys = keys
        self._settings = settings
        self._catalog = catalog
        self._namespace = namespace
        self._check_writable = check_writable
        self._entry_bytes = entry_bytes

    def _set_layout(self, namespace: str, layout: ChunkLayout) -> ChunkLayout:
        self._check_writable()
        self._namespace(namespace)
        with translated(f"setting the chunk layout of {namespace!r}"):
            taken = self._redis.client.set(self._keys.namespace(namespace).chunk_layout, walks.layout_json(layout),
                                           nx=True)
        stored = None if taken else walks.read_layout(self._redis, self._keys, namespace)  # None: just set
        check_same_layout(namespace, "chunks", stored, layout)
        return layout

    def _layout(self, namespace: str) -> ChunkLayout | None:
        self._namespace(namespace)
        return walks.read_layout(self._redis, self._keys, namespace)

    def _put(self, namespace: str, layout: ChunkLayout, chunks: list[StoredChunk]) -> int:
        self._check_writable()
        if not chunks:
            return 0
        ns_keys = self._keys.namespace(namespace)
        with translated(f"looking up chunks of {namespace!r}"):
            stored = self._redis.client.hmget(ns_keys.chunks, [c.key for c in chunks])
        incoming = sum(c.kv.nbytes for c, there in zip(chunks, stored, strict=True) if there is None)
        max_bytes = self._settings.max_bytes
        if max_bytes is not None and incoming:
            names = self._catalog.names()
            used = self._entry_bytes() + walks.total_bytes(self._redis, self._keys, names)
            if used + incoming > max_bytes:
                protect = {(namespace, c.key) for c in chunks}
                victims = chunks_to_evict(used, incoming, max_bytes, self._settings.evict_low_water,
                                          walks.candidates(self._redis, self._keys, names, protect))
                by_namespace: dict[str, list[bytes]] = {}
                for victim in victims:
                    by_namespace.setdefault(victim.namespace, []).append(victim.key)
                for name, gone in by_namespace.items():
                    walks.delete(self._redis, self._keys, name, gone)
                logger.warning("map store %s over its cap of %s bytes: evicted %s least recently read chunks",
                               self._redis.location.display, max_bytes, len(victims))
        args: list[bytes | str | int | float] = [walks.layout_json(layout), repr(time.time()), layout.layers]
        for chunk in chunks:
            pieces = chunk_pieces(chunk)
            args += [chunk.key, new_record(chunk, pieces).encode(), sum(len(p) for p in pieces), *pieces]
        with translated(f"storing chunks of {namespace!r}"):
            reply = self._redis.eval(scripts.PUT, [*ns_keys.chunk_keys(), *(ns_keys.chunk(c.key) for c in chunks)],
                                     args)
        if bytes(reply[0]) != b"ok":
            raise FingerprintMismatchError(f"namespace {namespace!r}: its chunk layout changed meanwhile")
        return int(reply[1])

    def _lengths(self, namespace: str, keys: list[bytes]) -> list[int | None]:
        if not keys:
            return []
        with translated(f"looking up chunks of {namespace!r}"):
            records = self._redis.client.hmget(self._keys.namespace(namespace).chunks, keys)
        return [stored_length(raw) for raw in records]

    def _read(self, namespace: str, layout: ChunkLayout, key: bytes, layers: list[int]) -> np.ndarray:
        ns_keys = self._keys.namespace(namespace)
        now = "" if self._settings.readonly else repr(time.time())
        with translated(f"reading {where(namespace, key)}"):
            reply = self._redis.eval(scripts.READ, [*ns_keys.chunk_keys(), ns_keys.chunk(key)],
                                     [key, now, *(str(layer) for layer in layers)])
        if not reply:
            raise EntryNotFoundError(f"{where(namespace, key)} is not stored")
        record = ChunkRecord.decode(reply[0], where(namespace, key))
        pieces = dict(zip(layers, reply[1:], strict=True))
        return gather_layers(namespace, layout, key, record, layers, pieces.__getitem__)

    def _writer_keys(self, namespace: str, writer: str) -> list[bytes]:
        return walks.writer_keys(self._redis, self._keys, namespace, writer)

    def _writer_of(self, namespace: str, key: bytes) -> tuple[bool, str | None]:
        with translated(f"reading the record of {where(namespace, key)}"):
            return recorded_writer(self._redis.client.hget(self._keys.namespace(namespace).chunks, key))

    def _delete(self, namespace: str, keys: list[bytes]) -> int:
        self._check_writable()
        return walks.delete(self._redis, self._keys, namespace, keys)

