"""Stateless daemons on one real 3-master, 3-replica Redis Cluster: what one serves, the other serves too.

Two ``attnstore serve --store redis://...?cluster=1`` processes share one store (entries and chunks).
Exact hits need no index and are current at once; map hits go through each
daemon's own index, which follows the store's log every
``attnstore.service.follower.FOLLOW_SECONDS`` (the staleness bound).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from attnstore.errors import FingerprintMismatchError
from attnstore.protocol.chunks import ChunkLayout, StoredChunk
from attnstore.protocol.keys import chunk_key
from attnstore.protocol.records import LookupBatch, NamespaceLayout, NewEntry
from attnstore.protocol.requests import lookup_request
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.v1 import attnstore_pb2_grpc as pb_grpc
from attnstore.server.metrics import REDIS_METRIC_NAMES
from attnstore.service.follower import FOLLOW_SECONDS
from attnstore_client.connection import connect
from attnstore_client.connection.channel import open_channel
from attnstore_client.connection.daemon import DaemonClient
from tests.support.daemon import ADMIN_TOKEN, OTHER_WRITE_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess
from tests.support.redis_servers import free_port
from tests.support.server_fixtures import FP, LAYOUT
from tests.support.stores import make_entry
from tests.support.wait import wait_until

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


def _lookup(remote: DaemonClient, seeds: list[int], *, exact: bool) -> list[tuple[int, int | None]]:
    entries = [make_entry(LAYOUT, LENGTH, seed) for seed in seeds]
    batch = LookupBatch(
        "ns", FP, np.stack([e.feature for e in entries]), [LENGTH] * len(seeds),
        token_hashes=[e.token_hash if exact else None for e in entries], max_distance=0.01,
    )
    result = remote.lookup(lookup_request(batch))
    return [(m.kind, m.entry_id if m.kind != pb.MATCH_KIND_MISS else None) for m in result.matches]


def _until(check, seconds: float, what: str) -> float:
    """Seconds until ``check()`` holds (``wait_until``, which fails past ``seconds`` naming ``what``)."""
    start = time.monotonic()
    wait_until(check, seconds, what)
    return time.monotonic() - start


def test_an_entry_ingested_through_one_daemon_is_a_hit_through_the_other_within_the_staleness_bound(daemons):
    a, b = daemons
    with a.client() as through_a, b.client() as through_b:
        through_a.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
        (entry_id,) = through_a.ingest("ns", FP, [make_entry(LAYOUT, LENGTH, 1)]).entry_ids
        assert _lookup(through_b, [1], exact=True) == [(pb.MATCH_KIND_EXACT, entry_id)]  # no index involved
        waited = _until(lambda: _lookup(through_b, [1], exact=False) == [(pb.MATCH_KIND_MAP, entry_id)],
                        BOUND_SECONDS, "the entry a map hit through b")
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
        _until(lambda: _lookup(through_b, [2], exact=False) == [(pb.MATCH_KIND_MAP, entry_id)], BOUND_SECONDS,
               "the entry a map hit through b")
        assert through_a.delete("ns", [entry_id]) == 1
        assert _lookup(through_b, [2], exact=True)[0][0] != pb.MATCH_KIND_EXACT  # the exact tier is current at once
        _until(lambda: _lookup(through_b, [2], exact=False) == [(pb.MATCH_KIND_MISS, None)], BOUND_SECONDS,
               "the entry a miss through b")


def test_chunks_put_through_one_daemon_are_matched_and_fetched_whole_through_the_other(daemons):
    a, b = daemons
    layout = ChunkLayout(layers=LAYOUT.layers, kv_heads=2, head_dim=4, dtype="float32")
    rng = np.random.default_rng(5)
    ids = [rng.integers(0, 1000, size=n) for n in (3, 9)]
    chunks = [StoredChunk(chunk_key(None, i), rng.standard_normal((layout.layers, *layout.layer_shape(len(i))),
                                                                  np.float32), token_ids=i) for i in ids]
    with a.client() as admin:  # the namespace records the model's chunk layout
        admin.create_namespace("chunked", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT, chunks=layout)
    # Two writers asked, through either daemon: the counts live in Redis, so the put through a is admitted.
    with connect(f"grpc://{b.target}", token=OTHER_WRITE_TOKEN) as other:
        other.match_chunks("chunked", FP, layout, [c.key for c in chunks], timeout=10)
    with connect(f"grpc://{a.target}", token=WRITE_TOKEN) as writer:
        writer.match_chunks("chunked", FP, layout, [c.key for c in chunks], timeout=10)
        assert writer.put_chunks("chunked", FP, layout, chunks, timeout=10).stored == 2
    with connect(f"grpc://{b.target}", token=READ_TOKEN) as reader:  # no index involved: current at once
        assert reader.match_chunks("chunked", FP, layout, [c.key for c in chunks], timeout=10) == [3, 9]
        got = reader.fetch_chunks("chunked", FP, layout, [c.key for c in chunks], timeout=10)
        with pytest.raises(FingerprintMismatchError, match="kv_heads=1"):
            reader.match_chunks("chunked", FP, ChunkLayout(LAYOUT.layers, 1, 8, "float32"), [chunks[0].key],
                                timeout=10)
    assert all(isinstance(g, np.ndarray) and np.array_equal(g, c.kv) for g, c in zip(got, chunks, strict=True))


def test_an_entry_redis_lost_is_a_miss_through_either_daemon_never_an_error(daemons, redis_cluster, store_url):
    from attnstore.store.redis.mapstore import RedisMapStore

    a, b = daemons
    with a.client() as through_a, b.client() as through_b:
        through_a.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
        (entry_id,) = through_a.ingest("ns", FP, [make_entry(LAYOUT, LENGTH, 3)]).entry_ids
        _until(lambda: _lookup(through_b, [3], exact=False) == [(pb.MATCH_KIND_MAP, entry_id)], BOUND_SECONDS,
               "the entry a map hit through b")
        with RedisMapStore.open(store_url) as store:  # what Redis's maxmemory eviction does: the whole hash goes
            store._redis.client.delete(store._keys.entry("ns", entry_id))
        assert _lookup(through_b, [3], exact=True)[0][0] != pb.MATCH_KIND_EXACT
        rows = through_a.lookup(lookup_request(LookupBatch(
            "ns", FP, make_entry(LAYOUT, LENGTH, 3).feature[None], [LENGTH], max_distance=0.01,
        )))
        assert 0 not in rows.maps  # a proposed entry that is gone sends no maps: the client computes the row
        # Found gone, it is forgotten: both indexes drop it.
        _until(lambda: _lookup(through_b, [3], exact=False) == [(pb.MATCH_KIND_MISS, None)], BOUND_SECONDS,
               "the entry a miss through b")


def _metrics(process: DaemonProcess) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{process.metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_a_daemon_on_redis_exports_its_follower_lag_redis_retries_and_each_primarys_memory(daemons, redis_cluster):
    a, b = daemons
    with a.client() as through_a, b.client() as through_b:
        through_a.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
        # b must index "ns" before a's ingest below: a namespace b finds new is built whole from the store, and
        # an ingest read in that build is never counted as a change applied (alone, this test made "ns" here).
        (first,) = through_a.ingest("ns", FP, [make_entry(LAYOUT, LENGTH, 17)]).entry_ids
        _until(lambda: _lookup(through_b, [17], exact=False) == [(pb.MATCH_KIND_MAP, first)], BOUND_SECONDS,
               "the first entry a map hit through b")
        before = _metrics(b)
        assert {name.removesuffix("_total") for name, _ in before} >= set(REDIS_METRIC_NAMES)
        through_a.ingest("ns", FP, [make_entry(LAYOUT, LENGTH, 7)])
    applied = ("attnstore_follower_changes_applied_total", ())
    _until(lambda: _metrics(b)[applied] > before[applied], BOUND_SECONDS, "a's ingest applied by b")
    after = _metrics(b)
    assert after[("attnstore_follower_seconds_since_read", ())] < BOUND_SECONDS
    assert after[("attnstore_follower_failed_reads_total", ())] == 0
    assert after[("attnstore_redis_gave_up_total", ())] == 0
    used = {labels[0][1]: value for (name, labels), value in after.items()
            if name == "attnstore_redis_used_memory_bytes"}
    masters = {server.address for server in redis_cluster.servers if server.client().info("replication")["role"]
               == "master"}
    assert set(used) == masters and all(value > 0 for value in used.values())


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
        with DaemonClient(both, token=ADMIN_TOKEN) as remote:
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


# ---- a daemon SIGKILLed while calls are in flight ------------------------------------------------------------

# Maps big enough (512 KiB an entry, stored fp16) that a stream of many rows outlasts gRPC's and the socket's
# buffers: the daemon is still sending when it is killed.
BIG = NamespaceLayout(layers=4, heads=4, causal=True, hidden=8, feature_dim=16)
BIG_LENGTH = 128


def _metric(process: DaemonProcess, name: str) -> float:
    return sum(value for (sample, _), value in _metrics(process).items() if sample == name)


@pytest.fixture
def two_daemons(redis_cluster, tmp_path: Path):
    """Two daemons on one fresh store of the 3-master cluster, the namespace "big" made, and their list address."""
    url = redis_cluster.url()
    started: list[DaemonProcess] = []
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            started.append(DaemonProcess(url, tmp_path / name).start())
        with started[0].client() as remote:
            remote.create_namespace("big", model="tiny-synthetic", fingerprint=FP, layout=BIG)
        yield started, ",".join(f"127.0.0.1:{d.port}" for d in started)
    finally:
        for process in started:
            process.stop(signal.SIGKILL)


class _KillsItsDaemonAfterTheFirstMessage(grpc.UnaryStreamClientInterceptor):
    """SIGKILLs the daemon serving the first stream it sees, once that stream's first message has arrived."""

    def __init__(self, daemons: list[DaemonProcess]) -> None:
        self._daemons = daemons
        self.killed: DaemonProcess | None = None

    def intercept_unary_stream(self, continuation, client_call_details, request):
        call = continuation(client_call_details, request)
        return call if self.killed is not None else _FirstMessageHook(call, self._kill)

    def _kill(self) -> None:
        # One call in flight: the daemon serving it is the one counting an RPC in flight.
        (serving,) = [d for d in self._daemons if _metric(d, "attnstore_rpcs_in_flight") == 1]
        serving.stop(signal.SIGKILL)
        self.killed = serving


