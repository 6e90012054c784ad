"""Admin work on a Redis store that walks many keys: stats, verify, compaction, the byte cap's victims.

All of it runs beside live traffic (SCAN and paged reads: no command blocks a
shard for long) and is safe to run from any number of processes at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial

from attnstore.errors import ChecksumError, EntryNotFoundError
from attnstore.protocol.records import FORMAT_VERSION, NamespaceInfo
from attnstore.store.arrays import NamespaceState
from attnstore.store.entry_check import entry_problems
from attnstore.store.eviction import EntryCandidate, least_recent_first, plan_eviction
from attnstore.store.redis.chunks import walks as chunk_walks
from attnstore.store.redis.connection import RedisConnection, translated
from attnstore.store.redis.keys import OUTPUTS_FIELD, RECORD_FIELD, StoreKeys, decode_record, hash_object
from attnstore.store.reports import (
    BucketStats,
    CompactReport,
    CorruptEntry,
    DramStats,
    NamespaceStats,
    StoreStats,
    VerifyReport,
)

logger = logging.getLogger(__name__)

PAGE = 256  # entries per paged read
ForgetMissing = Callable[[str, Sequence[int]], list[int]]


def delete_keys(connection: RedisConnection, keys: Sequence[str]) -> None:
    """Delete ``keys`` (any slots) in one pipelined round trip per shard."""
    if not keys:
        return
    with translated("deleting keys"):
        pipe = connection.client.pipeline(transaction=False)
        for key in keys:
            pipe.delete(key)
        pipe.execute()


def delete_keys_quietly(connection: RedisConnection, keys: Sequence[str]) -> None:
    """Delete ``keys`` on a failure path: an error here is logged, not raised (compaction removes leftovers)."""
    try:
        delete_keys(connection, keys)
    except Exception as exc:
        logger.warning("could not delete %s unregistered entry keys (compaction will): %s", len(keys), exc)


def id_pages(connection: RedisConnection, ids_key: str) -> Iterator[list[int]]:
    """The live ids of a namespace (its ``ids`` ZSET) in ascending pages."""
    low = "-inf"
    while True:
        with translated("listing entry ids"):
            ids = [int(i) for i in connection.client.zrangebyscore(ids_key, low, "+inf", start=0, num=PAGE)]
        if not ids:
            return
        yield ids
        low = f"({ids[-1]}"


def bucket_stats(connection: RedisConnection, keys: StoreKeys, namespace: str) -> list[BucketStats]:
    """Entries and bytes per token length of one namespace, ascending."""
    with translated(f"reading the buckets of {namespace!r}"):
        raw = connection.client.hgetall(keys.namespace(namespace).buckets)
    counts = {bytes(k).decode(): int(v) for k, v in raw.items()}
    lengths = sorted(int(k[2:]) for k, v in counts.items() if k.startswith("n:") and v > 0)
    return [
        BucketStats(length, counts[f"n:{length}"], counts.get(f"b:{length}", 0), counts.get(f"r:{length}", 0),
                    counts[f"n:{length}"])
        for length in lengths
    ]


def evicted_counts(connection: RedisConnection, keys: StoreKeys, namespace: str) -> tuple[int, int]:
    """Entries and bytes of ``namespace`` removed by the byte cap or found evicted by Redis."""
    with translated(f"reading the buckets of {namespace!r}"):
        n, b = connection.client.hmget(keys.namespace(namespace).buckets, ["evicted:n", "evicted:b"])
    return int(n or 0), int(b or 0)


def entry_bytes(connection: RedisConnection, keys: StoreKeys, namespaces: Sequence[str]) -> int:
    """Stored bytes of every registered entry of ``namespaces``."""
    return sum(b.stored_bytes for ns in namespaces for b in bucket_stats(connection, keys, ns))


def eviction_victims(
    connection: RedisConnection, keys: StoreKeys, namespaces: Sequence[str], max_bytes: int, low_water: float,
    protect: set[tuple[str, int]],
) -> tuple[dict[str, list[int]], dict[str, list[bytes]]]:
    """The least recently used entries and chunks (all namespaces) to remove to bring stored bytes (entries' and
    chunks') to ``low_water`` of the cap (see ``store.eviction``): entry ids and chunk keys by namespace.

    Reads each namespace's recency in pages, merged oldest first; ``protect`` (this ingest's entries) stays.
    """
    used = entry_bytes(connection, keys, namespaces) + chunk_walks.total_bytes(connection, keys, namespaces)
    if used <= max_bytes:
        return {}, {}

    def oldest(ns: str) -> Iterator[EntryCandidate]:
        start = 0
        while True:
            with translated(f"reading the recency of {ns!r}"):
                page = connection.client.zrange(keys.namespace(ns).recency, start, start + PAGE - 1, withscores=True)
            if not page:
                return
            for raw_id, score in page:
                entry_id = int(raw_id)
                if (ns, entry_id) in protect:
                    continue
                with translated(f"reading entry {entry_id} of {ns!r}"):
                    meta = connection.client.hget(keys.namespace(ns).meta, str(entry_id))
                if meta is not None:  # else removed meanwhile
                    yield EntryCandidate(float(score), ns, entry_id, int(bytes(meta)[32:].split(b" ")[1]))
            start += PAGE

    chunks = chunk_walks.candidates(connection, keys, namespaces, set())
    candidates = least_recent_first(chunks, *(oldest(ns) for ns in namespaces))
    victims: dict[str, list[int]] = {}
    chunk_victims: dict[str, list[bytes]] = {}
    for victim in plan_eviction(used, max_bytes, low_water, candidates).victims:
        ident = victim.key
        if isinstance(ident, bytes):  # a chunk's key
            chunk_victims.setdefault(victim.namespace, []).append(ident)
        else:
            victims.setdefault(victim.namespace, []).append(ident)
    return victims, chunk_victims


def records(connection: RedisConnection, keys: StoreKeys, namespace: str, ids: Sequence[int]) -> list[bytes | None]:
    """The stored records of ``ids`` (None where gone), one pipelined read."""
    if not ids:
        return []
    with translated(f"reading entries of {namespace!r}"):
        pipe = connection.client.pipeline(transaction=False)
        for entry_id in ids:
            pipe.hget(keys.entry(namespace, entry_id), RECORD_FIELD)
        return list(pipe.execute())


def verify(
    connection: RedisConnection, keys: StoreKeys, states: dict[str, NamespaceState], forget_missing: ForgetMissing
) -> VerifyReport:
    """Check every registered entry's stored objects against their crc32cs (see ``MapStoreBase.verify``).

    Entries Redis evicted are forgotten, not reported corrupt; entry keys no registered entry
    owns are counted as orphans (``orphan_objects``).
    """
    start = time.perf_counter()
    corrupt: list[CorruptEntry] = []
    entries = objects = orphans = 0
    for name, state in sorted(states.items()):
        registered: set[int] = set()
        for page in id_pages(connection, keys.namespace(name).ids):
            registered.update(page)
            with translated(f"verifying entries of {name!r}"):
                pipe = connection.client.pipeline(transaction=False)
                for entry_id in page:
                    pipe.hgetall(keys.entry(name, entry_id))
                found = pipe.execute()
            gone = [entry_id for entry_id, fields in zip(page, found, strict=True) if not fields]
            if gone:
                forget_missing(name, gone)
            for entry_id, fields in zip(page, found, strict=True):
                if not fields:
                    continue
                entries += 1
                try:
                    record = decode_record(state, entry_id, fields.get(RECORD_FIELD))
                except (ChecksumError, EntryNotFoundError) as exc:
                    corrupt.append(CorruptEntry(name, entry_id, f"record: {exc}"))
                    continue
                read = partial(hash_object, fields)
                problems, checked = entry_problems(state, record, read, fields.get(OUTPUTS_FIELD))
                objects += checked
                if problems:
                    corrupt.append(CorruptEntry(name, entry_id, problems[0]))
        orphans += sum(1 for entry_id in entry_ids_stored(connection, keys, name) if entry_id not in registered)
    return VerifyReport(entries, objects, tuple(corrupt), orphans, time.perf_counter() - start)


def entry_ids_stored(connection: RedisConnection, keys: StoreKeys, namespace: str) -> Iterator[int]:
    """The id of every entry key of ``namespace`` on every primary, registered or not (SCAN)."""
    for key in connection.scan(keys.entry_pattern(namespace)):
        entry_id = keys.entry_id_of(namespace, key)
        if entry_id is not None:
            yield entry_id


def compact(
    connection: RedisConnection, keys: StoreKeys, namespaces: Iterable[NamespaceInfo], forget_missing: ForgetMissing,
    orphan_grace_seconds: float,
) -> CompactReport:
    """Forget registered entries Redis evicted and delete entry keys nobody registered (a crashed ingest's).

    Entry keys younger than ``orphan_grace_seconds`` stay: their ingest may still be in flight.
    Redis reclaims memory itself, so there is no rewrite; ids are kept.
    """
    start = time.perf_counter()
    before = used_memory(connection)
    live = dropped = 0
    now = time.time()
    for info in namespaces:
        ns_keys = keys.namespace(info.name)
        registered: set[int] = set()
        for page in id_pages(connection, ns_keys.ids):
            registered.update(page)
            with translated(f"checking entries of {info.name!r}"):
                pipe = connection.client.pipeline(transaction=False)
                for entry_id in page:
                    pipe.exists(keys.entry(info.name, entry_id))
                there = pipe.execute()
            gone = [entry_id for entry_id, exists in zip(page, there, strict=True) if not exists]
            forget_missing(info.name, gone)
            live += len(page) - len(gone)
        unregistered = [i for i in entry_ids_stored(connection, keys, info.name) if i not in registered]
        stale = []
        for entry_id, raw in zip(unregistered, records(connection, keys, info.name, unregistered), strict=True):
            try:
                created = decode_record(NamespaceState.of(info), entry_id, raw).created
            except (ChecksumError, EntryNotFoundError):
                created = 0.0  # no readable record: nothing can ever register it
            if now - created >= orphan_grace_seconds:
                stale.append(keys.entry(info.name, entry_id))
        delete_keys(connection, stale)
        dropped += len(stale)
    after = used_memory(connection)
    return CompactReport(connection.location.display, connection.location.display, live, dropped, before, after,
                         time.perf_counter() - start)


def used_memory(connection: RedisConnection) -> int:
    """Redis's used memory, summed over the primaries."""
    with translated("reading Redis's memory use"):
        return sum(int(server.info("memory")["used_memory"]) for server in connection.primaries())


def max_memory(connection: RedisConnection) -> int:
    """Redis's maxmemory, summed over the primaries (0: unbounded)."""
    with translated("reading Redis's maxmemory"):
        return sum(int(server.config_get("maxmemory").get("maxmemory", 0)) for server in connection.primaries())


def store_stats(
    connection: RedisConnection, keys: StoreKeys, namespaces: Sequence[NamespaceInfo], max_bytes: int | None,
    pending_hits: int, dram: DramStats,
) -> StoreStats:
    """See ``RedisMapStore.stats``."""
    per_namespace = []
    evicted_entries = evicted_bytes = 0
    for info in namespaces:
        buckets = tuple(bucket_stats(connection, keys, info.name))
        per_namespace.append(NamespaceStats(
            info.name, info.layout.codec, sum(b.entries for b in buckets), sum(b.stored_bytes for b in buckets),
            sum(b.raw_bytes for b in buckets), buckets,
        ))
        n, b = evicted_counts(connection, keys, info.name)
        evicted_entries += n
        evicted_bytes += b
    return StoreStats(
        path=connection.location.display,
        generation="redis",
        format_version=FORMAT_VERSION,
        entries=sum(n.entries for n in per_namespace),
        stored_bytes=sum(n.stored_bytes for n in per_namespace),
        raw_bytes=sum(n.raw_bytes for n in per_namespace),
        file_bytes=used_memory(connection),
        map_size=max_memory(connection),
        max_bytes=max_bytes,
        evicted_entries=evicted_entries,
        evicted_bytes=evicted_bytes,
        pending_hits=pending_hits,
        namespaces=tuple(per_namespace),
        dram=dram,
    )
