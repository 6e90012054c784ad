"""RedisMapStore: the map store on one Redis server or a Redis Cluster, shared by any number of daemons.

Guarantees, as the LMDB backend's where callers can see them:

- **Two-phase ingest.** Each new entry's hash (record, every stored object, outputs) is
  written whole by one HSET on the entry's own shard, reachable by nothing;
  then one Lua script on the namespace's shard registers the batch in its index
  keys (exact tier, ids, features, byte counts) and appends it to its log: the
  registration is what makes entries visible, and it is all-or-nothing per call.
  A crash in between leaves unreachable hashes (compaction removes them).
- **Ids** come from a per-namespace counter on the namespace's shard and are
  never reused, also not after a drop.
- **Entries may vanish**: Redis's maxmemory policy may evict a whole entry
  hash (one key: never part of one). A read then raises EntryNotFoundError,
  and the entry is forgotten (unregistered, its removal logged) so every
  daemon's index drops it.

A process's buffered hit counts, and a DRAM cache in front (``store.dram``), are its own.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from attnstore.errors import (
    ChecksumError,
    ConfigError,
    EntryNotFoundError,
    NamespaceNotFoundError,
    ProjectorChangedError,
    ReadOnlyStoreError,
    StorageError,
    StoreUnsafeError,
)
from attnstore.protocol.records import EntryInfo, EntryRef, NamespaceInfo, NamespaceLayout, NewEntry, TokenLimits
from attnstore.store.admission import SketchShape
from attnstore.store.arrays import NamespaceState
from attnstore.store.base import MapStoreBase
from attnstore.store.dram.hit_buffer import HitBuffer, PendingHits
from attnstore.store.feed import ChangeFeed
from attnstore.store.namespace_rules import (
    check_projector_version,
    drops_features,
    outputs_only_feature_error,
    projector_update,
)
from attnstore.store.redis import admin, scripts
from attnstore.store.redis.admission import RedisCounts
from attnstore.store.redis.catalog import Catalog
from attnstore.store.redis.chunks import walks as chunk_walks
from attnstore.store.redis.chunks.calls import RedisChunks
from attnstore.store.redis.connection import RedisConnection, RedisStats, translated
from attnstore.store.redis.feed import RedisChangeFeed
from attnstore.store.redis.ingest import commit
from attnstore.store.redis.keys import StoreKeys, decode_record
from attnstore.store.redis.reads import RedisEntryReads
from attnstore.store.redis.urls import RedisLocation, RedisSettings
from attnstore.store.redis.watch import StoreWatch
from attnstore.store.reports import (
    NO_DRAM,
    ChunkCheck,
    CompactReport,
    FeaturesReport,
    IngestReport,
    StoreStats,
    VerifyReport,
    with_chunk_usage,
)
from attnstore.store.validate import PreparedEntry, prepare_entry

logger = logging.getLogger(__name__)

_COMMIT_ROUNDS = 4  # an entry found by hash, then deleted before the commit, is written anew: this many times at most


class RedisMapStore(MapStoreBase):
    """The Redis-backed map store. Open with :meth:`open`; use as a context manager."""

    def __init__(self, connection: RedisConnection, settings: RedisSettings, *, create: bool) -> None:
        super().__init__()
        self._redis = connection
        self._keys = StoreKeys(connection.location.prefix)
        self._settings = settings
        self._catalog = Catalog(connection, self._keys, create=create, log_cap=settings.log_max_events)
        self._states: dict[str, tuple[float, NamespaceState]] = {}  # name -> (its created time, state)
        self._reads = RedisEntryReads(connection, self._keys, self._state, self._pending_hits, self._forget_missing)
        self.chunks = RedisChunks(connection, self._keys, settings, self._catalog, self.get_namespace,
                                  self._check_writable, self._entry_bytes)
        self._hits = HitBuffer(settings.hit_flush_count, settings.hit_flush_seconds, write=self._write_hits,
                               readonly=settings.readonly)
        self._watch = StoreWatch(connection, self._keys, self._catalog.identity, create=create)
        self._feed = RedisChangeFeed(connection, self._keys, self._catalog, self._forget_missing,
                                     lambda namespace, ids: self._removed(namespace, list(ids)),
                                     self._check_store)
        self._counts: RedisCounts | None = None  # the admission counts handed out (their salts are cached)
        self._closed = False
        self._watch.check_policy(force=True)  # a store opened under an unsafe policy takes no write

    @classmethod
    def open(cls, url: str, *, create: bool = False, settings: RedisSettings | None = None) -> RedisMapStore:
        """Open the store at ``url`` (``redis://HOST:PORT[/?cluster=1][&prefix=NAME]``).

        Raises:
            ConfigError: a malformed URL.
            UnavailableError: Redis cannot be reached.
            StoreNotFoundError: no store under this prefix and ``create`` is False.
            FormatVersionError: the store was written in a format version this code does not read.
        """
        settings = settings or RedisSettings()
        connection = RedisConnection(RedisLocation.parse(url), failover_seconds=settings.failover_seconds)
        try:
            return cls(connection, settings, create=create)
        except BaseException:
            connection.close()
            raise

    @property
    def location(self) -> RedisLocation:
        """Where the store lives."""
        return self._redis.location

    # ---- capabilities ---------------------------------------------------------
    # Every one (and stored chunks, ``self.chunks``; no prefix blocks); the store is shared, so it has a change
    # feed and shared admission counts.

    supports_outputs_only = True
    supports_compaction = True  # forgets what Redis evicted, deletes orphan hashes
    supports_change_feed = True  # every daemon on the store follows its log
    supports_shared_admission = True  # every daemon on the store counts in it

    @property
    def supports_writes(self) -> bool:
        """See :attr:`MapStoreBase.supports_writes`: unless opened read-only."""
        return not self._settings.readonly

    def _state(self, name: str) -> NamespaceState:
        info = self._catalog.get(name)
        cached = self._states.get(name)
        if cached is None or cached[0] != info.created:  # a namespace dropped and made again has a new layout
            cached = self._states[name] = (info.created, NamespaceState.of(info))
        return cached[1]

    def _check_writable(self) -> None:
        if self._settings.readonly:
            raise ReadOnlyStoreError(f"map store {self.location.display} is open read-only")
        # Before every write, not only at the follower's next step: a write into a store replaced meanwhile
        # must not meet this process's caches of the old one (ids restart with the store).
        if self._watch.check_identity():
            self._forget_cached()
        problem = self._watch.problem()
        if problem is not None:
            raise StoreUnsafeError(f"map store {self.location.display}: {problem}")

    def _check_store(self) -> str | None:
        """The store's identity, read again (and the policy, every few steps); its caches go when it changed."""
        if self._watch.check_identity():
            self._forget_cached()
        self._watch.check_policy()
        return self._watch.identity

    def _forget_cached(self) -> None:
        """Drop everything cached of a store that was replaced: unflushed hits, records, salts (and, through
        ``on_removed``, a DRAM cache's decoded maps)."""
        self._hits.drain()
        self._removed(None, None)
        self._catalog.forget_all()
        self._states.clear()
        if self._counts is not None:
            self._counts.forget()

    def serving_problem(self) -> str | None:
        """See :meth:`MapStoreBase.serving_problem`: the store's marker gone, or an unsafe eviction policy."""
        return self._watch.problem()

    def change_feed(self) -> ChangeFeed:
        """See :meth:`MapStoreBase.change_feed`: every daemon on this store follows it."""
        return self._feed

    def admission_counts(self, shape: SketchShape) -> RedisCounts:
        """See :meth:`MapStoreBase.admission_counts`: every daemon on this store counts in it."""
        self._counts = RedisCounts(self._redis, self._keys, shape)
        return self._counts

    # ---- namespaces -----------------------------------------------------------

    def _create_namespace(
        self, name: str, *, model: str, fingerprint: str, layout: NamespaceLayout, limits: TokenLimits | None
    ) -> NamespaceInfo:
        """See :meth:`MapStoreBase.create_namespace`; also raises ReadOnlyStoreError."""
        self._check_writable()
        return self._catalog.create(name, model=model, fingerprint=fingerprint, layout=layout, limits=limits)

    def get_namespace(self, name: str) -> NamespaceInfo:
        """See :meth:`MapStoreBase.get_namespace`."""
        return self._catalog.get(name)

    def list_namespaces(self) -> list[NamespaceInfo]:
        """See :meth:`MapStoreBase.list_namespaces`."""
        return self._catalog.namespaces()

    def drop_namespace(self, name: str) -> None:
        """See :meth:`MapStoreBase.drop_namespace`: its name and keys go at once (so do its entries for every
        reader), then its entry hashes."""
        self._check_writable()
        self._catalog.get(name)
        keys = self._keys.namespace(name)
        self._catalog.unlist(name)
        chunk_walks.drop(self._redis, self._keys, name)
        with translated(f"dropping namespace {name!r}"):
            self._redis.client.delete(*keys.all_keys())  # one slot: one atomic command
        self._catalog.forget(name)
        stored = [self._keys.entry(name, i) for i in admin.entry_ids_stored(self._redis, self._keys, name)]
        admin.delete_keys(self._redis, stored)
        self._states.pop(name, None)
        self._hits.drop_namespace(name)
        self._removed(name, None)
        logger.info("dropped namespace %r", name)

    def _set_projector(self, name: str, blob: bytes, *, replace: bool) -> NamespaceInfo:
        """See :meth:`MapStoreBase.set_projector`: decided on the record read, stored only if it is still that."""
        self._check_writable()
        for _ in range(10):
            raw = self._catalog.raw_info(name, fresh=True)
            if raw is None:
                break
            info = self._catalog.get(name)  # the record just read, with its projector
            update = projector_update(info, blob, replace=replace)
            if update is None:
                return info
            if self._catalog.set_projector(name, raw, update, drop_features=drops_features(info, blob)):
                return update
        else:
            raise StorageError(f"the projector of {name!r} kept changing under this call: try again")
        raise NamespaceNotFoundError(f"no namespace {name!r} in the store at {self.location.display}")

    # ---- ingest ---------------------------------------------------------------

    def ingest(
        self, namespace: str, entries: Iterable[NewEntry], *, projector_version: int | None = None
    ) -> IngestReport:
        """See :meth:`MapStoreBase.ingest`; also raises ReadOnlyStoreError, and UnavailableError while
        Redis is unreachable (nothing is registered then; hashes already written are compaction's)."""
        self._check_writable()
        state = self._state(namespace)
        prepared = [prepare_entry(entry, state.layout, i) for i, entry in enumerate(entries)]
        check_projector_version(self._catalog.get(namespace), projector_version)  # before any id is taken
        if not prepared:
            return IngestReport([], [])
        unique: dict[bytes, PreparedEntry] = {}
        for p in prepared:
            unique.setdefault(p.token_hash, p)
        hashes = list(unique)
        found = {h: ref.id for h, ref in zip(hashes, self._reads.find_by_hashes(namespace, hashes), strict=True) if ref}
        vanished = set(self._forget_missing(namespace, list(found.values())))
        existing = {h: i for h, i in found.items() if i not in vanished}
        mapped = self._with_maps(namespace, state, [i for h, i in existing.items() if unique[h].feature is not None])
        outcome: dict[bytes, tuple[str, int]] = {}
        pending = list(unique.values())
        for _ in range(_COMMIT_ROUNDS):
            results = commit(self._redis, self._keys, self._settings, namespace, state, pending, existing,
                             projector_version, mapped)
            outcome.update({h: r for h, r in results.items() if r[0] != "m"})
            pending = [unique[h] for h, r in results.items() if r[0] == "m"]
            existing = {}
            if not pending:
                break
        else:
            raise StorageError(f"entries of {namespace!r} kept vanishing while they were ingested: try again")
        added, featured, seen = [], [], set()
        for p in prepared:
            status, entry_id = outcome[p.token_hash]
            if entry_id not in seen:
                seen.add(entry_id)
                if status == "a":
                    added.append(entry_id)
                elif status == "f":
                    featured.append(entry_id)
        evicted = self._evict_over_cap(namespace, added) if self._settings.max_bytes is not None else {}
        return IngestReport([outcome[p.token_hash][1] for p in prepared], added, evicted, featured)

    def _set_features(
        self, namespace: str, entry_ids: list[int], features: np.ndarray, projector_version: int
    ) -> FeaturesReport:
        """See :meth:`MapStoreBase.set_features`: the records are checked for maps first (an entry's maps
        never change), then one script checks the version and sets the vectors; also raises ReadOnlyStoreError."""
        self._check_writable()
        state = self._state(namespace)
        raws = admin.records(self._redis, self._keys, namespace, entry_ids)
        for entry_id, raw in zip(entry_ids, raws, strict=True):
            try:
                record = decode_record(state, entry_id, raw)
            except (EntryNotFoundError, ChecksumError):
                continue  # gone or corrupt: the script reports it missing or sets a vector that is never served
            if not record.crcs:
                raise outputs_only_feature_error(namespace, entry_id)
        args: list[bytes | str | int | float] = [self._settings.log_max_events, projector_version]
        for entry_id, row in zip(entry_ids, features, strict=True):
            args += [entry_id, row.astype("<f4").tobytes()]
        with translated(f"setting feature vectors in {namespace!r}"):
            result = self._redis.eval(scripts.SET_FEATURES, self._keys.namespace(namespace).index_keys(), args)
        status = bytes(result[0]).decode()
        if status == "gone":
            raise NamespaceNotFoundError(f"namespace {namespace!r} was dropped during the call")
        if status != "ok":
            raise ProjectorChangedError(
                f"namespace {namespace!r} has projector version {status.split()[1]}; the feature vectors were"
                f" projected with version {projector_version}: fetch the namespace again (its projector) and re-project"
            )
        lengths = [bytes(raw).decode() for raw in result[1:]]
        updated = [(i, int(n)) for i, n in zip(entry_ids, lengths, strict=True) if n]
        return FeaturesReport([i for i, _ in updated], [n for _, n in updated],
                              [i for i, n in zip(entry_ids, lengths, strict=True) if not n])

    def _with_maps(self, namespace: str, state: NamespaceState, ids: list[int]) -> frozenset[int]:
        """Those of ``ids`` stored with maps (not outputs-only), which may take a duplicate's feature."""
        raws = admin.records(self._redis, self._keys, namespace, ids) if ids else []
        mapped = set()
        for entry_id, raw in zip(ids, raws, strict=True):
            try:
                if decode_record(state, entry_id, raw).crcs:
                    mapped.add(entry_id)
            except (EntryNotFoundError, ChecksumError):
                continue  # gone meanwhile, or corrupt: it takes no feature
        return frozenset(mapped)

    def _evict_over_cap(self, namespace: str, protect: list[int]) -> dict[str, list[int]]:
        self.flush_hits()  # recency must include the hits buffered here
        max_bytes = self._settings.max_bytes
        assert max_bytes is not None
        victims, chunk_victims = admin.eviction_victims(
            self._redis, self._keys, self._catalog.names(), max_bytes, self._settings.evict_low_water,
            {(namespace, i) for i in protect},
        )
        for name, keys in chunk_victims.items():
            chunk_walks.delete(self._redis, self._keys, name, keys)
        evicted: dict[str, list[int]] = {}
        for name, ids in victims.items():
            gone = self._remove(name, ids, "evict")
            if gone:
                evicted[name] = gone
        if evicted:
            logger.warning("map store %s over its cap of %s bytes: evicted %s least recently hit entries",
                           self.location.display, max_bytes, sum(len(v) for v in evicted.values()))
        return evicted

    def _entry_bytes(self) -> int:
        return admin.entry_bytes(self._redis, self._keys, self._catalog.names())

    # ---- entry reads (``reads.RedisEntryReads``) ---------------------------------

    def read_maps(self, namespace: str, entry_id: int) -> np.ndarray:
        """See :meth:`MapStoreBase.read_maps`: the whole entry in one read."""
        return self._reads.read_maps(namespace, entry_id)

    def _read_layer(self, namespace: str, entry_id: int, layer: int) -> np.ndarray:
        """See :meth:`MapStoreBase.read_layer`: only that layer's fields are read."""
        return self._reads.read_layer(namespace, entry_id, layer)

    def read_outputs(self, namespace: str, entry_id: int) -> np.ndarray | None:
        """See :meth:`MapStoreBase.read_outputs`."""
        return self._reads.read_outputs(namespace, entry_id)

    def _find_by_hashes(self, namespace: str, token_hashes: list[bytes]) -> list[EntryRef | None]:
        return self._reads.find_by_hashes(namespace, token_hashes)

    def entry(self, namespace: str, entry_id: int) -> EntryInfo:
        """See :meth:`MapStoreBase.entry`."""
        return self._reads.entry(namespace, entry_id)

    def token_ids(self, namespace: str, entry_ids: Sequence[int]) -> list[np.ndarray | None]:
        """See :meth:`MapStoreBase.token_ids`."""
        return self._reads.token_ids(namespace, entry_ids)

    def entries(self, namespace: str, length: int | None = None) -> Iterator[EntryInfo]:
        """See :meth:`MapStoreBase.entries`: entries gone or corrupt are skipped (verify lists corrupt ones).

        Raises:
            NamespaceNotFoundError: at the call, not at the first ``next``.
        """
        return self._reads.entries(namespace, length)

    def lengths(self, namespace: str) -> list[int]:
        """See :meth:`MapStoreBase.lengths`."""
        return self._reads.lengths(namespace)

    # ---- hits, delete ---------------------------------------------------------

    def record_hits(self, namespace: str, ids: Iterable[int]) -> None:
        """See :meth:`MapStoreBase.record_hits`: buffered (see ``HitBuffer.record``)."""
        self._state(namespace)
        self._hits.record(namespace, ids)

    def flush_hits(self) -> None:
        """Write buffered hit counts now (see ``HitBuffer.flush``)."""
        self._hits.flush()

    def _pending_hits(self, namespace: str, entry_id: int) -> tuple[int, float]:
        """Hits counted here and not yet written, and the last one's time (for ``RedisEntryReads``)."""
        return self._hits.get(namespace, entry_id)

    def _write_hits(self, pending: PendingHits) -> None:
        """Buffered hit counts, one script per namespace."""
        by_namespace: dict[str, list[bytes | str | int | float]] = {}
        for (name, entry_id), (hits, last) in pending.items():
            by_namespace.setdefault(name, []).extend([entry_id, hits, repr(last)])
        for name, args in by_namespace.items():
            keys = self._keys.namespace(name)
            with translated(f"writing hit counts of {name!r}"):
                self._redis.eval(scripts.HITS, [keys.ids, keys.recency, keys.hits], args)

    def _remove(self, namespace: str, ids: Sequence[int], reason: str) -> list[int]:
        """Unregister ``ids`` (logging their removal), then delete their hashes; returns those that were there."""
        keys = self._keys.namespace(namespace)
        with translated(f"removing entries of {namespace!r}"):
            removed = [int(i) for i in self._redis.eval(
                scripts.REMOVE, keys.index_keys(), [self._settings.log_max_events, reason, *ids]
            )]
        admin.delete_keys(self._redis, [self._keys.entry(namespace, i) for i in removed])
        self._hits.drop(namespace, ids)
        self._removed(namespace, ids)
        return removed

    def _delete(self, namespace: str, ids: list[int]) -> int:
        """See :meth:`MapStoreBase.delete`; also raises ReadOnlyStoreError."""
        self._check_writable()
        self._state(namespace)
        return len(self._remove(namespace, ids, "delete")) if ids else 0

    def _forget_missing(self, namespace: str, ids: Sequence[int], *, known_gone: bool = False) -> list[int]:
        """The ids among ``ids`` whose hash Redis no longer holds, unregistered (see ``ChangeFeed.missing``)."""
        if not ids:
            return []
        gone = list(ids)
        if not known_gone:
            with translated(f"checking entries of {namespace!r}"):
                pipe = self._redis.client.pipeline(transaction=False)
                for entry_id in ids:
                    pipe.exists(self._keys.entry(namespace, entry_id))
                gone = [entry_id for entry_id, there in zip(ids, pipe.execute(), strict=True) if not there]
        if gone and not self._settings.readonly:
            forgotten = self._remove(namespace, gone, "vanished")
            if forgotten:
                logger.warning("event=entries_vanished namespace=%s ids=%s detail='evicted by Redis; forgotten'",
                               namespace, forgotten[:20])
        return gone

    def live_ids(self, namespace: str, ids: Sequence[int]) -> list[int]:
        """See :meth:`MapStoreBase.live_ids`: one HMGET."""
        self._state(namespace)
        with translated(f"checking entries of {namespace!r}"):
            metas = self._redis.client.hmget(self._keys.namespace(namespace).meta, [str(i) for i in ids])
        return [i for i, meta in zip(ids, metas, strict=True) if meta is not None]

    # ---- admin ----------------------------------------------------------------

    def compact(self) -> CompactReport:
        """Forget entries Redis evicted and delete unregistered hashes (see ``admin.compact``); ids are kept.

        Raises:
            ReadOnlyStoreError: the store is read-only.
        """
        self._check_writable()
        self.flush_hits()
        return admin.compact(self._redis, self._keys, self.list_namespaces(), self._forget_missing,
                             self._settings.orphan_grace_seconds)

    def verify(self) -> VerifyReport:
        """See :meth:`MapStoreBase.verify`. Entries Redis evicted are forgotten, not reported corrupt."""
        states = {info.name: self._state(info.name) for info in self.list_namespaces()}
        report = admin.verify(self._redis, self._keys, states, self._forget_missing)
        checked, corrupt = chunk_walks.findings(self._redis, self._keys, sorted(states))
        report = dataclasses.replace(report, chunks=ChunkCheck(checked, tuple(corrupt)))
        if not report.ok:
            logger.warning("verify of %s found %s corrupt entries", self.location.display, len(report.corrupt))
        return report

    def redis_stats(self) -> RedisStats:
        """See :meth:`MapStoreBase.redis_stats`: one ``INFO memory`` per primary (a scrape's cost)."""
        return RedisStats(retries=self._redis.retry_totals(), nodes=tuple(self._redis.node_memory()),
                          resets=self._watch.resets, unsafe=self._watch.problem() is not None)

    def stats(self) -> StoreStats:
        """See :meth:`MapStoreBase.stats`: ``file_bytes`` is Redis's used memory and ``map_size`` its
        maxmemory, summed over the primaries; evictions include entries Redis evicted that were found gone."""
        namespaces = self.list_namespaces()
        stats = admin.store_stats(self._redis, self._keys, namespaces, self._settings.max_bytes,
                                  pending_hits=len(self._hits), dram=NO_DRAM)
        return with_chunk_usage(stats, chunk_walks.usage(self._redis, self._keys, [n.name for n in namespaces]))

    def close(self) -> None:
        """See :meth:`MapStoreBase.close`."""
        if self._closed:
            return
        self._closed = True
        if not self._settings.readonly:
            try:
                self.flush_hits()
            except Exception as exc:  # closing must finish: the counts are only statistics
                logger.warning("map store %s: buffered hit counts lost on close: %s", self.location.display, exc)
        self._redis.close()


def open_redis_store(
    url: str, *, create: bool = False, max_bytes: int | None = None, map_size: int | None = None,
    readonly: bool = False,
) -> RedisMapStore:
    """Open the Redis store at ``url`` with the daemon's sizes (``map_size`` is LMDB's: refused here).

    Raises:
        ConfigError: a malformed URL, or ``map_size`` given.
        UnavailableError: Redis cannot be reached.
        StoreNotFoundError: no store under the URL's prefix and ``create`` is False.
    """
    if map_size is not None:
        raise ConfigError(f"--map-size sizes an LMDB store; {url!r} is a Redis store (size it with Redis's maxmemory)")
    settings = RedisSettings(max_bytes=max_bytes, readonly=readonly)
    return RedisMapStore.open(url, create=create, settings=settings)