class _FirstMessageHook:
    """A stream call that runs ``hook`` once its first message has arrived, before handing it on."""

    def __init__(self, call, hook) -> None:
        self._call = call
        self._hook: Callable[[], None] | None = hook

    def __iter__(self):
        return self

    def __next__(self):
        message = next(self._call)
        hook, self._hook = self._hook, None
        if hook is not None:
            hook()
        return message

    def cancel(self) -> bool:
        return self._call.cancel()


def _ingest_big(remote: DaemonClient, seeds: list[int]) -> list[int]:
    return list(remote.ingest("big", FP, [make_entry(BIG, BIG_LENGTH, s) for s in seeds]).entry_ids)


def _indexed_by_each(daemons: list[DaemonProcess], entries: dict[int, NewEntry]) -> bool:
    """Whether each daemon's own index finds every one of ``entries`` (id: entry): a map hit is due from either."""
    ids = list(entries)
    batch = LookupBatch("big", FP, np.stack([entries[i].feature for i in ids]), [BIG_LENGTH] * len(ids),
                        max_distance=0.01)
    for daemon in daemons:
        with daemon.client() as remote:
            matches = remote.lookup(lookup_request(batch, want_maps=False)).matches
        if [(m.kind, m.entry_id) for m in matches] != [(pb.MATCH_KIND_MAP, i) for i in ids]:
            return False
    return True


