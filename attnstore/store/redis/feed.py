"""The change feed of a Redis store: each namespace's Stream of ingests, deletes and feature resets.

The scripts that change a namespace's index keys append to its Stream in the
same atomic step, so the log and the keys never disagree. A daemon builds a
namespace's index from the keys themselves (the features hash, paged) after
noting the log's last id, then applies the log from that id on: a change seen
both ways is applied twice, which is harmless. The log is capped (see
``RedisSettings.log_max_events``, the last id trimmed away noted beside it); a
follower whose position is below that is told to rebuild (``ChangeBatch.rebuild``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from attnstore.store.feed import ChangeBatch, ChangeFeed, IndexChange, IndexRows, IndexState
from attnstore.store.redis.catalog import Catalog
from attnstore.store.redis.connection import RedisConnection, translated
from attnstore.store.redis.keys import StoreKeys

log = logging.getLogger(__name__)

START = "0-0"  # before the first change of any log
_PAGE = 1000  # features per HSCAN step


def stream_id(text: str | bytes) -> tuple[int, int]:
    """A Stream id ``"ms-seq"`` as a comparable pair."""
    ms, _, seq = (text.decode() if isinstance(text, bytes) else text).partition("-")
    return int(ms), int(seq or 0)


def _decode(fields: dict[bytes, bytes], feature_dim: int) -> IndexChange:
    op = fields.get(b"op")
    if op == b"del":
        return IndexChange(removed=tuple(int(i) for i in fields[b"ids"].split(b",")))
    if op == b"reset":
        return IndexChange(reset=True)
    ids = [int(i) for i in fields[b"ids"].split(b",")]
    features = np.frombuffer(fields[b"features"], dtype="<f4").reshape(len(ids), feature_dim)
    return IndexChange(added=IndexRows(
        np.array(ids, dtype=np.uint64),
        np.array([int(n) for n in fields[b"lengths"].split(b",")], dtype=np.int64),
        features.astype(np.float32),
    ))


class RedisChangeFeed(ChangeFeed):
    """See :class:`ChangeFeed`; one per open RedisMapStore.

    Args:
        connection: the store's client.
        keys: the store's key names.
        catalog: the store's namespaces.
        forget_missing: returns the given ids whose entries are gone, unregistering them (the store's).
        on_removed: called with the ids a log says were removed (a DRAM cache in front forgets them).
        check_store: reads the store's identity again, the store dropping its caches when it changed.
    """

    def __init__(
        self, connection: RedisConnection, keys: StoreKeys, catalog: Catalog,
        forget_missing: Callable[[str, Sequence[int]], list[int]], on_removed: Callable[[str, Iterable[int]], None],
        check_store: Callable[[], str | None],
    ) -> None:
        self._redis = connection
        self._keys = keys
        self._catalog = catalog
        self._forget_missing = forget_missing
        self._on_removed = on_removed
        self._check_store = check_store

    def index_state(self, namespace: str) -> IndexState:
        """See :meth:`ChangeFeed.index_state`: the features hash, read after noting the log's last id."""
        info = self._catalog.get(namespace)
        keys = self._keys.namespace(namespace)
        dim = info.layout.feature_dim
        with translated(f"reading the log of {namespace!r}"):
            last = self._redis.client.xrevrange(keys.log, count=1)
        position = bytes(last[0][0]).decode() if last else START
        rows: dict[int, tuple[int, np.ndarray]] = {}
        cursor = 0
        while True:
            with translated(f"reading the features of {namespace!r}"):
                cursor, page = self._redis.client.hscan(keys.features, cursor, count=_PAGE)
                ids = [bytes(k).decode() for k in page]
                metas = self._redis.client.hmget(keys.meta, ids) if ids else []
            for entry_id, meta in zip(ids, metas, strict=True):
                if meta is not None:  # removed between the two reads
                    length = int(bytes(meta)[32:].split(b" ")[0])
                    rows[int(entry_id)] = (length, np.frombuffer(page[entry_id.encode()], dtype="<f4").copy())
            if cursor == 0:
                return IndexState(IndexRows.from_dict(rows, dim), position)

    def changes(self, namespace: str, position: str, *, limit: int = 1000) -> ChangeBatch:
        """See :meth:`ChangeFeed.changes`."""
        info = self._catalog.get(namespace)
        keys = self._keys.namespace(namespace)
        with translated(f"reading the log of {namespace!r}"):
            # The log first, the trim mark second: the mark only grows, so one at or below the position read
            # after the log means nothing after the position was gone when the log was read.
            entries = self._redis.client.xrange(keys.log, min=f"({position}", max="+", count=limit)
            trimmed = self._redis.client.get(keys.trimmed)
        if trimmed is not None and stream_id(trimmed) > stream_id(position):
            return ChangeBatch([], position, rebuild=True)
        changes, skipped = [], 0
        for record_id, fields in entries:
            try:
                changes.append(_decode(fields, info.layout.feature_dim))
            except (KeyError, ValueError, TypeError, UnicodeDecodeError) as exc:
                # Written by no script of ours (a bug, a hand edit): what it said is unknown, so the caller
                # rebuilds the namespace's index from its keys, which the scripts keep right whatever the log holds.
                skipped += 1
                log.warning("event=change_log_record_skipped namespace=%s record=%s error=%r detail='the index is"
                            " rebuilt from the store's keys'", namespace, bytes(record_id).decode(), exc)
        for change in changes:
            if change.removed:
                self._on_removed(namespace, change.removed)
        if entries:
            position = bytes(entries[-1][0]).decode()
        return ChangeBatch(changes, position, rebuild=bool(skipped), skipped=skipped)

    def catalog_version(self) -> str:
        """See :meth:`ChangeFeed.catalog_version`: the namespace names with their creation times."""
        with translated("reading the catalog"):
            listed = self._redis.client.hgetall(self._keys.namespaces)
        return ",".join(sorted(f"{bytes(k).decode()}={bytes(v).decode()}" for k, v in listed.items()))

    def store_identity(self) -> str | None:
        """See :meth:`ChangeFeed.store_identity`: the store marker's id (``store.redis.watch``)."""
        return self._check_store()

    def missing(self, namespace: str, ids: Sequence[int]) -> list[int]:
        """See :meth:`ChangeFeed.missing`."""
        return self._forget_missing(namespace, ids)
