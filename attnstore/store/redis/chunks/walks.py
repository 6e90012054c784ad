"""Reads and writes over a namespace's chunk entries in Redis: layout, byte counts, the byte cap's
candidates, deletes, drops, stats and verify (none imports the store; the store and ``admin`` call them)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from attnstore.errors import ChecksumError
from attnstore.protocol.chunks import ChunkLayout
from attnstore.store.chunks.records import ChunkRecord, chunk_problem, where
from attnstore.store.eviction import ChunkCandidate
from attnstore.store.redis.chunks import scripts
from attnstore.store.redis.connection import RedisConnection, translated
from attnstore.store.redis.keys import StoreKeys
from attnstore.store.reports import CorruptChunk


def layout_json(layout: ChunkLayout) -> str:
    """The layout as stored (key order fixed, so the put script compares it as a string)."""
    return json.dumps(layout.to_dict(), sort_keys=True)


def read_layout(connection: RedisConnection, keys: StoreKeys, namespace: str) -> ChunkLayout | None:
    """The namespace's chunk layout, or None."""
    with translated(f"reading the chunk layout of {namespace!r}"):
        raw = connection.client.get(keys.namespace(namespace).chunk_layout)
    return None if raw is None else ChunkLayout.from_dict(json.loads(bytes(raw)))


def total_bytes(connection: RedisConnection, keys: StoreKeys, namespaces: Sequence[str]) -> int:
    """Bytes of every stored chunk of ``namespaces``."""
    if not namespaces:
        return 0
    with translated("reading chunk byte counts"):
        pipe = connection.client.pipeline(transaction=False)
        for name in namespaces:
            pipe.get(keys.namespace(name).chunk_bytes)
        return sum(int(raw or 0) for raw in pipe.execute())


def candidates(
    connection: RedisConnection, keys: StoreKeys, namespaces: Sequence[str], protect: set[tuple[str, bytes]],
) -> list[ChunkCandidate]:
    """Every stored chunk of ``namespaces`` but those in ``protect``, with its recency (the later of its storing
    and last read) and bytes."""
    found = []
    for name in namespaces:
        layout = read_layout(connection, keys, name)
        if layout is None:
            continue
        ns_keys = keys.namespace(name)
        with translated(f"reading the chunks of {name!r}"):
            recency = connection.client.zrange(ns_keys.chunk_recency, 0, -1, withscores=True)
            records = connection.client.hgetall(ns_keys.chunks)
        for raw_key, score in recency:
            key = bytes(raw_key)
            record = records.get(key)
            if record is not None and (name, key) not in protect:
                try:
                    candidate = ChunkCandidate(float(score), name, key,
                                               layout.chunk_bytes(ChunkRecord.decode(record).length))
                except ChecksumError:  # a damaged chunk goes first, with the bytes of its layers
                    with translated(f"reading a damaged chunk of {name!r}"):
                        layers = connection.client.hvals(ns_keys.chunk(key))
                    candidate = ChunkCandidate(0.0, name, key, sum(len(piece) for piece in layers))
                found.append(candidate)
    return found


def writer_keys(connection: RedisConnection, keys: StoreKeys, namespace: str, writer: str) -> list[bytes]:
    """The keys of ``namespace``'s chunks whose record names ``writer`` (a damaged record names none)."""
    with translated(f"reading the chunks of {namespace!r}"):
        records = connection.client.hgetall(keys.namespace(namespace).chunks)
    found = []
    for raw_key, raw_record in records.items():
        try:
            record = ChunkRecord.decode(raw_record)
        except ChecksumError:
            continue
        if record.writer == writer:
            found.append(bytes(raw_key))
    return found


def delete(connection: RedisConnection, keys: StoreKeys, namespace: str, chunk_keys: Sequence[bytes]) -> int:
    """Delete chunks of ``namespace`` in one script; returns how many were stored."""
    if not chunk_keys:
        return 0
    ns_keys = keys.namespace(namespace)
    with translated(f"deleting chunks of {namespace!r}"):
        return int(connection.eval(scripts.DELETE, [*ns_keys.chunk_keys(), *map(ns_keys.chunk, chunk_keys)],
                                   list(chunk_keys)))


def drop(connection: RedisConnection, keys: StoreKeys, namespace: str) -> int:
    """Delete the namespace's chunk layout and chunks in one script; returns how many chunks."""
    ns_keys = keys.namespace(namespace)
    with translated(f"dropping the chunks of {namespace!r}"):
        return int(connection.eval(scripts.DROP, ns_keys.chunk_keys(), [ns_keys.key("c:")]))


def usage(connection: RedisConnection, keys: StoreKeys, namespaces: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Chunk entries and their bytes per namespace."""
    if not namespaces:
        return {}
    with translated("reading chunk counts"):
        pipe = connection.client.pipeline(transaction=False)
        for name in namespaces:
            pipe.hlen(keys.namespace(name).chunks)
            pipe.get(keys.namespace(name).chunk_bytes)
        replies = pipe.execute()
    return {name: (int(replies[2 * i]), int(replies[2 * i + 1] or 0)) for i, name in enumerate(namespaces)}


def findings(connection: RedisConnection, keys: StoreKeys, namespaces: Sequence[str]) -> tuple[int, list[CorruptChunk]]:
    """Chunks checked, and each one whose layers are damaged or missing."""
    checked, corrupt = 0, []
    for name in namespaces:
        layout = read_layout(connection, keys, name)
        ns_keys = keys.namespace(name)
        with translated(f"verifying the chunks of {name!r}"):
            records = connection.client.hgetall(ns_keys.chunks)
            pipe = connection.client.pipeline(transaction=False)
            for key in records:
                pipe.hgetall(ns_keys.chunk(bytes(key)))
            layers = pipe.execute()
        for (raw_key, raw_record), fields in zip(records.items(), layers, strict=True):
            checked += 1
            key = bytes(raw_key)
            if layout is None:
                corrupt.append(CorruptChunk(name, key.hex(), "its namespace has no chunk layout"))
                continue
            pieces = {int(field): bytes(value) for field, value in fields.items()}
            try:
                record = ChunkRecord.decode(raw_record, where(name, key))
            except ChecksumError as exc:
                corrupt.append(CorruptChunk(name, key.hex(), str(exc)))
                continue
            problem = chunk_problem(layout, record, pieces.get)
            if problem is not None:
                corrupt.append(CorruptChunk(name, key.hex(), problem))
    return checked, corrupt