def test_a_lookup_whose_daemon_is_killed_mid_stream_is_sent_again_and_answered_whole_by_the_other(two_daemons):
    daemons, both = two_daemons
    killer = _KillsItsDaemonAfterTheFirstMessage(daemons)
    with DaemonClient(both, token=ADMIN_TOKEN) as seeding:
        (entry_id,) = _ingest_big(seeding, [1])
    wait_until(lambda: _indexed_by_each(daemons, {entry_id: make_entry(BIG, BIG_LENGTH, 1)}), 30,
               "the entry in both daemons' indexes")
    entry = make_entry(BIG, BIG_LENGTH, 1)
    rows = 48  # 24 MiB of maps in one stream
    batch = LookupBatch("big", FP, np.stack([entry.feature] * rows), [BIG_LENGTH] * rows, max_distance=0.01)
    channel = grpc.intercept_channel(open_channel(f"grpc://{both}"), killer)
    with DaemonClient(both, token=ADMIN_TOKEN, channel=channel) as remote:
        result = remote.lookup(lookup_request(batch))
        assert killer.killed is not None and remote.streams_retried == 1
    assert [(m.kind, m.entry_id) for m in result.matches] == [(pb.MATCH_KIND_MAP, entry_id)] * rows
    assert sorted(result.maps) == list(range(rows)) and not result.row_errors
    for maps in result.maps.values():
        np.testing.assert_array_equal(maps, entry.maps.astype(np.float16))


