"""Stateless daemons on one real 3-master, 3-replica Redis Cluster: what one serves, the other serves too.

Two ``attnstore serve --store redis://...?cluster=1`` processes share one store.
Exact hits need no index and are current at once; map hits go through each
daemon's own index, which follows the store's log every
``attnstore.service.follower.FOLLOW_SECONDS`` (the staleness bound).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from daemon import ADMIN_TOKEN, DaemonProcess
from redis_servers import free_port
from server_fixtures import FP, LAYOUT
from store_helpers import make_entry

from attnstore.protocol.records import LookupBatch
from attnstore.protocol.remote import RemoteStore, lookup_request
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.service.follower import FOLLOW_SECONDS

LENGTH = 8
# The staleness bound with room for a loaded CI machine: one follow interval, the log read, the index update.
BOUND_SECONDS = FOLLOW_SECONDS + 1.5


@pytest.fixture(scope="module")
def store_url(redis_cluster) -> str:
    return redis_cluster.url()


@pytest.fixture(scope="module")
def daemons(store_url: str, tmp_path_factory: pytest.TempPathFactory):
    started = []
    try:
        for name in ("a", "b"):
            started.append(DaemonProcess(store_url, tmp_path_factory.mktemp(f"daemon-{name}")).start())
        yield started
    finally:
        for process in started:
            assert process.stop() == 0, process.log()


def _lookup(remote: RemoteStore, seeds: list[int], *, exact: bool) -> list[tuple[int, int | None]]:
    entries = [make_entry(LAYOUT, LENGTH, seed) for seed in seeds]
    batch = LookupBatch(
        "ns", FP, np.stack([e.feature for e in entries]), [LENGTH] * len(seeds),
        token_hashes=[e.token_hash if exact else None for e in entries], max_distance=0.01,
    )
    result = remote.lookup(lookup_request(batch))
    return [(m.kind, m.entry_id if m.kind != pb.MATCH_KIND_MISS else None) for m in result.matches]


def _until(check, seconds: float) -> float:
    """Seconds until ``check()`` holds; fails past ``seconds``."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < seconds, f"not within {seconds:g} s"
        time.sleep(0.02)
    return time.monotonic() - start


def test_an_entry_ingested_through_one_daemon_is_a_hit_through_the_other_within_the_staleness_bound(daemons):
    a, b = daemons
    with a.client() as through_a, b.client() as through_b:
        through_a.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
        (entry_id,) = through_a.ingest("ns", FP, [make_entry(LAYOUT, LENGTH, 1)]).entry_ids
        assert _lookup(through_b, [1], exact=True) == [(pb.MATCH_KIND_EXACT, entry_id)]  # no index involved
        waited = _until(lambda: _lookup(through_b, [1], exact=False) == [(pb.MATCH_KIND_MAP, entry_id)],
                        BOUND_SECONDS)
        maps = through_b.lookup(lookup_request(LookupBatch(
            "ns", FP, make_entry(LAYOUT, LENGTH, 1).feature[None], [LENGTH], max_distance=0.01,
        ))).maps
    np.testing.assert_array_equal(maps[0], make_entry(LAYOUT, LENGTH, 1).maps.astype(np.float16))
    assert waited < BOUND_SECONDS


def test_an_entry_deleted_through_one_daemon_is_a_miss_through_the_other_within_the_staleness_bound(daemons):
    a, b = daemons
    with a.client() as through_a, b.client() as through_b:
        through_a.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
        (entry_id,) = through_a.ingest("ns", FP, [make_entry(LAYOUT, LENGTH, 2)]).entry_ids
        _until(lambda: _lookup(through_b, [2], exact=False) == [(pb.MATCH_KIND_MAP, entry_id)], BOUND_SECONDS)
        assert through_a.delete("ns", [entry_id]) == 1
        assert _lookup(through_b, [2], exact=True)[0][0] != pb.MATCH_KIND_EXACT  # the exact tier is current at once
        _until(lambda: _lookup(through_b, [2], exact=False) == [(pb.MATCH_KIND_MISS, None)], BOUND_SECONDS)


