"""RedisMapStore: the map store on one Redis server or a Redis Cluster, shared by any number of daemons.

Guarantees, as the LMDB backend's where callers can see them:

- **Two-phase ingest.** An entry's hash (record, chunks, outputs) is written
  first and is reachable by nothing; one Lua script on the namespace's shard
  then registers the batch in its index keys and appends it to its log. A
  crash in between leaves unreachable hashes (compaction removes them). A call
  is all-or-nothing: every entry it adds is registered by that one script.
- **Ids** come from a per-namespace counter on the namespace's shard (the same
  shard, hence the same replication stream, as the index: a failover that
  loses an id allocation also loses every registration after it) and are never
  reused, also not after a drop.
- **Entries may vanish**: Redis's maxmemory policy may evict a whole entry
  hash (one key: never part of one). A read then raises EntryNotFoundError,
  and the entry is forgotten (unregistered, its removal logged) so every
  daemon's index drops it.

A process's DRAM tier and hit counts are its own; hit counts are flushed into
the namespace's keys like the LMDB backend's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from attnstore.errors import (
    ChecksumError,
    EntryNotFoundError,
    MapShapeError,
    ReadOnlyStoreError,
)
from attnstore.protocol.records import EntryInfo, EntryRef, NamespaceInfo, NamespaceLayout, NewEntry
from attnstore.store.arrays import NamespaceState
from attnstore.store.base import MapStoreBase
from attnstore.store.feed import ChangeFeed
from attnstore.store.hit_buffer import HitBuffer
from attnstore.store.hot_maps import HotMaps
from attnstore.store.lmdb.records import EntryRecord
from attnstore.store.redis import admin, scripts
from attnstore.store.redis.catalog import Catalog
from attnstore.store.redis.connection import RedisConnection, RedisLocation, translated
from attnstore.store.redis.entries import decode_layers, decode_outputs, decode_record, encode_entry, layer_fields
from attnstore.store.redis.feed import RedisChangeFeed
from attnstore.store.redis.keys import OUTPUTS_FIELD, RECORD_FIELD, StoreKeys
from attnstore.store.redis.log import NamespaceLog
from attnstore.store.redis.settings import RedisSettings
from attnstore.store.reports import CompactReport, IngestReport, StoreStats, VerifyReport
from attnstore.store.validate import PreparedEntry, prepare_entry

logger = logging.getLogger(__name__)

_PAGE = 256  # entries per read when listing


def _ref(raw: bytes | None) -> EntryRef | None:
    if raw is None:
        return None
    entry_id, length = bytes(raw).split(b" ")
    return EntryRef(int(entry_id), int(length))


class RedisMapStore(MapStoreBase):
    """The Redis-backed map store. Open with :meth:`open`; use as a context manager."""

    def __init__(self, connection: RedisConnection, settings: RedisSettings, *, create: bool) -> None:
        self._redis = connection
        self._keys = StoreKeys(connection.location.prefix)
        self._settings = settings
        self._catalog = Catalog(connection, self._keys, create=create)
        self._states: dict[str, tuple[float, NamespaceState]] = {}  # name -> (its created time, state)
        self._hits = HitBuffer(settings.hit_flush_count, settings.hit_flush_seconds)
        self._hot = HotMaps(self._load_maps, capacity_bytes=settings.dram_bytes, prefetch_queue=settings.prefetch_queue)
        self._log = NamespaceLog(connection, self._keys, settings, self._state, self._hot.discard)
        self._feed = RedisChangeFeed(self._log, self._catalog, self._forget_missing)
        self._closed = False
        admin.warn_about_eviction_policy(connection)

    @classmethod
    def open(cls, url: str, *, create: bool = False, settings: RedisSettings = RedisSettings()) -> RedisMapStore:
        """Open the store at ``url`` (``redis://HOST:PORT[/?cluster=1][&prefix=NAME]``).

        Raises:
            ConfigError: a malformed URL.
            UnavailableError: Redis cannot be reached.
            StoreNotFoundError: no store under this prefix and ``create`` is False.
            FormatVersionError: the store was written in a format version this code does not read.
        """
        return cls(RedisConnection(RedisLocation.parse(url)), settings, create=create)

    # ------------------------------------------------------------------ plumbing

    @property
    def location(self) -> RedisLocation:
        """Where the store lives."""
        return self._redis.location

    def _state(self, name: str) -> NamespaceState:
        info = self._catalog.get(name)
        cached = self._states.get(name)
        if cached is None or cached[0] != info.created:  # a namespace dropped and made again has a new layout
            cached = self._states[name] = (info.created, NamespaceState.of(info))
        return cached[1]

    def _check_writable(self) -> None:
        if self._settings.readonly:
            raise ReadOnlyStoreError(f"map store {self.location.display} is open read-only")

    def change_feed(self) -> ChangeFeed:
        """See :meth:`MapStoreBase.change_feed`: every daemon on this store follows it."""
        return self._feed

    # ---------------------------------------------------------------- namespaces

    def _create_namespace(self, name: str, *, model: str, fingerprint: str, layout: NamespaceLayout) -> NamespaceInfo:
        """See :meth:`MapStoreBase.create_namespace`; also raises ReadOnlyStoreError."""
        self._check_writable()
        return self._catalog.create(name, model=model, fingerprint=fingerprint, layout=layout)

    def get_namespace(self, name: str) -> NamespaceInfo:
        """See :meth:`MapStoreBase.get_namespace`."""
        return self._catalog.get(name)

    def list_namespaces(self) -> list[NamespaceInfo]:
        """See :meth:`MapStoreBase.list_namespaces`."""
        return list(self._catalog.namespaces().values())

    def drop_namespace(self, name: str) -> None:
        """See :meth:`MapStoreBase.drop_namespace`: its index keys go at once (so do its entries for every
        reader), then the catalog record, then the entry hashes."""
        self._check_writable()
        self._catalog.get(name)
        keys = self._keys.namespace(name)
        ids = [entry_id for page in self._id_pages(name) for entry_id in page]
        with translated(f"dropping namespace {name!r}"):
            self._redis.client.delete(*keys.all_keys())
        self._catalog.drop(name)
        admin.delete_entry_keys(self._redis, self._keys, name, ids, orphans=True)
        self._states.pop(name, None)
        self._hot.clear()  # rare admin work: simpler than tracking the namespace's keys
        self._hits.drop_namespace(name)
        logger.info("dropped namespace %r", name)

    def _set_projector(self, name: str, blob: bytes) -> None:
        """See :meth:`MapStoreBase.set_projector`."""
        self._check_writable()
        self._catalog.set_projector(name, blob)

    # -------------------------------------------------------------------- ingest

    def ingest(self, namespace: str, entries: Iterable[NewEntry]) -> IngestReport:
        """See :meth:`MapStoreBase.ingest`; also raises ReadOnlyStoreError, and UnavailableError while
        Redis is unreachable (nothing is registered then; hashes already written are compaction's)."""
        self._check_writable()
        state = self._state(namespace)
        prepared = [prepare_entry(entry, state.layout, i) for i, entry in enumerate(entries)]
        if not prepared:
            return IngestReport([], [])
        ids_by_hash = self._stored_ids(namespace, {p.token_hash for p in prepared})
        new: dict[bytes, PreparedEntry] = {}
        for p in prepared:
            if p.token_hash not in ids_by_hash:
                new.setdefault(p.token_hash, p)
        added: list[int] = []
        if new:
            committed = self._write_and_register(namespace, state, list(new.values()))
            ids_by_hash.update(committed)
            added = [entry_id for entry_id, won in committed.values() if won]
        evicted = self._evict_over_cap(namespace, added) if self._settings.max_bytes is not None else {}
        entry_ids = [ids_by_hash[p.token_hash][0] for p in prepared]
        logger.debug("ingested %s entries into %r (%s new)", len(entry_ids), namespace, len(added))
        return IngestReport(entry_ids, added, evicted)

    def _stored_ids(self, namespace: str, token_hashes: set[bytes]) -> dict[bytes, tuple[int, bool]]:
        """The live entry of each stored token hash, as ``(id, False)``; entries Redis evicted are forgotten."""
        hashes = list(token_hashes)
        refs = self._find_by_hashes(namespace, hashes)
        found = {h: ref.id for h, ref in zip(hashes, refs, strict=True) if ref is not None}
        gone = set(self._forget_missing(namespace, list(found.values()))) if found else set()
        return {h: (entry_id, False) for h, entry_id in found.items() if entry_id not in gone}

    def _write_and_register(
        self, namespace: str, state: NamespaceState, entries: list[PreparedEntry]
    ) -> dict[bytes, tuple[int, bool]]:
        """Write the entries' hashes, then register them in one script; token hash -> (id, added by this call)."""
        keys = self._keys.namespace(namespace)
        now = time.time()
        with translated(f"allocating entry ids in {namespace!r}"):
            last = int(self._redis.client.incrby(keys.next_id, len(entries)))
        ids = range(last - len(entries) + 1, last + 1)
        entry_keys = [self._keys.entry(namespace, entry_id) for entry_id in ids]
        args: list[bytes | str | int | float] = [repr(now), len(entries)]
        try:
            with translated(f"writing entries into {namespace!r}"):
                pipe = self._redis.client.pipeline(transaction=False)
                for key, entry_id, entry in zip(entry_keys, ids, entries, strict=True):
                    record, fields = encode_entry(state, entry, entry_id, now)
                    # A failover may have lost the registration of an earlier hash with this id: replace it whole.
                    pipe.delete(key)
                    pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
                    pipe.expire(key, self._settings.entry_ttl_seconds)
                    raw = state.layout.map_nbytes(entry.length)
                    if entry.outputs is not None:
                        raw += state.layout.outputs_nbytes(entry.length)
                    feature = b"" if entry.feature is None else entry.feature.astype("<f4").tobytes()
                    args += [entry.token_hash, f"{entry_id} {entry.length}", entry_id, entry.length,
                             record.nbytes, raw, feature]
                pipe.execute()
        except BaseException:
            admin.delete_keys_quietly(self._redis, entry_keys)
            raise
        with translated(f"registering entries in {namespace!r}"):
            # If this raises, whether the script ran is unknown: the hashes stay (compaction's to remove).
            results = self._redis.eval(scripts.COMMIT, keys.index_keys(), args)
        outcome: dict[bytes, tuple[int, bool]] = {}
        lost = []
        for key, entry_id, entry, result in zip(entry_keys, ids, entries, results, strict=True):
            ref = _ref(result or None)
            if ref is None:
                outcome[entry.token_hash] = (entry_id, True)
            else:  # another call registered the same tokens first
                outcome[entry.token_hash] = (ref.id, False)
                lost.append(key)
        if lost:
            admin.delete_keys_quietly(self._redis, lost)
        return outcome

    def _evict_over_cap(self, namespace: str, protect: list[int]) -> dict[str, list[int]]:
        self.flush_hits()  # recency must include the hits buffered here
        max_bytes = self._settings.max_bytes
        assert max_bytes is not None
        victims = admin.eviction_victims(
            self._redis, self._keys, [info.name for info in self.list_namespaces()], max_bytes,
            self._settings.evict_low_water, {(namespace, i) for i in protect},
        )
        evicted: dict[str, list[int]] = {}
        for name, ids in victims.items():
            gone = self._remove(name, ids, "evict")
            if gone:
                evicted[name] = gone
        if evicted:
            logger.warning("map store %s over its cap of %s bytes: evicted %s least recently hit entries",
                           self.location.display, max_bytes, sum(len(v) for v in evicted.values()))
        return evicted

    # --------------------------------------------------------------------- reads

    def _fields(self, namespace: str, entry_id: int, fields: Sequence[bytes] | None = None) -> dict[bytes, bytes]:
        """Fields of one entry's hash (all when ``fields`` is None); an empty dict if it is gone."""
        key = self._keys.entry(namespace, entry_id)
        with translated(f"reading entry {entry_id} of {namespace!r}"):
            if fields is None:
                return dict(self._redis.client.hgetall(key))
            values = self._redis.client.hmget(key, list(fields))
        return {f: v for f, v in zip(fields, values, strict=True) if v is not None}

    def _record(self, namespace: str, state: NamespaceState, entry_id: int, fields: dict[bytes, bytes]) -> EntryRecord:
        raw = fields.get(RECORD_FIELD)
        if raw is None:
            self._forget_missing(namespace, [entry_id], known_gone=True)
        return decode_record(state, entry_id, raw)

    def _load_maps(self, namespace: str, entry_id: int) -> np.ndarray:
        state = self._state(namespace)
        fields = self._fields(namespace, entry_id)  # the whole entry in one read
        record = self._record(namespace, state, entry_id, fields)
        out = np.empty(state.layout.map_shape(record.length), dtype=np.float16)  # (layers, heads, L, L)
        decode_layers(state, record, fields, range(state.layout.layers), out)
        return out

    def read_maps(self, namespace: str, entry_id: int, *, cache: bool = True) -> np.ndarray:
        """See :meth:`MapStoreBase.read_maps` (``cache``: admit the entry into the DRAM tier)."""
        return self._hot.maps(namespace, entry_id, cache=cache)  # (layers, heads, L, L)

    def read_layer(self, namespace: str, entry_id: int, layer: int) -> np.ndarray:
        """See :meth:`MapStoreBase.read_layer`. With a DRAM tier the first layer read loads and admits the
        whole entry (one round trip), so its other layers come from DRAM."""
        state = self._state(namespace)
        if not 0 <= layer < state.layout.layers:
            raise MapShapeError(
                f"layer {layer} is out of range: namespace {namespace!r} has {state.layout.layers} layers"
            )

        def load_layer() -> np.ndarray:
            if self._settings.dram_bytes:
                return self._hot.maps(namespace, entry_id)[layer].copy()
            fields = self._fields(namespace, entry_id, [RECORD_FIELD, *layer_fields(state, layer)])
            record = self._record(namespace, state, entry_id, fields)
            out = np.empty((1, state.layout.heads, record.length, record.length), dtype=np.float16)
            decode_layers(state, record, fields, [layer], out)
            return out[0]

        return self._hot.layer(namespace, entry_id, layer, load_layer)  # (heads, L, L)

    def read_outputs(self, namespace: str, entry_id: int) -> np.ndarray | None:
        """See :meth:`MapStoreBase.read_outputs`."""
        state = self._state(namespace)
        fields = self._fields(namespace, entry_id, [RECORD_FIELD, OUTPUTS_FIELD])
        record = self._record(namespace, state, entry_id, fields)
        return decode_outputs(state, record, fields.get(OUTPUTS_FIELD))  # (L, hidden)

    def _find_by_hashes(self, namespace: str, token_hashes: list[bytes]) -> list[EntryRef | None]:
        """See :meth:`MapStoreBase.find_by_hashes`. An entry Redis evicted is found here; reading it
        raises EntryNotFoundError (the exact tier then misses) and forgets it."""
        self._state(namespace)
        if not token_hashes:
            return []
        with translated(f"looking up token hashes in {namespace!r}"):
            raws = self._redis.client.hmget(self._keys.namespace(namespace).hashes, token_hashes)
        return [_ref(raw) for raw in raws]

    def _records(self, namespace: str, ids: Sequence[int]) -> list[bytes | None]:
        with translated(f"reading entries of {namespace!r}"):
            pipe = self._redis.client.pipeline(transaction=False)
            for entry_id in ids:
                pipe.hget(self._keys.entry(namespace, entry_id), RECORD_FIELD)
            return list(pipe.execute()) if ids else []

    def _hit_counts(self, namespace: str, ids: Sequence[int]) -> list[tuple[int, float]]:
        if not ids:
            return []
        fields = [f for entry_id in ids for f in (str(entry_id), f"{entry_id}:t")]
        with translated(f"reading hit counts of {namespace!r}"):
            values = self._redis.client.hmget(self._keys.namespace(namespace).hits, fields)
        counts = []
        for i, entry_id in enumerate(ids):
            pending, pending_last = self._hits.get(namespace, entry_id)  # counted here, not yet flushed
            hits, last = values[2 * i], values[2 * i + 1]
            counts.append((int(hits or 0) + pending, max(float(last or 0.0), pending_last)))
        return counts

    def entry(self, namespace: str, entry_id: int) -> EntryInfo:
        """See :meth:`MapStoreBase.entry`."""
        state = self._state(namespace)
        record = self._record(namespace, state, entry_id, self._fields(namespace, entry_id, [RECORD_FIELD]))
        ((hits, last),) = self._hit_counts(namespace, [entry_id])
        return record.info(hits, last)

    def token_ids(self, namespace: str, entry_ids: Sequence[int]) -> list[np.ndarray | None]:
        """See :meth:`MapStoreBase.token_ids`."""
        state = self._state(namespace)
        found: list[np.ndarray | None] = []
        for entry_id, raw in zip(entry_ids, self._records(namespace, entry_ids), strict=True):
            try:
                found.append(decode_record(state, entry_id, raw).token_ids)
            except (EntryNotFoundError, ChecksumError):
                found.append(None)  # gone meanwhile, or corrupt (verify reports it)
        return found

    def entries(self, namespace: str, length: int | None = None) -> Iterator[EntryInfo]:
        """See :meth:`MapStoreBase.entries`. Entries gone or corrupt are skipped (verify lists corrupt ones).

        Raises:
            NamespaceNotFoundError: at the call, not at the first ``next``.
        """
        state = self._state(namespace)
        return self._iter_entries(namespace, state, length)

    def _iter_entries(self, namespace: str, state: NamespaceState, length: int | None) -> Iterator[EntryInfo]:
        for page in self._id_pages(namespace):
            records = []
            for entry_id, raw in zip(page, self._records(namespace, page), strict=True):
                try:
                    record = decode_record(state, entry_id, raw)
                except (EntryNotFoundError, ChecksumError):
                    continue
                if length is None or record.length == length:
                    records.append(record)
            counts = self._hit_counts(namespace, [r.id for r in records])
            yield from (r.info(hits, last) for r, (hits, last) in zip(records, counts, strict=True))

    def _id_pages(self, namespace: str) -> Iterator[list[int]]:
        key = self._keys.namespace(namespace).ids
        low = "-inf"
        while True:
            with translated(f"listing the entries of {namespace!r}"):
                ids = [int(i) for i in self._redis.client.zrangebyscore(key, low, "+inf", start=0, num=_PAGE)]
            if not ids:
                return
            yield ids
            low = f"({ids[-1]}"

    def lengths(self, namespace: str) -> list[int]:
        """See :meth:`MapStoreBase.lengths`."""
        self._state(namespace)
        return [bucket.length for bucket in admin.bucket_stats(self._redis, self._keys, namespace)]

    # -------------------------------------------------------------- hits, delete

    def record_hits(self, namespace: str, ids: Iterable[int]) -> None:
        """See :meth:`MapStoreBase.record_hits`; counts are buffered and flushed like the LMDB backend's."""
        self._state(namespace)
        due = self._hits.add(namespace, ids, time.time())
        if due and not self._settings.readonly:
            self.flush_hits()

    def flush_hits(self) -> None:
        """Write buffered hit counts now (one script per namespace)."""
        pending = self._hits.drain()
        by_namespace: dict[str, list[bytes | str | int | float]] = {}
        for (name, entry_id), (hits, last) in pending.items():
            by_namespace.setdefault(name, []).extend([entry_id, hits, repr(last)])
        try:
            for name, args in by_namespace.items():
                keys = self._keys.namespace(name)
                with translated(f"writing hit counts of {name!r}"):
                    self._redis.eval(scripts.HITS, [keys.ids, keys.recency, keys.hits], args)
        except BaseException:
            self._hits.restore(pending)
            raise

    def _remove(self, namespace: str, ids: Sequence[int], reason: str) -> list[int]:
        """Unregister ``ids`` (logging their removal) and delete their hashes; returns those that were there."""
        keys = self._keys.namespace(namespace)
        with translated(f"removing entries of {namespace!r}"):
            removed = [int(i) for i in self._redis.eval(scripts.REMOVE, keys.index_keys(), [reason, *ids])]
        admin.delete_entry_keys(self._redis, self._keys, namespace, removed, orphans=False)
        self._hot.discard(namespace, ids)
        self._hits.drop(namespace, ids)
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

    # ------------------------------------------------------------------ prefetch

    def prefetch(self, namespace: str, ids: Iterable[int]) -> None:
        """See :meth:`MapStoreBase.prefetch`. Entries already in the DRAM tier are skipped."""
        self._state(namespace)
        self._hot.prefetch(namespace, ids)

    def wait_prefetch(self, timeout: float | None = None) -> bool:
        """See :meth:`MapStoreBase.wait_prefetch`."""
        return self._hot.wait_prefetch(timeout)

    def dead_threads(self) -> list[str]:
        """See :meth:`MapStoreBase.dead_threads`: the prefetch worker, the only long-lived one."""
        return [] if self._hot.alive else ["attnstore-prefetch"]

    # --------------------------------------------------------------------- admin

    def compact(self) -> CompactReport:
        """Remove unreachable hashes, forget entries Redis evicted, write every namespace's index snapshot
        and trim its log (see ``admin.compact``); ids are kept.

        Raises:
            ReadOnlyStoreError: the store is read-only.
        """
        self._check_writable()
        self.flush_hits()
        return admin.compact(self._redis, self._keys, self.list_namespaces(), self._log, self._forget_missing,
                             self._settings.orphan_grace_seconds)

    def verify(self) -> VerifyReport:
        """See :meth:`MapStoreBase.verify`. Entries Redis evicted are forgotten, not reported corrupt."""
        report = admin.verify(self._redis, self._keys, {i.name: self._state(i.name) for i in self.list_namespaces()},
                              self._forget_missing)
        if not report.ok:
            logger.warning("verify of %s found %s corrupt entries", self.location.display, len(report.corrupt))
        return report

    def stats(self) -> StoreStats:
        """See :meth:`MapStoreBase.stats`: ``file_bytes`` is Redis's used memory and ``map_size`` its
        maxmemory, summed over the primaries; evictions include entries Redis evicted that were found gone."""
        return admin.store_stats(self._redis, self._keys, self.list_namespaces(), self._settings,
                                 pending_hits=len(self._hits), dram=self._hot.stats())

    def close(self) -> None:
        """See :meth:`MapStoreBase.close`."""
        if self._closed:
            return
        self._closed = True
        self._hot.close()
        if not self._settings.readonly:
            try:
                self.flush_hits()
            except Exception as exc:  # closing must finish: the counts are only statistics
                logger.warning("map store %s: buffered hit counts lost on close: %s", self.location.display, exc)
        self._redis.close()
