"""A daemon whose Redis loses its data, or starts evicting more than entries, while it runs (real processes).

Redis without persistence SIGKILLed and restarted empty, then a different corpus
ingested into the same namespace (ids restart at 1): the daemon must serve the
new entries, not its DRAM cache's and indexes' copies of the old ones, and say so
in its log, health and metrics. An ``allkeys-*`` policy set with CONFIG SET on a
running Redis turns writes away and health NOT_SERVING until it is undone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from attnstore.errors import StoreUnsafeError
from attnstore.protocol.records import LookupBatch
from attnstore.protocol.requests import lookup_request
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore_client.connection.daemon import DaemonClient
from attnstore_tools.admin.train_projector import fetch_maps
from tests.support.daemon import ADMIN_TOKEN, READ_TOKEN, DaemonProcess
from tests.support.redis_servers import RedisServer, unique_prefix
from tests.support.server_fixtures import FP, LAYOUT, LIMITS
from tests.support.stores import make_entry
from tests.support.wait import wait_until

LENGTH = 8


def _fill(admin: DaemonClient, seeds: list[int]) -> list[int]:
    admin.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT, limits=LIMITS)
    return admin.ingest("ns", FP, [make_entry(LAYOUT, LENGTH, seed) for seed in seeds]).entry_ids


def _metric(daemon: DaemonProcess, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=5).read().decode()
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def _map_hits(reader: DaemonClient, seeds: list[int]) -> list[int | None]:
    entries = [make_entry(LAYOUT, LENGTH, seed) for seed in seeds]
    batch = LookupBatch("ns", FP, np.stack([e.feature for e in entries]), [LENGTH] * len(seeds), max_distance=0.01)
    matches = reader.lookup(lookup_request(batch)).matches
    return [m.entry_id if m.kind == pb.MATCH_KIND_MAP else None for m in matches]


def test_redis_restarted_empty_and_refilled_serves_the_new_entries_not_the_daemons_cached_ones(
    redis: RedisServer, tmp_path: Path
) -> None:
    daemon = DaemonProcess(redis.url(unique_prefix()), tmp_path).start()
    try:
        with daemon.client(ADMIN_TOKEN) as admin, daemon.client(READ_TOKEN) as reader:
            old = _fill(admin, [0, 1, 2, 3])
            assert _map_hits(reader, [0, 1, 2, 3]) == old
            for _ in range(3):  # served three times: in the DRAM cache from the second serve on
                fetch_maps(reader, "ns", FP, [old[0]])
            wait_until(lambda: reader.stats().dram_entries >= 1, 30.0, what="entry 1 in the DRAM cache")
            redis.kill()
            redis.restart()
            wait_until(lambda: _fill(admin, [10, 11, 12, 13]) == old, 30.0, what="the new corpus under the same ids",
                       poll=0.1)  # each check ingests
            wait_until(lambda: _map_hits(reader, [10, 11, 12, 13]) == old, 30.0, what="the new entries searchable")
            assert _map_hits(reader, [0, 1, 2, 3]) == [None] * 4  # nothing of the old index is left
            (maps,) = fetch_maps(reader, "ns", FP, [old[0]])
            np.testing.assert_array_equal(maps, make_entry(LAYOUT, LENGTH, 10).maps.astype(np.float16))
            assert _metric(daemon, "attnstore_redis_store_resets_total") >= 1
            assert reader.health() == "SERVING"
    finally:
        assert daemon.stop() == 0, daemon.log()
    log = daemon.log()
    assert "event=store_reset" in log and "health=NOT_SERVING" in log


def test_a_store_flushed_under_a_daemon_without_create_refuses_writes_and_is_not_serving(
    redis: RedisServer, tmp_path: Path
) -> None:
    url = redis.url(unique_prefix())
    first = tmp_path / "first"
    first.mkdir()
    assert DaemonProcess(url, first).start().stop() == 0  # makes the store, then goes
    daemon = DaemonProcess(url, tmp_path, create=False).start()
    try:
        with daemon.client(ADMIN_TOKEN) as admin:
            _fill(admin, [0, 1])
            with redis.client() as raw:
                raw.flushall()
            wait_until(lambda: admin.health() == "NOT_SERVING", 30.0, what="health NOT_SERVING")
            with pytest.raises(StoreUnsafeError, match="FAILED_PRECONDITION.*the store's marker is gone"):
                _fill(admin, [2])
            assert admin.stats().dram_entries == 0
            assert _metric(daemon, "attnstore_redis_store_unsafe") == 1
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_an_allkeys_policy_set_on_a_running_redis_refuses_writes_until_it_is_undone(
    redis: RedisServer, tmp_path: Path
) -> None:
    daemon = DaemonProcess(redis.url(unique_prefix()), tmp_path).start()
    try:
        with daemon.client(ADMIN_TOKEN) as admin, redis.client() as raw:
            _fill(admin, [0])
            raw.config_set("maxmemory-policy", "allkeys-lru")
            wait_until(lambda: admin.health() == "NOT_SERVING", 30.0, what="health NOT_SERVING under allkeys-lru")
            with pytest.raises(StoreUnsafeError, match="FAILED_PRECONDITION.*maxmemory-policy allkeys-lru"):
                admin.ingest("ns", FP, [make_entry(LAYOUT, LENGTH, 5)])
            assert _map_hits(admin, [0]) != [None]  # reads go on
            raw.config_set("maxmemory-policy", "volatile-lru")
            wait_until(lambda: admin.health() == "SERVING", 30.0, what="health SERVING again")
            assert admin.ingest("ns", FP, [make_entry(LAYOUT, LENGTH, 5)]).entries == 1
    finally:
        assert daemon.stop() == 0, daemon.log()
    log = daemon.log()
    assert "event=redis_policy_unsafe policy=allkeys-lru" in log and "event=store_sound" in log
