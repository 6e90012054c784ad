"""Reads of a Redis store's entries: maps, outputs, records, listings.

``RedisEntryReads`` is a part ``RedisMapStore`` holds and delegates its entry reads to: it reads with
the store's client and keys, asks the store for a namespace's state and the hits it has not flushed
yet, and forgets, through the store, a registered entry whose hash Redis evicted (``forget_missing``),
so every daemon's index drops it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import numpy as np

from attnstore.errors import ChecksumError, EntryNotFoundError
from attnstore.protocol.records import EntryInfo, EntryRef
from attnstore.store.arrays import NamespaceState
from attnstore.store.entry_record import EntryRecord
from attnstore.store.redis import admin
from attnstore.store.redis.connection import RedisConnection, translated
from attnstore.store.redis.keys import (
    OUTPUTS_FIELD,
    RECORD_FIELD,
    StoreKeys,
    decode_layers,
    decode_outputs,
    decode_record,
    layer_fields,
)


def _ref(raw: bytes | str | None) -> EntryRef | None:
    if raw is None:
        return None
    entry_id, length = (raw.encode() if isinstance(raw, str) else bytes(raw)).split(b" ")
    return EntryRef(int(entry_id), int(length))


def _feature(raw: bytes | None) -> np.ndarray | None:
    return None if raw is None else np.frombuffer(raw, dtype="<f4").astype(np.float32)


class ForgetMissing(Protocol):
    """The store's ``_forget_missing``: forgets registered entries whose hash is gone; returns those forgotten."""

    def __call__(self, namespace: str, ids: Sequence[int], *, known_gone: bool = False) -> list[int]: ...


