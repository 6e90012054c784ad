"""Daemon metrics: counters, the hit rate, store figures at scrape time, the HTTP endpoint."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import attnstore.errors
from attnstore.protocol.status_codes import status_for
from attnstore.server.metrics import REDIS_METRIC_NAMES, ROW_ERROR_CODES, RPC_CODES, RPC_METHODS, DaemonMetrics
from attnstore.service import ROW_ERRORS
from attnstore.service.follower import FollowerStatus
from attnstore.store.redis.connection import NodeMemory, RedisStats, RetryTotals
from tests.support.server_fixtures import FP, LAYOUT, memory_service
from tests.support.stores import make_entry


def _samples(metrics: DaemonMetrics) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


def test_matches_count_hits_by_kind_and_keep_a_running_hit_rate() -> None:
    metrics = DaemonMetrics()
    metrics.matched("ns", ["exact", "map", "miss", "miss"], 0.002, lookup=True)
    metrics.matched("ns", ["map", "map"], 0.001, lookup=False)
    samples = _samples(metrics)
    assert samples[("attnstore_lookups_total", (("namespace", "ns"),))] == 1
    assert samples[("attnstore_queries_total", (("namespace", "ns"),))] == 6
    assert samples[("attnstore_hits_total", (("kind", "map"), ("namespace", "ns")))] == 3
    assert samples[("attnstore_hits_total", (("kind", "exact"), ("namespace", "ns")))] == 1
    assert samples[("attnstore_misses_total", (("namespace", "ns"),))] == 2
    assert samples[("attnstore_hit_rate", (("namespace", "ns"),))] == 4 / 6
    assert samples[("attnstore_search_seconds_count", ())] == 2


def test_rpcs_fetches_and_ingests_are_counted() -> None:
    metrics = DaemonMetrics()
    metrics.rpc_started()
    metrics.rpc_finished("Lookup", "OK", 0.01)
    metrics.fetched(0.0001)
    metrics.fetched(0.0002)
    metrics.streamed("maps", 1000)
    metrics.streamed("outputs", 10)
    metrics.row_error("ns", "DATA_LOSS")
    metrics.ingested("ns", 3, 4096)
    samples = _samples(metrics)
    assert samples[("attnstore_rpcs_total", (("code", "OK"), ("method", "Lookup")))] == 1
    assert samples[("attnstore_rpcs_in_flight", ())] == 0
    assert samples[("attnstore_bytes_streamed_total", (("kind", "maps"),))] == 1000
    assert samples[("attnstore_fetch_seconds_count", ())] == 2
    assert samples[("attnstore_row_errors_total", (("code", "DATA_LOSS"), ("namespace", "ns")))] == 1
    assert samples[("attnstore_ingested_entries_total", (("namespace", "ns"),))] == 3


def test_store_figures_are_read_at_scrape_time_and_absent_without_a_store() -> None:
    service = memory_service()
    current = [None]
    metrics = DaemonMetrics(stats=lambda: current[0] and current[0].store.stats())
    assert not any(name.startswith("attnstore_dram") for name, _ in _samples(metrics))
    current[0] = service
    service.ingest("ns", FP, [make_entry(LAYOUT, 5, seed) for seed in (1, 2)])
    samples = _samples(metrics)
    assert samples[("attnstore_store_entries", ())] == 2
    assert ("attnstore_dram_capacity_bytes", ()) in samples and ("attnstore_dram_evictions_total", ()) in samples


def test_a_failing_stats_source_does_not_break_the_scrape() -> None:
    def broken() -> None:
        raise RuntimeError("store closing")

    assert b"attnstore_rpcs_in_flight" in DaemonMetrics(stats=broken).render()


def test_registries_are_private_and_served_over_http() -> None:
    first, second = DaemonMetrics(), DaemonMetrics()
    first.matched("ns", ["map"], 0.001, lookup=True)
    assert REGISTRY.get_sample_value("attnstore_queries_total", {"namespace": "ns"}) is None
    assert b'namespace="ns"' not in second.render()
    port = first.serve("127.0.0.1", 0)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        first.stop()
    assert re.search(r'^attnstore_queries_total\{namespace="ns"\} 1\.0$', text, re.MULTILINE)


def test_counters_start_at_zero_for_every_documented_label_value() -> None:
    metrics = DaemonMetrics()
    metrics.namespace_known("ns")
    samples = _samples(metrics)
    for code in ROW_ERROR_CODES:
        assert samples[("attnstore_row_errors_total", (("code", code), ("namespace", "ns")))] == 0
    for kind in ("exact", "map"):
        assert samples[("attnstore_hits_total", (("kind", kind), ("namespace", "ns")))] == 0
    for name in ("lookups", "queries", "misses", "ingested_entries", "ingested_bytes"):
        assert samples[(f"attnstore_{name}_total", (("namespace", "ns"),))] == 0
    for method in RPC_METHODS:
        for code in RPC_CODES:
            assert samples[("attnstore_rpcs_total", (("code", code), ("method", method)))] == 0
    assert samples[("attnstore_bytes_streamed_total", (("kind", "outputs"),))] == 0


def test_every_code_the_daemon_answers_has_a_counter_from_the_start() -> None:
    errors = [cls for cls in vars(attnstore.errors).values() if isinstance(cls, type) and issubclass(cls, Exception)]
    # Built without __init__: status_for decides by class alone, and some classes take keyword arguments.
    answered = {status_for(cls.__new__(cls))[0].name for cls in [*errors, RuntimeError]}
    assert answered | {"OK", "CANCELLED", "UNAUTHENTICATED"} <= set(RPC_CODES)
    assert {status_for(cls("x"))[0].name for cls in ROW_ERRORS} == set(ROW_ERROR_CODES)


def test_refused_calls_are_counted_by_method_and_code() -> None:
    metrics = DaemonMetrics()
    metrics.refused("Stats", "UNAUTHENTICATED")
    metrics.refused("Delete", "PERMISSION_DENIED")
    samples = _samples(metrics)
    assert samples[("attnstore_rpcs_total", (("code", "UNAUTHENTICATED"), ("method", "Stats")))] == 1
    assert samples[("attnstore_rpcs_total", (("code", "PERMISSION_DENIED"), ("method", "Delete")))] == 1
    assert samples[("attnstore_rpcs_in_flight", ())] == 0


def test_process_and_platform_collectors_are_in_the_daemons_registry() -> None:
    names = {name for name, _ in _samples(DaemonMetrics())}
    assert {"process_resident_memory_bytes", "process_cpu_seconds_total", "python_info"} <= names


def test_redis_figures_are_read_at_scrape_time_and_absent_for_a_store_no_one_shares() -> None:
    assert not any(name.startswith(("attnstore_redis", "attnstore_follower")) for name, _ in _samples(DaemonMetrics()))
    redis = RedisStats(RetryTotals(retries=5, waited_out=2, gave_up=1),
                       (NodeMemory("127.0.0.1:7000", 1000, 0), NodeMemory("127.0.0.1:7001", 2000, 4096)))
    metrics = DaemonMetrics(follower=lambda: FollowerStatus(0.1, 7, 3), redis=lambda: redis)
    samples = _samples(metrics)
    assert samples[("attnstore_follower_seconds_since_read", ())] == 0.1
    assert samples[("attnstore_follower_changes_applied_total", ())] == 7
    assert samples[("attnstore_follower_failed_reads_total", ())] == 3
    assert samples[("attnstore_redis_retries_total", ())] == 5
    assert samples[("attnstore_redis_waited_out_total", ())] == 2
    assert samples[("attnstore_redis_gave_up_total", ())] == 1
    assert samples[("attnstore_redis_used_memory_bytes", (("node", "127.0.0.1:7001"),))] == 2000
    assert samples[("attnstore_redis_maxmemory_bytes", (("node", "127.0.0.1:7001"),))] == 4096
    assert samples[("attnstore_redis_maxmemory_bytes", (("node", "127.0.0.1:7000"),))] == 0
    names = {name.removesuffix("_total") for name, _ in samples}
    assert set(REDIS_METRIC_NAMES) <= names


def test_a_failing_redis_source_does_not_break_the_scrape() -> None:
    def unreachable() -> None:
        raise attnstore.errors.UnavailableError("Redis is unavailable")

    text = DaemonMetrics(redis=unreachable).render()
    assert b"attnstore_rpcs_in_flight" in text and b"attnstore_redis" not in text


def test_the_followers_skipped_records_and_errors_are_exported() -> None:
    metrics = DaemonMetrics(follower=lambda: FollowerStatus(0.1, 7, 3, skipped_records=2, errors=1))
    samples = _samples(metrics)
    assert samples[("attnstore_follower_skipped_records_total", ())] == 2
    assert samples[("attnstore_follower_errors_total", ())] == 1


def test_errors_background_threads_survived_are_counted_by_thread() -> None:
    metrics = DaemonMetrics(background=lambda: {"attnstore-prefetch": 2, "attnstore-watchdog": 0})
    samples = _samples(metrics)
    assert samples[("attnstore_background_errors_total", (("thread", "attnstore-prefetch"),))] == 2
    assert samples[("attnstore_background_errors_total", (("thread", "attnstore-watchdog"),))] == 0
