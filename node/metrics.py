"""Prometheus metrics of a node, in a registry of its own (no global state), served at ``GET /metrics``.

Requests by route and status, their latency, the batcher's queue, what each call
(one merged batch of requests) held and how long it waited, rows by the tier that
served them, and the tokens the forwards held against the tokens they ran
(``forwarded / forward`` is the padding overhead: 1.0 for packed forwards), and
the distinct tokens of the calls' rows, each shared prefix once (``forward /
distinct`` near 1 when rows that share a prefix compute it once; below 1 when
tiers served rows).
Labelled counters start at 0 for every documented label value, so an alert on
``increase(...)`` fires on the first event rather than reading "no data".
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from attnstore_client.call.rows import ROW_KINDS, RowKind
from attnstore_client.stats import CacheStats

ROUTES: tuple[str, ...] = ("/v1/embeddings", "/embed", "/v1/score", "/v1/classify", "/rerank", "/v1/rerank",
                           "/v2/rerank", "/predict", "/score", "/embed_all", "/",
                           "/invocations", "/tokenize", "/decode")
STATUSES: tuple[str, ...] = ("200", "400", "401", "404", "405", "408", "413", "415", "499", "500", "503")
# The route of requests to no route of the node (404), and of those refused before their request line and headers
# were in (400 not HTTP, 408 too slow): a path of the client's choice would make a label per path.
OTHER_ROUTE = "other"
OTHER_STATUSES: tuple[str, ...] = ("400", "404", "408")
# Where a row's result came from: the ``tier`` label values of ``attnstore_node_rows_total`` for each of the
# client's ``RowKind``s, spelled as the node publishes them (dashboards and alerts scrape these): an exact row is told
# apart by whose exact tier served it, a miss is "computed". Copies of a row of the same call are "deduplicated".
ROW_LABELS: dict[RowKind, tuple[str, ...]] = {
    "exact": ("local_exact", "store_exact"),
    "prefix": ("prefix",),
    "chunk": ("chunk",),
    "map": ("map",),
    "miss": ("computed",),
    "fallback": ("fallback",),
}
TIERS: tuple[str, ...] = (*(label for kind in ROW_KINDS for label in ROW_LABELS[kind]), "deduplicated")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class NodeMetrics:
    """The node's metrics; ``render()`` gives the text exposition."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=registry)
        self.requests = Counter("attnstore_node_requests", "Requests answered (embedding routes, and refusals on any"
                                " route), by route and HTTP status",
                                ["route", "status"], registry=registry)
        self.latency = Histogram("attnstore_node_request_seconds", "Seconds from a request's arrival to its answer",
                                 ["route"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.inputs = Counter("attnstore_node_inputs", "Inputs (rows) of the requests served", registry=registry)
        self.cancelled = Counter("attnstore_node_cancelled_requests",
                                 "Requests whose client disconnected before the answer", registry=registry)
        self.freed_rows = Counter("attnstore_node_freed_rows",
                                  "Rows of disconnected clients taken out of the queue before their call",
                                  registry=registry)
        self.queue_requests = Gauge("attnstore_node_queue_requests", "Requests waiting to be batched",
                                    registry=registry)
        self.queue_rows = Gauge("attnstore_node_queue_rows", "Rows of the requests waiting to be batched",
                                registry=registry)
        self.wait = Histogram("attnstore_node_batch_wait_seconds", "Seconds a request waited before its call began",
                              buckets=_LATENCY_BUCKETS, registry=registry)
        self.call_seconds = Histogram("attnstore_node_call_seconds", "Seconds of one call (a merged batch)",
                                      buckets=_LATENCY_BUCKETS, registry=registry)
        self.call_requests = Histogram("attnstore_node_call_requests", "Requests merged into one call",
                                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=registry)
        self.batch_tokens = Histogram("attnstore_node_batch_tokens", "Tokens of the rows of one call",
                                      buckets=_TOKEN_BUCKETS, registry=registry)
        self.max_batch_tokens = Gauge("attnstore_node_max_batch_tokens", "Token budget of one packed forward now",
                                      registry=registry)
        self.rows = Counter("attnstore_node_rows", "Rows served, by where their result came from", ["tier"],
                            registry=registry)
        self.forward_tokens = Counter("attnstore_node_forward_tokens",
                                      "Real tokens of the rows the forwards computed", registry=registry)
        self.forwarded_tokens = Counter("attnstore_node_forwarded_tokens",
                                        "Tokens the forwards ran, padding included", registry=registry)
        self.distinct_tokens = Counter("attnstore_node_distinct_tokens",
                                       "Tokens of the rows of the calls with every prefix rows of a call share counted"
                                       " once: the least a call computes (compare forward_tokens)", registry=registry)
        self.audited = Counter("attnstore_node_audited_rows",
                               "The store's exact hits computed again to audit them (--audit-rate)", registry=registry)
        self.audit_mismatches = Counter("attnstore_node_audit_mismatches",
                                        "Audited rows the store had wrong (reported for quarantine, writer logged)",
                                        registry=registry)
        self.ready = Gauge("attnstore_node_ready", "1 once the model is loaded and the node serves",
                           registry=registry)
        for route in ROUTES:
            self.latency.labels(route)
            for status in STATUSES:
                self.requests.labels(route, status)
        for status in OTHER_STATUSES:
            self.requests.labels(OTHER_ROUTE, status)
        for tier in TIERS:
            self.rows.labels(tier)

    def record_call(self, stats: CacheStats, requests: int, tokens: int, seconds: float) -> None:
        """Count one call of ``requests`` merged requests holding ``tokens`` tokens, as its stats say. The call's
        requests are counted last, so whoever sees them counted (``attnstore_node_call_requests_sum``) sees the
        call's rows and tokens counted too."""
        self.call_seconds.observe(seconds)
        self.batch_tokens.observe(tokens)
        for tier, count in _rows_by_label(stats).items():
            if count:
                self.rows.labels(tier).inc(count)
        self.forward_tokens.inc(stats.forward_tokens)
        self.forwarded_tokens.inc(stats.forwarded_tokens)
        self.audited.inc(stats.audited)
        self.audit_mismatches.inc(stats.audit_mismatches)
        self.call_requests.observe(requests)

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)


def _rows_by_label(stats: CacheStats) -> dict[str, int]:
    """The call's rows by ``tier`` label value (``TIERS``), from its rows by ``RowKind``."""
    counts = {"deduplicated": stats.deduplicated}
    for kind, rows in stats.rows_by_kind().items():
        if kind == "exact":  # this node's own exact tier's (``local_hits``), and the store's
            counts.update(local_exact=stats.local_hits, store_exact=rows - stats.local_hits)
        else:
            (label,) = ROW_LABELS[kind]
            counts[label] = rows
    return counts