class RedisEntryReads:
    """The entry reads of a ``RedisMapStore``, given what they need of it."""

    def __init__(
        self, redis: RedisConnection, keys: StoreKeys, state: Callable[[str], NamespaceState],
        pending_hits: Callable[[str, int], tuple[int, float]], forget_missing: ForgetMissing,
    ) -> None:
        self._redis, self._keys = redis, keys
        self._state = state  # a namespace's state (NamespaceNotFoundError for none)
        self._pending_hits = pending_hits  # hits counted in this process, not yet flushed to Redis
        self._forget_missing = forget_missing

    def _fields(self, namespace: str, entry_id: int, fields: Sequence[bytes] | None = None) -> dict[bytes, bytes]:
        """Fields of one entry's hash (all when ``fields`` is None); an empty dict if it is gone."""
        key = self._keys.entry(namespace, entry_id)
        with translated(f"reading entry {entry_id} of {namespace!r}"):
            if fields is None:
                return dict(self._redis.client.hgetall(key))
            values = self._redis.client.hmget(key, list(fields))
        return {f: v for f, v in zip(fields, values, strict=True) if v is not None}

    def _record(self, namespace: str, state: NamespaceState, entry_id: int, fields: dict[bytes, bytes]) -> EntryRecord:
        """The entry's record; a registered entry whose hash is gone is forgotten (EntryNotFoundError)."""
        raw = fields.get(RECORD_FIELD)
        if raw is None:
            self._forget_missing(namespace, [entry_id], known_gone=True)
        return decode_record(state, entry_id, raw)

    def read_maps(self, namespace: str, entry_id: int) -> np.ndarray:
        """See :meth:`MapStoreBase.read_maps`: the whole entry in one read."""
        state = self._state(namespace)
        fields = self._fields(namespace, entry_id)  # the whole entry in one read
        record = self._record(namespace, state, entry_id, fields)
        out = np.empty(state.layout.map_shape(record.length), dtype=np.float16)  # (layers, heads, L, L)
        decode_layers(state, record, fields, range(state.layout.layers), out)
        return out

    def read_layer(self, namespace: str, entry_id: int, layer: int) -> np.ndarray:
        """See :meth:`MapStoreBase.read_layer` (of a layer it checked): only that layer's fields are read."""
        state = self._state(namespace)
        fields = self._fields(namespace, entry_id, [RECORD_FIELD, *layer_fields(state, layer)])
        record = self._record(namespace, state, entry_id, fields)
        out = np.empty((1, state.layout.heads, record.length, record.length), dtype=np.float16)
        decode_layers(state, record, fields, [layer], out)
        return out[0]  # (heads, L, L)

    def read_outputs(self, namespace: str, entry_id: int) -> np.ndarray | None:
        """See :meth:`MapStoreBase.read_outputs`."""
        state = self._state(namespace)
        fields = self._fields(namespace, entry_id, [RECORD_FIELD, OUTPUTS_FIELD])
        record = self._record(namespace, state, entry_id, fields)
        return decode_outputs(state, record, fields.get(OUTPUTS_FIELD))  # (L, hidden)

    def find_by_hashes(self, namespace: str, token_hashes: list[bytes]) -> list[EntryRef | None]:
        """See :meth:`MapStoreBase.find_by_hashes`. An entry Redis evicted may still be found here; reading
        it raises EntryNotFoundError (the exact tier then misses) and forgets it."""
        self._state(namespace)
        if not token_hashes:
            return []
        with translated(f"looking up token hashes in {namespace!r}"):
            raws = self._redis.client.hmget(self._keys.namespace(namespace).hashes, token_hashes)
        return [_ref(raw) for raw in raws]

    def _infos(self, namespace: str, state: NamespaceState, ids: Sequence[int]) -> list[EntryInfo | None]:
        """Each entry's metadata with its feature and hits (None where gone or corrupt); three reads."""
        raws = admin.records(self._redis, self._keys, namespace, ids)
        keys = self._keys.namespace(namespace)
        fields = [f for entry_id in ids for f in (str(entry_id), f"{entry_id}:t")]
        with translated(f"reading entries of {namespace!r}"):
            features = self._redis.client.hmget(keys.features, [str(i) for i in ids]) if ids else []
            hits = self._redis.client.hmget(keys.hits, fields) if ids else []
        infos: list[EntryInfo | None] = []
        for i, (entry_id, raw) in enumerate(zip(ids, raws, strict=True)):
            try:
                record = decode_record(state, entry_id, raw)
            except (EntryNotFoundError, ChecksumError):
                infos.append(None)  # gone meanwhile, or corrupt (verify reports it)
                continue
            pending, pending_last = self._pending_hits(namespace, entry_id)  # counted here, not yet flushed
            count = int(hits[2 * i] or 0) + pending
            last = max(float(hits[2 * i + 1] or 0.0), pending_last)
            infos.append(dataclasses.replace(record.info(count, last), feature=_feature(features[i])))
        return infos

    def entry(self, namespace: str, entry_id: int) -> EntryInfo:
        """See :meth:`MapStoreBase.entry`."""
        state = self._state(namespace)
        (info,) = self._infos(namespace, state, [entry_id])
        if info is None:
            self._record(namespace, state, entry_id, self._fields(namespace, entry_id, [RECORD_FIELD]))
            raise EntryNotFoundError(f"no entry {entry_id} in namespace {namespace!r}")
        return info

    def token_ids(self, namespace: str, entry_ids: Sequence[int]) -> list[np.ndarray | None]:
        """See :meth:`MapStoreBase.token_ids`."""
        state = self._state(namespace)
        found: list[np.ndarray | None] = []
        for entry_id, raw in zip(entry_ids, admin.records(self._redis, self._keys, namespace, entry_ids), strict=True):
            try:
                found.append(decode_record(state, entry_id, raw).token_ids)
            except (EntryNotFoundError, ChecksumError):
                found.append(None)
        return found

    def entries(self, namespace: str, length: int | None = None) -> Iterator[EntryInfo]:
        """See :meth:`MapStoreBase.entries`. Entries gone or corrupt are skipped (verify lists corrupt ones).

        Raises:
            NamespaceNotFoundError: at the call, not at the first ``next``.
        """
        state = self._state(namespace)
        return self._iter_entries(namespace, state, length)

    def _iter_entries(self, namespace: str, state: NamespaceState, length: int | None) -> Iterator[EntryInfo]:
        for page in admin.id_pages(self._redis, self._keys.namespace(namespace).ids):
            for info in self._infos(namespace, state, page):
                if info is not None and (length is None or info.length == length):
                    yield info

    def lengths(self, namespace: str) -> list[int]:
        """See :meth:`MapStoreBase.lengths`."""
        self._state(namespace)
        return [bucket.length for bucket in admin.bucket_stats(self._redis, self._keys, namespace)]