def test_a_fetch_maps_stream_whose_daemon_is_killed_mid_stream_delivers_every_layer_from_the_other(two_daemons):
    from attnstore_client.connection import connect

    daemons, both = two_daemons
    killer = _KillsItsDaemonAfterTheFirstMessage(daemons)
    with DaemonClient(both, token=ADMIN_TOKEN) as seeding:
        ids = _ingest_big(seeding, [2, 3])
    rows = [(ids[i % 2], BIG_LENGTH) for i in range(48)]
    node = connect(f"grpc://{both}", token=ADMIN_TOKEN)
    try:
        # The interceptor goes on the connection's own channel: what the node sends is unchanged.
        remote = node._remote  # type: ignore[attr-defined]
        remote._stub = pb_grpc.AttnStoreStub(grpc.intercept_channel(remote._channel, killer))
        stream = node.fetch_maps("big", FP, rows, timeout=30)
        layers = [[stream.layer(row, layer) for layer in range(BIG.layers)] for row in range(len(rows))]
        stream.wait()
        assert killer.killed is not None and stream.failed() == {} and node.streams_retried == 1
    finally:
        node.close()
    for (entry_id, _), row_layers in zip(rows, layers, strict=True):
        want = make_entry(BIG, BIG_LENGTH, 2 + ids.index(entry_id)).maps.astype(np.float16)
        np.testing.assert_array_equal(np.stack(row_layers), want)


def _load(
    remote: DaemonClient, node, entries: dict[int, NewEntry], stop: threading.Event, tally: Counter[str],
    ended: Counter[int], problems: list[str], lock: threading.Lock, seed: int,
) -> None:
    """Exact lookups, map lookups (maps streamed) and the node's Search + FetchMaps, checked, until ``stop``;
    ``tally`` counts the calls answered by kind, ``ended`` the calls ended (answered or failed) by worker (seed)."""
    rng = np.random.default_rng(seed)
    ids = list(entries)
    while not stop.is_set():
        picks = [ids[i] for i in rng.integers(0, len(ids), size=8)]
        kind = ("exact", "map", "node")[int(rng.integers(0, 3))]
        try:
            if kind == "node":
                wrong = _node_call(node, picks, entries)
            else:
                wrong = _lookup_call(remote, picks, entries, exact=kind == "exact")
        except Exception as exc:  # every failure is counted and shown, none ends the load
            with lock:
                problems.append(f"{kind}: {exc!r}")
                ended[seed] += 1
            continue
        with lock:
            tally[kind] += 1
            ended[seed] += 1
            if wrong:
                problems.append(f"{kind}: {wrong}")


