"""Prometheus metrics of the daemon, in a registry of its own (no global state).

Counters and histograms are updated by the servicer as calls run (and by the
auth interceptor for the calls it refuses); store-wide figures (entries, DRAM
tier usage, evictions) are read from the store's stats at scrape time, and so
are, on a Redis store, the index follower's lag and the Redis client's retries
and each primary's memory (``REDIS_METRIC_NAMES``). Namespace
labels are recorded only after the service accepted the namespace, so clients
cannot grow the label set with made-up names.

Every labelled counter starts at 0 for each documented label value (each method
and status code, each namespace once known, each row-error code), so an alert on
``increase(...)`` fires on the first event rather than reading "no data". The
process and platform collectors of ``prometheus_client`` are registered too
(``process_*``, ``python_info``, ``python_gc_*``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Literal
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.service.follower import FollowerStatus
from attnstore.service.write_back import WriteBackResult
from attnstore.store.reports import StoreStats

if TYPE_CHECKING:
    from attnstore.store.redis.connection import RedisStats

log = logging.getLogger(__name__)

BackgroundSource = Callable[[], dict[str, int]]
StatsSource = Callable[[], "StoreStats | None"]
FollowerSource = Callable[[], "FollowerStatus | None"]
RedisSource = Callable[[], "RedisStats | None"]

# Search covers the exact tier and the vector search of one call; a fetch is one
# layer of one entry (or one entry's outputs) read from the store.
_SEARCH_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_FETCH_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25)
_RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0)

# The AttnStore RPCs, and the status codes the daemon answers them with: the
# servicer's (see attnstore.protocol.status_codes), the auth interceptor's and OK.
RPC_METHODS: tuple[str, ...] = tuple(m.name for m in pb.DESCRIPTOR.services_by_name["AttnStore"].methods)
RPC_CODES: tuple[str, ...] = (
    "OK", "CANCELLED", "INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
)
# The codes of a dropped hit row: those of attnstore.service.ROW_ERRORS (a test keeps them equal).
ROW_ERROR_CODES: tuple[str, ...] = ("DATA_LOSS", "INVALID_ARGUMENT", "NOT_FOUND")
HIT_KINDS: tuple[str, ...] = ("exact", "map")
STREAMED_KINDS: tuple[str, ...] = ("maps", "outputs", "prefix", "chunks")

# Every metric name the daemon exports (without _total/_bucket suffixes).
METRIC_NAMES: tuple[str, ...] = (
    "attnstore_serving",
    "attnstore_rpcs",
    "attnstore_rpc_seconds",
    "attnstore_rpcs_in_flight",
    "attnstore_lookups",
    "attnstore_queries",
    "attnstore_hits",
    "attnstore_misses",
    "attnstore_hit_rate",
    "attnstore_row_errors",
    "attnstore_bytes_streamed",
    "attnstore_search_seconds",
    "attnstore_fetch_seconds",
    "attnstore_ingested_entries",
    "attnstore_ingested_bytes",
    "attnstore_chunks_put",
    "attnstore_chunks_put_bytes",
    "attnstore_prefix_blocks_put",
    "attnstore_prefix_blocks_put_bytes",
    "attnstore_store_entries",
    "attnstore_store_stored_bytes",
    "attnstore_store_evicted_entries",
    "attnstore_dram_bytes",
    "attnstore_dram_capacity_bytes",
    "attnstore_dram_entries",
    "attnstore_dram_hits",
    "attnstore_dram_misses",
    "attnstore_dram_evictions",
    "attnstore_background_errors",
)

# Exported only by a daemon on a Redis store (one that follows a shared change log), read at scrape time.
REDIS_METRIC_NAMES: tuple[str, ...] = (
    "attnstore_follower_seconds_since_read",
    "attnstore_follower_changes_applied",
    "attnstore_follower_failed_reads",
    "attnstore_follower_skipped_records",
    "attnstore_follower_errors",
    "attnstore_redis_retries",
    "attnstore_redis_waited_out",
    "attnstore_redis_gave_up",
    "attnstore_redis_used_memory_bytes",
    "attnstore_redis_maxmemory_bytes",
    "attnstore_redis_store_resets",
    "attnstore_redis_store_unsafe",
)


class _SharedStoreCollector(Collector):
    """The index follower's and the Redis client's figures, read at scrape time; nothing for an LMDB store."""

    def __init__(self, follower: FollowerSource, redis: RedisSource) -> None:
        self._follower = follower
        self._redis = redis

    def collect(self) -> Iterator[Metric]:
        try:  # a scrape must not fail because the store is busy, closing or unreachable
            follower = self._follower()
            redis = self._redis()
        except Exception as exc:
            log.warning("event=metrics_redis_failed error=%r", exc)
            return
        if follower is not None:
            yield GaugeMetricFamily(
                "attnstore_follower_seconds_since_read",
                "Seconds since the index follower last read the store's change log (the map tier's staleness)",
                value=follower.seconds_since_read,
            )
            yield CounterMetricFamily(
                "attnstore_follower_changes_applied",
                "Change-log records (one per ingest or delete call, any daemon's) applied to this daemon's indexes",
                value=follower.changes_applied,
            )
            yield CounterMetricFamily(
                "attnstore_follower_failed_reads", "Reads of the change log that failed (Redis unreachable)",
                value=follower.failed_reads,
            )
            yield CounterMetricFamily(
                "attnstore_follower_skipped_records",
                "Change-log records that did not decode: skipped, their namespace's index rebuilt from the keys",
                value=follower.skipped_records,
            )
            yield CounterMetricFamily(
                "attnstore_follower_errors", "Follower steps that failed unexpectedly (a bug; the follower goes on)",
                value=follower.errors,
            )
        if redis is None:
            return
        yield CounterMetricFamily(
            "attnstore_redis_retries", "Redis commands sent again after a transient failure (dropped, failing over)",
            value=redis.retries.retries,
        )
        yield CounterMetricFamily(
            "attnstore_redis_waited_out", "Redis calls that failed transiently and then succeeded",
            value=redis.retries.waited_out,
        )
        yield CounterMetricFamily(
            "attnstore_redis_gave_up", "Redis calls still failing after the failover wait (answered UNAVAILABLE)",
            value=redis.retries.gave_up,
        )
        yield CounterMetricFamily(
            "attnstore_redis_store_resets",
            "Times the Redis store was found replaced (its data lost): caches and indexes dropped and rebuilt",
            value=redis.resets,
        )
        yield GaugeMetricFamily(
            "attnstore_redis_store_unsafe",
            "1 while writes are refused: the store's marker is gone, or Redis runs an allkeys-* maxmemory policy",
            value=1 if redis.unsafe else 0,
        )
        used = GaugeMetricFamily(
            "attnstore_redis_used_memory_bytes", "used_memory of each Redis primary", labels=["node"]
        )
        limit = GaugeMetricFamily(
            "attnstore_redis_maxmemory_bytes", "maxmemory of each Redis primary (0: none set)", labels=["node"]
        )
        for node in redis.nodes:
            used.add_metric([node.node], node.used_bytes)
            limit.add_metric([node.node], node.max_bytes)
        yield used
        yield limit


class _BackgroundCollector(Collector):
    """Unexpected errors each background thread caught and survived, read at scrape time."""

    def __init__(self, background: BackgroundSource) -> None:
        self._background = background

    def collect(self) -> Iterator[Metric]:
        try:
            errors = self._background()
        except Exception as exc:  # a scrape must not fail because the store is busy or closing
            log.warning("event=metrics_background_failed error=%r", exc)
            return
        family = CounterMetricFamily(
            "attnstore_background_errors",
            "Unexpected errors a background thread caught, logged with their traceback and survived",
            labels=["thread"],
        )
        for thread, count in sorted(errors.items()):
            family.add_metric([thread], count)
        yield family


class _StoreCollector(Collector):
    """Store-wide figures read from the store's stats at scrape time."""

    def __init__(self, stats: StatsSource) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
        except Exception as exc:  # a scrape must not fail because the store is busy or closing
            log.warning("event=metrics_stats_failed error=%r", exc)
            return
        if stats is None:
            return
        yield GaugeMetricFamily("attnstore_store_entries", "Live entries in the store", value=stats.entries)
        yield GaugeMetricFamily(
            "attnstore_store_stored_bytes",
            "Stored bytes of live entries (what --max-bytes caps)",
            value=stats.stored_bytes,
        )
        yield CounterMetricFamily(
            "attnstore_store_evicted_entries", "Entries evicted by the store's byte cap", value=stats.evicted_entries
        )
        dram = stats.dram
        yield GaugeMetricFamily("attnstore_dram_bytes", "Bytes of decoded maps in the DRAM cache", value=dram.bytes)
        yield GaugeMetricFamily(
            "attnstore_dram_capacity_bytes", "Capacity of the DRAM cache (--dram-bytes)", value=dram.capacity_bytes
        )
        yield GaugeMetricFamily("attnstore_dram_entries", "Entries held in the DRAM cache", value=dram.entries)
        yield CounterMetricFamily("attnstore_dram_hits", "Reads served by the DRAM cache", value=dram.hits)
        yield CounterMetricFamily("attnstore_dram_misses", "Reads that went to LMDB", value=dram.misses)
        yield CounterMetricFamily(
            "attnstore_dram_evictions",
            "Entries pushed out of the DRAM cache to stay under capacity",
            value=dram.evictions,
        )


