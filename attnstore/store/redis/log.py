"""A namespace's log (a Redis Stream) and its index snapshot: how every daemon keeps its indexes current.

Ingests and deletes append to the namespace's Stream in the same script that
changes its index keys, so the log and the store never disagree. A daemon
builds an index from the snapshot (the index rows as of a log position,
safetensors in parts) plus the log after it, then reads the log as it grows.
Writing a snapshot trims the log below it, keeping the last
``log_retain_seconds`` of changes so that followers a little behind lose
nothing; one further behind sees ``ChangeBatch.rebuild`` and starts over from
the snapshot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import safetensors.numpy

from attnstore.store.arrays import NamespaceState
from attnstore.store.feed import ChangeBatch, IndexChange, IndexRows, IndexState
from attnstore.store.redis import scripts
from attnstore.store.redis.connection import RedisConnection, translated
from attnstore.store.redis.entries import decode_record
from attnstore.store.redis.keys import RECORD_FIELD, NamespaceKeys, StoreKeys
from attnstore.store.redis.settings import RedisSettings

log = logging.getLogger(__name__)

START = "0-0"  # before the first change of any log
_PAGE = 1000  # log entries or records per read
_SNAPSHOT_CHECK_SECONDS = 5.0  # how often a follower checks whether a log has grown past snapshot_events

Rows = dict[int, tuple[int, np.ndarray]]  # id -> (length, feature)


def stream_id(text: str | bytes) -> tuple[int, int]:
    """A Stream id ``"ms-seq"`` as a comparable pair."""
    ms, _, seq = (text.decode() if isinstance(text, bytes) else text).partition("-")
    return int(ms), int(seq or 0)


def _decode(fields: dict[bytes, bytes], feature_dim: int) -> IndexChange:
    if fields.get(b"op") == b"del":
        return IndexChange(removed=tuple(int(i) for i in fields[b"ids"].split(b",")))
    refs = [ref.split(b" ") for ref in fields[b"refs"].split(b",")]
    features = np.frombuffer(fields[b"features"], dtype="<f4").reshape(len(refs), feature_dim)
    return IndexChange(added=IndexRows(
        np.array([int(i) for i, _ in refs], dtype=np.uint64),
        np.array([int(n) for _, n in refs], dtype=np.int64),
        features.astype(np.float32),
    ))


def _apply(rows: Rows, change: IndexChange) -> None:
    if change.added is not None:
        for entry_id, length, feature in zip(change.added.ids, change.added.lengths, change.added.features,
                                             strict=True):
            rows[int(entry_id)] = (int(length), feature)
    for entry_id in change.removed:
        rows.pop(entry_id, None)


class NamespaceLog:
    """Reads and snapshots the logs of one store's namespaces. Thread-safe.

    Args:
        connection: the store's client.
        keys: the store's key names.
        settings: snapshot and retention settings.
        state_of: the ``NamespaceState`` of a namespace (raises NamespaceNotFoundError).
        on_removed: called with each batch of ids a log says were removed (the store's DRAM tier forgets them).
    """

    def __init__(
        self,
        connection: RedisConnection,
        keys: StoreKeys,
        settings: RedisSettings,
        state_of: Callable[[str], NamespaceState],
        on_removed: Callable[[str, tuple[int, ...]], None],
    ) -> None:
        self._redis = connection
        self._keys = keys
        self._settings = settings
        self._state_of = state_of
        self._on_removed = on_removed
        self._checked: dict[str, float] = {}  # namespace -> when its log length was last checked

    def changes(self, namespace: str, position: str, *, limit: int = _PAGE) -> ChangeBatch:
        """See :meth:`ChangeFeed.changes`; a follower that is caught up also keeps the log short."""
        state = self._state_of(namespace)
        keys = self._keys.namespace(namespace)
        with translated(f"reading the log of {namespace!r}"):
            pipe = self._redis.client.pipeline(transaction=False)
            pipe.get(keys.trimmed)
            pipe.xrange(keys.log, min=f"({position}", max="+", count=limit)
            trimmed, entries = pipe.execute()
        if trimmed is not None and stream_id(trimmed) > stream_id(position):
            return ChangeBatch([], position, rebuild=True)
        changes = [_decode(fields, state.layout.feature_dim) for _, fields in entries]
        for change in changes:
            if change.removed:
                self._on_removed(namespace, change.removed)
        if entries:
            position = bytes(entries[-1][0]).decode()
        elif time.monotonic() - self._checked.get(namespace, 0.0) >= _SNAPSHOT_CHECK_SECONDS:
            self._checked[namespace] = time.monotonic()
            self._snapshot_if_long(namespace, keys)
        return ChangeBatch(changes, position)

    def index_state(self, namespace: str) -> IndexState:
        """See :meth:`ChangeFeed.index_state`: the snapshot plus the log after it."""
        state = self._state_of(namespace)
        rows, position = self._read_snapshot(namespace, state)
        while True:
            batch = self.changes(namespace, position, limit=_PAGE)
            if batch.rebuild:
                # Trimmed past the snapshot read (another process wrote a newer one meanwhile): read the
                # entries themselves, from a position no trim passes (the log's last change).
                rows, position = self._scan_rows(namespace, state)
                continue
            for change in batch.changes:
                _apply(rows, change)
            position = batch.position
            if len(batch.changes) < _PAGE:
                return IndexState(IndexRows.from_dict(rows, state.layout.feature_dim), position)

    def write_snapshot(self, namespace: str) -> str:
        """Write the namespace's index rows as a snapshot and trim the log below it; returns its position."""
        state = self._state_of(namespace)
        keys = self._keys.namespace(namespace)
        current = self.index_state(namespace)
        rows = current.rows
        blob = safetensors.numpy.save(
            {"ids": rows.ids, "lengths": rows.lengths, "features": rows.features},
            metadata={"namespace": namespace, "position": current.position},
        )
        size = self._settings.snapshot_part_bytes
        parts = [blob[start : start + size] for start in range(0, len(blob), size)] or [b""]
        fields: dict[str | bytes, bytes | str | int | float] = {
            "position": current.position, "parts": len(parts), "created": time.time(),
        }
        fields.update({str(i): part for i, part in enumerate(parts)})
        retain_ms = int((time.time() - self._settings.log_retain_seconds) * 1000)
        trim_below = min(stream_id(current.position), (retain_ms, 0))
        with translated(f"writing the index snapshot of {namespace!r}"):
            self._redis.client.hset(keys.snapshot, mapping=fields)  # one command: readers see all of it or none
            if trim_below > (0, 0):
                self._redis.eval(scripts.TRIM, [keys.log, keys.trimmed], [f"{trim_below[0]}-{trim_below[1]}"])
        log.info("event=index_snapshot namespace=%s entries=%d position=%s bytes=%d",
                 state.name, len(rows), current.position, len(blob))
        return current.position

    def _read_snapshot(self, namespace: str, state: NamespaceState) -> tuple[Rows, str]:
        keys = self._keys.namespace(namespace)
        with translated(f"reading the index snapshot of {namespace!r}"):
            head = self._redis.client.hmget(keys.snapshot, ["position", "parts"])
            if head[0] is None:
                return {}, START  # never snapshotted, so never trimmed: the whole log is there
            fields = self._redis.client.hmget(keys.snapshot, [str(i) for i in range(int(head[1]))])
        if any(part is None for part in fields):
            return self._scan_rows(namespace, state)  # replaced by a smaller one between the two reads
        tensors = safetensors.numpy.load(b"".join(fields))
        rows: Rows = {
            int(entry_id): (int(length), feature)
            for entry_id, length, feature in zip(tensors["ids"], tensors["lengths"], tensors["features"], strict=True)
        }
        return rows, bytes(head[0]).decode()

    def _scan_rows(self, namespace: str, state: NamespaceState) -> tuple[Rows, str]:
        """Every live entry's index row, read from the entries themselves (no usable snapshot)."""
        keys = self._keys.namespace(namespace)
        with translated(f"reading the log of {namespace!r}"):
            last = self._redis.client.xrevrange(keys.log, count=1)
        position = bytes(last[0][0]).decode() if last else START
        rows: Rows = {}
        for page in self._id_pages(keys):
            with translated(f"reading the entries of {namespace!r}"):
                pipe = self._redis.client.pipeline(transaction=False)
                for entry_id in page:
                    pipe.hget(self._keys.entry(namespace, entry_id), RECORD_FIELD)
                raws = pipe.execute()
            for entry_id, raw in zip(page, raws, strict=True):
                if raw is None:
                    continue  # evicted by Redis: found and forgotten when a lookup proposes it
                record = decode_record(state, entry_id, raw)
                if record.feature is not None:
                    rows[entry_id] = (record.length, record.feature)
        return rows, position

    def _id_pages(self, keys: NamespaceKeys) -> list[list[int]]:
        pages: list[list[int]] = []
        low = "-inf"
        while True:
            with translated("listing entry ids"):
                ids = [int(i) for i in self._redis.client.zrangebyscore(keys.ids, low, "+inf", start=0, num=_PAGE)]
            if not ids:
                return pages
            pages.append(ids)
            low = f"({ids[-1]}"

    def _snapshot_if_long(self, namespace: str, keys: NamespaceKeys) -> None:
        with translated(f"checking the log of {namespace!r}"):
            if self._redis.client.xlen(keys.log) <= self._settings.snapshot_events:
                return
            interval = max(1, int(self._settings.snapshot_interval_seconds))
            if not self._redis.client.set(keys.snapshot_lock, "1", nx=True, ex=interval):
                return  # another process writes it, or wrote one within the interval
        self.write_snapshot(namespace)