def test_an_entry_redis_lost_is_a_miss_through_either_daemon_never_an_error(daemons, redis_cluster, store_url):
    from attnstore.store.redis.mapstore import RedisMapStore

    a, b = daemons
    with a.client() as through_a, b.client() as through_b:
        through_a.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
        (entry_id,) = through_a.ingest("ns", FP, [make_entry(LAYOUT, LENGTH, 3)]).entry_ids
        _until(lambda: _lookup(through_b, [3], exact=False) == [(pb.MATCH_KIND_MAP, entry_id)], BOUND_SECONDS)
        with RedisMapStore.open(store_url) as store:  # what Redis's maxmemory eviction does: the whole hash goes
            store._redis.client.delete(store._keys.entry("ns", entry_id))
        assert _lookup(through_b, [3], exact=True)[0][0] != pb.MATCH_KIND_EXACT
        rows = through_a.lookup(lookup_request(LookupBatch(
            "ns", FP, make_entry(LAYOUT, LENGTH, 3).feature[None], [LENGTH], max_distance=0.01,
        )))
        assert 0 not in rows.maps  # a proposed entry that is gone sends no maps: the client computes the row
        # Found gone, it is forgotten: both indexes drop it.
        _until(lambda: _lookup(through_b, [3], exact=False) == [(pb.MATCH_KIND_MISS, None)], BOUND_SECONDS)


def test_a_restarted_daemon_rebuilds_its_indexes_from_the_store_and_serves_the_same_hits(store_url, tmp_path):
    url = store_url.replace("prefix=", "prefix=restart")
    first = DaemonProcess(url, tmp_path).start()
    try:
        with first.client() as remote:
            remote.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
            ids = remote.ingest("ns", FP, [make_entry(LAYOUT, LENGTH, s) for s in (4, 5, 6)]).entry_ids
            before = _lookup(remote, [4, 5, 6], exact=False)
    finally:
        assert first.stop() == 0, first.log()
    assert before == [(pb.MATCH_KIND_MAP, i) for i in ids]
    second = DaemonProcess(url, tmp_path).start()
    try:
        with second.client() as remote:
            assert _lookup(remote, [4, 5, 6], exact=False) == before
            assert _lookup(remote, [4, 5, 6], exact=True) == [(pb.MATCH_KIND_EXACT, i) for i in ids]
    finally:
        assert second.stop() == 0, second.log()


def _serve(store: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "attnstore_tools.cli", "serve", "--store", store, "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60,
    )


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("redis://127.0.0.1:6379/?cluster=maybe", "cluster must be 1 or 0"),
        ("redis:///?cluster=1", "needs a host"),
        ("redis://127.0.0.1:6379/3?cluster=1", "database 0 only"),
        ("redis://127.0.0.1:6379/?prefix=a{b}", "prefix must be"),
        ("memcached://127.0.0.1:11211", "a folder or a URL starting with"),
    ],
)
def test_serve_refuses_a_bad_store_url_in_one_line_naming_it(url: str, named: str) -> None:
    result = _serve(url)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert last.startswith("attnstore: error: ") and named in last and url in last


def test_serve_on_an_unreachable_redis_exits_with_one_line_saying_redis_is_unavailable(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/"
    result = _serve(url)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "Redis is unavailable" in last and f"127.0.0.1:{url.split(':')[2].strip('/')}" in last


def _lookups_served(process: DaemonProcess) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{process.metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "attnstore_lookups"
               for s in f.samples if s.name.endswith("_total"))


def test_a_client_spreads_calls_over_two_daemons_and_one_killed_costs_retries_not_errors(redis_server, tmp_path):
    from attnstore_client.connection import connect

    url = redis_server.url()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = DaemonProcess(url, tmp_path / "a"), DaemonProcess(url, tmp_path / "b")
    try:
        a.start()
        b.start()
        both = f"127.0.0.1:{a.port},127.0.0.1:{b.port}"
        with RemoteStore(both, token=ADMIN_TOKEN) as remote:
            remote.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
            ids = remote.ingest("ns", FP, [make_entry(LAYOUT, LENGTH, s) for s in range(4)]).entry_ids
            for _ in range(20):
                assert _lookup(remote, [0, 1, 2, 3], exact=True) == [(pb.MATCH_KIND_EXACT, i) for i in ids]
            assert _lookups_served(a) > 0 and _lookups_served(b) > 0  # round_robin used both
            a.stop(signal.SIGKILL)
            node = connect(f"grpc://{both}", token=ADMIN_TOKEN)
            try:
                for _ in range(30):  # every call lands on b, some after a retry: none fails
                    assert _lookup(remote, [0, 1, 2, 3], exact=True) == [(pb.MATCH_KIND_EXACT, i) for i in ids]
                    hashes = [make_entry(LAYOUT, LENGTH, s).token_hash for s in range(4)]
                    assert sorted(node.exact("ns", FP, hashes, [LENGTH] * 4, timeout=10)) == [0, 1, 2, 3]
            finally:
                node.close()
    finally:
        a.stop()
        assert b.stop() == 0, b.log()
