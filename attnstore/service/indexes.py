"""Index upkeep: one ``BucketedIndex`` per namespace, kept in step with the store.

Indexes are rebuilt from the feature vectors kept in the entry records when a
store is opened, so nothing but the store is persisted. Searches and updates
share one lock: faiss indexes must not be searched while they change.

A store that other processes write too (one with a ``change_feed``: Redis)
is followed: :meth:`NamespaceIndexes.follow` applies what its log says
happened since the index was built (``service.follower`` calls it in a loop).
Every change may then arrive twice (from this process's own write and from
the log), so adds replace rows of the same id instead of refusing them.

A rebuild reads the store outside the lock (searches go on meanwhile) and
swaps the new indexes in under it. Adds and removes made while it reads are
applied to the old indexes *and* kept in a journal that is replayed onto the
new ones at the swap: an entry written during a compaction or a projector
replacement is neither lost from the map tier nor brought back after a delete.
Replaying is harmless for what the new indexes already hold (adds replace
rows of the same id, removes ignore unknown ids). One rebuild runs at a time,
and never beside a step of the follower.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import numpy as np

from attnstore.index import BucketedIndex, Candidate, Match, VectorIndex
from attnstore.protocol.records import NamespaceInfo
from attnstore.store import MapStoreBase
from attnstore.store.feed import ChangeFeed

log = logging.getLogger(__name__)

# One index change made while a rebuild reads the store, replayed onto the rebuilt indexes at the swap.
_Change = Callable[[Mapping[str, BucketedIndex]], None]


class NamespaceIndexes:
    """The vector indexes of every namespace of one store; thread-safe.

    Args:
        store: where the feature vectors are read from.
        make_index: builds an empty index of a given dimension for a new bucket.
        length_penalty: predicted distance added per token when a causal query
            matches a longer entry (the training target's length term).
    """

    def __init__(
        self, store: MapStoreBase, make_index: Callable[[int], VectorIndex], *, length_penalty: float
    ) -> None:
        self._store = store
        self._make_index = make_index
        self._length_penalty = length_penalty
        self._lock = threading.Lock()
        self._rebuilding = threading.Lock()  # one rebuild (or follower step) at a time
        self._journal: list[_Change] | None = None  # while a rebuild reads the store: changes made meanwhile
        self._feed = store.change_feed() if store.supports_change_feed else None
        self.skipped_records = 0  # change-log records that did not decode (only the follower's step writes it)
        self._positions: dict[str, str] = {}  # namespace -> its log position its index includes (with a feed)
        self._created: dict[str, float] = {}  # namespace -> created time of the namespace its index is of
        self._catalog_version = "" if self._feed is None else self._feed.catalog_version()
        # The store these indexes were built from (see ChangeFeed.store_identity); a new one rebuilds them all.
        self._identity = None if self._feed is None else self._feed.store_identity()
        self.resets = 0  # times the store was found replaced and every index rebuilt (the follower's step)
        self._indexes: dict[str, BucketedIndex] = {info.name: self._build(info) for info in store.list_namespaces()}

    def ensure(self, info: NamespaceInfo) -> None:
        """Give a new namespace an empty index (keeps an existing one)."""
        if self._feed is not None and info.name not in self._indexes:
            index = self._build(info)  # also notes the log position to follow from
            with self._lock:
                self._indexes.setdefault(info.name, index)
            return
        with self._lock:
            self._indexes.setdefault(info.name, BucketedIndex(info.layout.feature_dim, self._make_index))

    def drop(self, namespace: str) -> None:
        """Forget a dropped namespace's index."""
        with self._lock:
            self._indexes.pop(namespace, None)
            self._positions.pop(namespace, None)
            self._created.pop(namespace, None)

    def rebuild(self) -> None:
        """Rebuild every namespace's index from the stored feature vectors (after compaction or a
        projector replacement), keeping what was added or removed while it ran."""
        with self._rebuilding, self._swapping(replace=True) as fresh:
            fresh.update({info.name: self._build(info) for info in self._store.list_namespaces()})

    @contextmanager
    def _swapping(self, *, replace: bool) -> Iterator[dict[str, BucketedIndex]]:
        """Journal the changes made while the caller fills the dict it is given, then replay them onto it
        and swap it in: every index (``replace``), or the namespaces it holds. Callers hold ``_rebuilding``."""
        with self._lock:
            self._journal = []
        fresh: dict[str, BucketedIndex] = {}
        try:
            yield fresh
        except BaseException:
            with self._lock:
                self._journal = None
            raise
        with self._lock:
            journal, self._journal = self._journal or [], None
            for change in journal:
                change(fresh)
            if replace:
                self._indexes = fresh
            else:
                self._indexes.update(fresh)

    def _record(self, change: _Change) -> None:
        # Callers hold the lock and have applied ``change`` to the live indexes already.
        if self._journal is not None:
            self._journal.append(change)

    def add(self, namespace: str, ids: Sequence[int], features: np.ndarray, lengths: Sequence[int]) -> None:
        """Index entries just stored: ``features`` ``(n, feature_dim)``, one id and length per row."""
        if not len(ids):
            return
        rows = (np.asarray(ids, dtype=np.uint64), np.asarray(features, dtype=np.float32),
                np.asarray(lengths, dtype=np.int64))

        def replay(indexes: Mapping[str, BucketedIndex]) -> None:
            if namespace in indexes:
                indexes[namespace].remove(rows[0])  # the rebuild may have read these rows already
                indexes[namespace].add(*rows)

        with self._lock:
            self._upsert(self._index(namespace), *rows)
            self._record(replay)

    def _upsert(self, index: BucketedIndex, ids: np.ndarray, features: np.ndarray, lengths: np.ndarray) -> None:
        # Callers hold the lock. With a feed, the log may have brought these rows in already.
        if self._feed is not None:
            index.remove(ids)
        index.add(ids, features, lengths)

    def follow(self) -> int:
        """Apply what the store's change feed logged since the last call; returns the changes applied.

        New namespaces get an index, dropped (or dropped and made again) ones lose theirs, a
        namespace whose position the log no longer holds is rebuilt, and a store replaced under this
        process (its identity changed) has every index rebuilt. Does nothing without a feed.

        Raises:
            UnavailableError: the store cannot be reached (the next call catches up).
        """
        if self._feed is None:
            return 0
        with self._rebuilding:
            return self._follow(self._feed)

    def _follow(self, feed: ChangeFeed) -> int:
        identity = feed.store_identity()
        if identity != self._identity:
            self._reset(feed, identity)
            return 0
        version = feed.catalog_version()
        if version != self._catalog_version:
            current = {info.name: info for info in self._store.list_namespaces()}
            with self._swapping(replace=False) as fresh:
                fresh.update({name: self._build(info) for name, info in current.items()
                              if self._created.get(name) != info.created})
            with self._lock:
                for name in [n for n in self._indexes if n not in current]:
                    del self._indexes[name]
            self._catalog_version = version
        applied = 0
        for name in list(self._indexes):
            position = self._positions.get(name)
            if position is None:
                continue
            batch = feed.changes(name, position)
            self.skipped_records += batch.skipped
            if batch.rebuild:
                why = "a record of the log did not decode" if batch.skipped else "the log was trimmed past this index"
                log.warning("event=index_rebuild namespace=%s detail='%s'", name, why)
                with self._swapping(replace=False) as fresh:
                    fresh[name] = self._build(self._store.get_namespace(name))
                continue
            with self._lock:
                found = self._indexes.get(name)
                if found is None:
                    continue
                index = found
                for change in batch.changes:
                    if change.reset:
                        index = self._indexes[name] = BucketedIndex(index.dim, self._make_index)
                    if change.added is not None:
                        self._upsert(index, change.added.ids, change.added.features, change.added.lengths)
                    if change.removed:
                        index.remove(np.array(change.removed, dtype=np.uint64))
                self._positions[name] = batch.position
            applied += len(batch.changes)
        return applied

    def _reset(self, feed: ChangeFeed, identity: str | None) -> None:
        """Rebuild every index of a store that was replaced: nothing of the old one's may be searched (its
        ids now name other entries), nor followed (its log positions mean nothing in the new log)."""
        log.error("event=indexes_reset identity=%s detail='the store was replaced: every index is rebuilt from it'",
                  identity)
        with self._swapping(replace=True) as fresh:
            self._positions.clear()
            self._created.clear()
            fresh.update({info.name: self._build(info) for info in self._store.list_namespaces()})
        self._catalog_version = feed.catalog_version()
        self._identity = identity
        self.resets += 1

    def remove(self, removed: Mapping[str, Iterable[int]]) -> None:
        """Take deleted or evicted entries out of their namespaces' indexes (unknown ids are ignored)."""
        gone = {namespace: np.fromiter(ids, dtype=np.uint64) for namespace, ids in removed.items()}

        def apply(indexes: Mapping[str, BucketedIndex]) -> None:
            for namespace, ids in gone.items():
                index = indexes.get(namespace)
                if index is not None:
                    index.remove(ids)

        with self._lock:
            apply(self._indexes)
            self._record(apply)

    @property
    def nbytes(self) -> int:
        """Memory every namespace's index holds (``VectorIndex.nbytes``)."""
        with self._lock:
            return sum(index.nbytes for index in self._indexes.values())

    def search(
        self, info: NamespaceInfo, features: np.ndarray, lengths: np.ndarray, *, max_distance: float
    ) -> list[Match]:
        """Each row's nearest allowed entry, a hit within ``max_distance`` (see ``BucketedIndex.search``)."""
        with self._lock:
            return self._index(info.name).search(
                features, lengths, causal=info.layout.causal, max_distance=max_distance,
                length_penalty=self._length_penalty,
            )

    def candidates(
        self, info: NamespaceInfo, features: np.ndarray, lengths: np.ndarray, *, k: int
    ) -> list[list[Candidate]]:
        """Each row's ``k`` nearest allowed entries (see ``BucketedIndex.candidates``)."""
        with self._lock:
            return self._index(info.name).candidates(
                features, lengths, causal=info.layout.causal, k=k, length_penalty=self._length_penalty
            )

    def _index(self, namespace: str) -> BucketedIndex:
        # Callers hold the lock.
        index = self._indexes.get(namespace)
        if index is None:
            # Created by another process sharing the store, or not yet seen here.
            index = self._indexes[namespace] = self._build(self._store.get_namespace(namespace))
        return index

    def _build(self, info: NamespaceInfo) -> BucketedIndex:
        index = BucketedIndex(info.layout.feature_dim, self._make_index)
        self._created[info.name] = info.created
        if self._feed is not None:
            state = self._feed.index_state(info.name)
            if len(state.rows):
                index.add(state.rows.ids, state.rows.features, state.rows.lengths)
            self._positions[info.name] = state.position
            log.info("namespace %s: indexed %d entries from the store's keys, following its log from %s",
                     info.name, len(index), state.position)
            return index
        for length in self._store.lengths(info.name):
            rows = [(e.id, e.feature) for e in self._store.entries(info.name, length) if e.feature is not None]
            if rows:
                index.add(
                    np.array([entry_id for entry_id, _ in rows], dtype=np.uint64),
                    np.stack([feature for _, feature in rows]).astype(np.float32),
                    np.full(len(rows), length, dtype=np.int64),
                )
        log.info("namespace %s: indexed %d entries in %d length buckets", info.name, len(index), len(index.lengths))
        return index