def _lookup_call(remote: DaemonClient, picks: list[int], entries: dict[int, NewEntry], *, exact: bool) -> str:
    rows = [entries[i] for i in picks]
    result = remote.lookup(lookup_request(LookupBatch(
        "big", FP, np.stack([e.feature for e in rows]), [BIG_LENGTH] * len(rows),
        token_hashes=[e.token_hash if exact else None for e in rows], max_distance=0.01,
    ), want_maps=not exact))
    want_kind = pb.MATCH_KIND_EXACT if exact else pb.MATCH_KIND_MAP
    if [(m.kind, m.entry_id) for m in result.matches] != [(want_kind, i) for i in picks] or result.row_errors:
        return f"matches {[(m.kind, m.entry_id) for m in result.matches]} for {picks}, errors {result.row_errors}"
    got = result.outputs if exact else result.maps
    for row, entry in enumerate(rows):
        want = entry.outputs if exact else entry.maps
        if row not in got or not np.array_equal(got[row], np.asarray(want).astype(np.float16)):
            return f"row {row} (entry {picks[row]}) is not the entry's {'outputs' if exact else 'maps'}"
    return ""


def _node_call(node, picks: list[int], entries: dict[int, NewEntry]) -> str:
    rows = [entries[i] for i in picks]
    matches = node.search(LookupBatch(
        "big", FP, np.stack([e.feature for e in rows]), [BIG_LENGTH] * len(rows), max_distance=0.01,
    ), timeout=30)
    if [m.entry_id for m in matches] != picks:
        return f"search found {[m.entry_id for m in matches]} for {picks}"
    stream = node.fetch_maps("big", FP, [(i, BIG_LENGTH) for i in picks], timeout=30)
    try:
        for row, entry in enumerate(rows):
            got = np.stack([stream.layer(row, layer) for layer in range(BIG.layers)])
            if not np.array_equal(got, entry.maps.astype(np.float16)):
                return f"FetchMaps row {row} (entry {picks[row]}) is not the entry's maps"
    finally:
        stream.close()
    return ""


def test_one_daemon_sigkilled_mid_load_costs_no_errors_and_no_wrong_results(two_daemons):
    from attnstore_client.connection import connect

    daemons, both = two_daemons
    with DaemonClient(both, token=ADMIN_TOKEN) as seeding:
        seeds = list(range(10, 22))
        entries = dict(zip(_ingest_big(seeding, seeds), (make_entry(BIG, BIG_LENGTH, s) for s in seeds), strict=True))
    wait_until(lambda: _indexed_by_each(daemons, entries), 30, "every entry in both daemons' indexes")
    stop, lock = threading.Event(), threading.Lock()
    tally: Counter[str] = Counter()
    ended: Counter[int] = Counter()
    problems: list[str] = []
    kinds = {"exact", "map", "node"}

    def counts() -> tuple[Counter[str], Counter[int]]:
        with lock:
            return Counter(tally), Counter(ended)

    def shown() -> str:
        return f"calls answered {tally}, problems {problems[:3]}"

    with DaemonClient(both, token=ADMIN_TOKEN, timeout=30) as remote:
        node = connect(f"grpc://{both}", token=ADMIN_TOKEN)
        workers = [threading.Thread(target=_load, args=(remote, node, entries, stop, tally, ended, problems, lock,
                                                        seed)) for seed in range(4)]
        try:
            for worker in workers:
                worker.start()
            wait_until(lambda: set(counts()[0]) == kinds, 60, lambda: f"calls of every kind answered; {shown()}")
            at_kill, ended_at_kill = counts()
            before = sum(at_kill.values())
            daemons[0].stop(signal.SIGKILL)  # calls of every kind are in flight on it, streams among them
            # Every worker's call in flight at the kill has ended, and a call it sent after; every kind answered
            # since the kill.
            wait_until(lambda: all(counts()[1][seed] >= ended_at_kill[seed] + 2 for seed in range(4))
                       and all(counts()[0][kind] > at_kill[kind] for kind in kinds), 60,
                       lambda: f"two calls ended by each worker and a call of each kind answered since the kill;"
                               f" {shown()}")
        finally:
            stop.set()
            for worker in workers:
                worker.join(60)
            node.close()
    assert problems == []
    assert before > 0 and sum(tally.values()) > before and set(tally) == kinds, tally