class DaemonMetrics:
    """The daemon's metrics and the HTTP endpoint that serves them.

    Args:
        stats: returns the store's stats at scrape time, or None while no store
            is open (loading, closed).
        follower: the index follower's status at scrape time, or None (no store, or one no other daemon writes).
        redis: the Redis client's figures at scrape time, or None (no store, or not a Redis one).
        background: unexpected errors each background thread survived, by thread name, at scrape time.
    """

    def __init__(
        self, stats: StatsSource = lambda: None, *, follower: FollowerSource = lambda: None,
        redis: RedisSource = lambda: None, background: BackgroundSource = dict,
    ) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        # Instances of our own: the module-level ones are bound to the global registry.
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)
        self._rpcs = Counter(
            "attnstore_rpcs", "Finished RPCs by method and status code", ["method", "code"], registry=reg
        )
        self._rpc_seconds = Histogram(
            "attnstore_rpc_seconds", "RPC duration, streams included", ["method"], buckets=_RPC_BUCKETS, registry=reg
        )
        self._in_flight = Gauge("attnstore_rpcs_in_flight", "RPCs running now", registry=reg)
        self._serving = Gauge(
            "attnstore_serving", "1 while health says SERVING; 0 while loading, draining or degraded", registry=reg
        )
        self._lookups = Counter("attnstore_lookups", "Lookup calls answered", ["namespace"], registry=reg)
        self._queries = Counter("attnstore_queries", "Queries matched (Lookup and Search)", ["namespace"], registry=reg)
        self._hits = Counter(
            "attnstore_hits", "Queries that hit, by kind (exact, map)", ["namespace", "kind"], registry=reg
        )
        self._misses = Counter("attnstore_misses", "Queries that missed", ["namespace"], registry=reg)
        self._hit_rate = Gauge(
            "attnstore_hit_rate",
            "Hits over queries since the daemon started (for a glance; take rates from hits and queries)",
            ["namespace"],
            registry=reg,
        )
        self._row_errors = Counter(
            "attnstore_row_errors",
            "Hit rows dropped mid-stream (entry unreadable)",
            ["namespace", "code"],
            registry=reg,
        )
        self._bytes = Counter(
            "attnstore_bytes_streamed", "Array bytes sent to clients, by kind (maps, outputs)", ["kind"], registry=reg
        )
        self._search = Histogram(
            "attnstore_search_seconds",
            "Exact tier and vector search time per call",
            buckets=_SEARCH_BUCKETS,
            registry=reg,
        )
        self._fetch = Histogram(
            "attnstore_fetch_seconds",
            "Time to read one layer (or one entry's outputs) from the store",
            buckets=_FETCH_BUCKETS,
            registry=reg,
        )
        self._ingested = Counter(
            "attnstore_ingested_entries",
            "Entries committed by Ingest (duplicates included)",
            ["namespace"],
            registry=reg,
        )
        self._ingested_bytes = Counter(
            "attnstore_ingested_bytes", "Array bytes received by committed Ingest streams", ["namespace"], registry=reg
        )
        self._written_back = Counter(
            "attnstore_written_back_entries", "Entries stored by WriteBack (new ones only)", ["namespace"], registry=reg
        )
        self._written_back_bytes = Counter(
            "attnstore_written_back_bytes", "Bytes stored by WriteBack (fp16 outputs and maps)", ["namespace"],
            registry=reg,
        )
        self._written_back_maps = Counter(
            "attnstore_written_back_map_entries", "Entries stored by WriteBack with maps (map tier)", ["namespace"],
            registry=reg,
        )
        self._written_back_map_bytes = Counter(
            "attnstore_written_back_map_bytes", "Map bytes stored by WriteBack (fp16)", ["namespace"], registry=reg
        )
        self._not_admitted = Counter(
            "attnstore_write_back_not_admitted", "Written-back rows skipped: not admitted", ["namespace"], registry=reg
        )
        self._refused = Counter(
            "attnstore_write_back_refused", "Written-back rows refused one by one (bad rows; the rest stored)",
            ["namespace"], registry=reg,
        )
        self._chunks_put = Counter(
            "attnstore_chunks_put", "Chunks stored by PutChunks (new ones only)", ["namespace"], registry=reg
        )
        self._chunks_put_bytes = Counter(
            "attnstore_chunks_put_bytes", "Bytes of the chunks PutChunks stored", ["namespace"], registry=reg
        )
        self._prefix_blocks_put = Counter(
            "attnstore_prefix_blocks_put", "Prefix blocks stored by PutPrefix (new ones only)", ["namespace"],
            registry=reg,
        )
        self._prefix_blocks_put_bytes = Counter(
            "attnstore_prefix_blocks_put_bytes", "Bytes of the prefix blocks PutPrefix stored", ["namespace"],
            registry=reg,
        )
        self._admitted = Counter(
            "attnstore_admissions", "Exact-tier misses marked admit for write-back", ["namespace"], registry=reg
        )
        self._mismatches = Counter(
            "attnstore_audit_mismatches", "Stored objects a node's audit reported wrong (ReportMismatch)",
            ["namespace", "kind"], registry=reg,
        )
        self._quarantined = Counter(
            "attnstore_quarantined", "Stored objects put in quarantine (served to no one until an admin looks)",
            ["namespace", "kind"], registry=reg,
        )
        reg.register(_StoreCollector(stats))
        reg.register(_SharedStoreCollector(follower, redis))
        reg.register(_BackgroundCollector(background))
        for method in RPC_METHODS:
            for code in RPC_CODES:
                self._rpcs.labels(method, code)
        for kind in STREAMED_KINDS:
            self._bytes.labels(kind)
        self._lock = threading.Lock()
        self._totals: dict[str, tuple[int, int]] = {}  # namespace -> (queries, hits), for the hit rate
        self._http: WSGIServer | None = None

    # ---- updates ------------------------------------------------------------

    def set_serving(self, serving: bool) -> None:
        """Mirror the health status (a scrape sees what a health check would)."""
        self._serving.set(1 if serving else 0)

    def namespace_known(self, namespace: str) -> None:
        """Start the per-namespace counters of ``namespace`` at 0 (a namespace the service holds)."""
        self._lookups.labels(namespace)
        self._queries.labels(namespace)
        self._misses.labels(namespace)
        for kind in HIT_KINDS:
            self._hits.labels(namespace, kind)
        for code in ROW_ERROR_CODES:
            self._row_errors.labels(namespace, code)
        self._ingested.labels(namespace)
        self._ingested_bytes.labels(namespace)
        for counter in (self._written_back, self._written_back_bytes, self._written_back_maps,
                        self._written_back_map_bytes, self._not_admitted, self._refused, self._admitted):
            counter.labels(namespace)

    def refused(self, method: str, code: str) -> None:
        """A call to ``method`` was refused before it ran (auth), with status ``code``."""
        self._rpcs.labels(method, code).inc()

    def rpc_started(self) -> None:
        """One more call running."""
        self._in_flight.inc()

    def rpc_finished(self, method: str, code: str, seconds: float) -> None:
        """A call ended with status ``code`` (a grpc.StatusCode name) after ``seconds``."""
        self._in_flight.dec()
        self._rpcs.labels(method, code).inc()
        self._rpc_seconds.labels(method).observe(seconds)

    def matched(
        self, namespace: str, kinds: Sequence[Literal["miss", "exact", "map"]], seconds: float, *, lookup: bool
    ) -> None:
        """A Lookup (``lookup=True``) or Search matched queries of these kinds in ``seconds``."""
        self._search.observe(seconds)
        if lookup:
            self._lookups.labels(namespace).inc()
        self._queries.labels(namespace).inc(len(kinds))
        hits = 0
        for kind in HIT_KINDS:
            count = sum(k == kind for k in kinds)
            if count:
                self._hits.labels(namespace, kind).inc(count)
                hits += count
        if len(kinds) > hits:
            self._misses.labels(namespace).inc(len(kinds) - hits)
        with self._lock:
            queries, total_hits = self._totals.get(namespace, (0, 0))
            queries, total_hits = queries + len(kinds), total_hits + hits
            self._totals[namespace] = (queries, total_hits)
        if queries:
            self._hit_rate.labels(namespace).set(total_hits / queries)

    def fetched(self, seconds: float) -> None:
        """One layer (or one entry's outputs) was read from the store in ``seconds``."""
        self._fetch.observe(seconds)

    def streamed(self, kind: Literal["maps", "outputs", "prefix", "chunks"], nbytes: int) -> None:
        """``nbytes`` of array data went out to a client."""
        self._bytes.labels(kind).inc(nbytes)

    def row_error(self, namespace: str, code: str) -> None:
        """A hit row was dropped mid-stream with status ``code``."""
        self._row_errors.labels(namespace, code).inc()

    def ingested(self, namespace: str, entries: int, nbytes: int) -> None:
        """An Ingest stream committed ``entries`` entries of ``nbytes`` array bytes."""
        self._ingested.labels(namespace).inc(entries)
        self._ingested_bytes.labels(namespace).inc(nbytes)

    def written_back(self, namespace: str, result: WriteBackResult) -> None:
        """What one WriteBack stored (entries, bytes, those with maps) and skipped."""
        self._written_back.labels(namespace).inc(result.stored)
        self._written_back_bytes.labels(namespace).inc(result.bytes)
        self._written_back_maps.labels(namespace).inc(result.maps_stored)
        self._written_back_map_bytes.labels(namespace).inc(result.maps_bytes)
        self._not_admitted.labels(namespace).inc(result.not_admitted)
        self._refused.labels(namespace).inc(len(result.refused))

    def prefix_blocks_put(self, namespace: str, blocks: int, nbytes: int) -> None:
        """A PutPrefix stored ``blocks`` new prefix blocks of ``nbytes`` bytes."""
        self._prefix_blocks_put.labels(namespace).inc(blocks)
        self._prefix_blocks_put_bytes.labels(namespace).inc(nbytes)

    def chunks_put(self, namespace: str, chunks: int, nbytes: int) -> None:
        """A PutChunks stored ``chunks`` new chunks of ``nbytes`` bytes."""
        self._chunks_put.labels(namespace).inc(chunks)
        self._chunks_put_bytes.labels(namespace).inc(nbytes)

    def admitted(self, namespace: str, rows: int) -> None:
        """A Lookup marked ``rows`` misses admit."""
        self._admitted.labels(namespace).inc(rows)

    def mismatch_reported(self, namespace: str, kind: str, *, quarantined: bool) -> None:
        """A node reported a stored object of ``kind`` wrong; ``quarantined``: the report put it in quarantine."""
        self._mismatches.labels(namespace, kind).inc()
        if quarantined:
            self._quarantined.labels(namespace, kind).inc()

    # ---- export -------------------------------------------------------------

    def render(self) -> bytes:
        """The metrics in Prometheus text format."""
        return generate_latest(self.registry)

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` over HTTP on ``host:port`` (0 = any free port); returns the port.

        Raises:
            OSError: the port cannot be bound.
        """
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return int(server.server_address[1])

    def stop(self) -> None:
        """Stop the HTTP endpoint, if serving. Idempotent."""
        server, self._http = self._http, None
        if server is not None:
            server.shutdown()
            server.server_close()
