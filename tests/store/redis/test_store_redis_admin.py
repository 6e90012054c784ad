"""The Redis backend's admin side on a real redis-server: verify, compaction, stats, backup to LMDB and back,
the two-phase ingest, and Redis errors as AttnStore's."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from attnstore.errors import ConfigError, EntryNotFoundError, UnavailableError
from attnstore.store import LmdbMapStore
from attnstore.store.redis.connection import RedisLocation, RetryTotals
from attnstore.store.redis.keys import encode_entry
from attnstore.store.redis.mapstore import RedisMapStore
from attnstore.store.redis.urls import RedisSettings
from attnstore.store.validate import prepare_entry
from tests.support.pause import stop
from tests.support.redis_servers import RedisServer, require_redis
from tests.support.stores import make_entry, projector_blob, small_layout


@pytest.fixture
def store(redis_server):
    with RedisMapStore.open(redis_server.url(), create=True, settings=RedisSettings(orphan_grace_seconds=0)) as opened:
        opened.create_namespace("ns", model="tiny", fingerprint="f" * 64, layout=small_layout())
        yield opened


def _write_unregistered(store: RedisMapStore, seed: int) -> int:
    """What a crash between an ingest's two phases leaves: an entry hash with a fresh id, registered nowhere."""
    state = store._state("ns")
    entry = prepare_entry(make_entry(small_layout(), 6, seed=seed), state.layout, 0)
    entry_id = int(store._redis.client.incr(store._keys.namespace("ns").next_id))
    _, fields = encode_entry(state, entry, entry_id, time.time())
    store._redis.client.hset(store._keys.entry("ns", entry_id), mapping=fields)
    return entry_id


def test_an_entry_hash_written_but_never_registered_is_invisible_and_compaction_removes_it(store):
    (kept,) = store.ingest("ns", [make_entry(small_layout(), 6, seed=1)]).entry_ids
    orphan = _write_unregistered(store, seed=2)
    assert store.find_by_hash("ns", make_entry(small_layout(), 6, seed=2).token_hash) is None
    assert [e.id for e in store.entries("ns")] == [kept] and store.stats().entries == 1
    assert store.verify().orphan_objects == 1
    report = store.compact()
    assert (report.entries, report.orphan_objects_dropped) == (1, 1)
    assert not store._redis.client.exists(store._keys.entry("ns", orphan))
    assert store.verify().orphan_objects == 0
    expected = make_entry(small_layout(), 6, seed=1).maps.astype(np.float16)
    np.testing.assert_array_equal(store.read_maps("ns", kept), expected)


def test_compaction_leaves_unregistered_hashes_younger_than_the_grace_period(redis_server):
    with RedisMapStore.open(redis_server.url(), create=True) as young:  # default grace: 300 s
        young.create_namespace("ns", model="tiny", fingerprint="f" * 64, layout=small_layout())
        orphan = _write_unregistered(young, seed=3)
        assert young.compact().orphan_objects_dropped == 0
        assert young._redis.client.exists(young._keys.entry("ns", orphan))


def test_verify_names_a_corrupt_entry_and_forgets_an_entry_redis_evicted(store):
    ids = store.ingest("ns", [make_entry(small_layout(), 6, seed=s) for s in range(3)]).entry_ids
    store._redis.client.hset(store._keys.entry("ns", ids[0]), "maps/1", b"\x00" * 16)
    store._redis.client.delete(store._keys.entry("ns", ids[1]))  # what a volatile-lru eviction does
    report = store.verify()
    assert [(c.id, c.reason) for c in report.corrupt] == [(ids[0], "layer 1 maps: crc32c mismatch")]
    assert report.entries_checked == 2
    assert [e.id for e in store.entries("ns")] == [ids[0], ids[2]]  # the evicted one is forgotten
    assert store.stats().evicted_entries == 1


def test_a_read_of_an_entry_redis_evicted_is_entry_not_found_and_forgets_it(store):
    entry = make_entry(small_layout(), 6, seed=4)
    (entry_id,) = store.ingest("ns", [entry]).entry_ids
    store._redis.client.delete(store._keys.entry("ns", entry_id))
    with pytest.raises(EntryNotFoundError):
        store.read_outputs("ns", entry_id)
    assert store.find_by_hash("ns", entry.token_hash) is None and store.lengths("ns") == []
    assert store.ingest("ns", [entry]).added  # stored again, under a new id


def test_stats_report_redis_memory_and_the_store_url(store):
    store.ingest("ns", [make_entry(small_layout(), 8, seed=s) for s in range(2)])
    stats = store.stats()
    assert stats.path.startswith("redis://127.0.0.1:") and stats.generation == "redis"
    assert stats.file_bytes > 0 and stats.entries == 2
    layout = small_layout()
    assert stats.namespaces[0].buckets[0].raw_bytes == 2 * (layout.map_nbytes(8) + layout.outputs_nbytes(8))


def test_backup_exports_a_redis_store_to_lmdb_and_restores_it_into_another_redis_store(store, redis_server, tmp_path):
    entries = [make_entry(small_layout(), n, seed=s) for s, n in enumerate([5, 7, 7])]
    store.ingest("ns", entries)
    store.set_projector("ns", projector_blob())
    restored_url = redis_server.url()
    for source, target in ((store.location.url, str(tmp_path / "lmdb")), (str(tmp_path / "lmdb"), restored_url)):
        done = subprocess.run(
            [sys.executable, "-m", "attnstore_tools.cli", "backup", "--store", source, "--to", target],
            capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert "3 entries" in done.stdout
    with LmdbMapStore.open(tmp_path / "lmdb", readonly=True) as lmdb_copy:
        assert lmdb_copy.stats().entries == 3
    with RedisMapStore.open(restored_url) as restored:
        assert restored.get_namespace("ns").projector == projector_blob()
        for entry in entries:
            entry_id = restored.find_by_hash("ns", entry.token_hash)
            np.testing.assert_array_equal(restored.read_maps("ns", entry_id), entry.maps.astype(np.float16))
            np.testing.assert_array_equal(restored.entry("ns", entry_id).feature, entry.feature)


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("http://127.0.0.1:6379", "starts with one of"),
        ("redis://:6379", "needs a host"),
        ("redis://127.0.0.1:6379/?cluster=2", "cluster must be 1 or 0"),
        ("redis://127.0.0.1:6379/1?cluster=1", "database 0 only"),
        ("redis://127.0.0.1:6379/?prefix=a*b", "prefix must be"),
    ],
)
def test_a_bad_store_url_is_a_config_error_naming_the_url(url, named):
    with pytest.raises(ConfigError, match=named) as raised:
        RedisLocation.parse(url)
    assert url in str(raised.value)


def test_a_stopped_redis_makes_calls_raise_unavailable_never_a_redis_exception(tmp_path):
    require_redis()
    server = RedisServer(tmp_path)
    try:
        opened = RedisMapStore.open(server.url(), create=True, settings=RedisSettings(failover_seconds=1.0))
        opened.create_namespace("ns", model="tiny", fingerprint="f" * 64, layout=small_layout())
    finally:
        server.stop()
    start = time.monotonic()
    with pytest.raises(UnavailableError, match="Redis is unavailable while reading namespace 'ns'"):
        opened.get_namespace("ns")
    assert time.monotonic() - start < 10  # retried for about failover_seconds, then given up
    opened.close()
    with pytest.raises(UnavailableError, match=f"connecting to redis://127.0.0.1:{server.port}"):
        RedisMapStore.open(server.url())


def test_redis_stats_count_failures_waited_out_and_given_up_and_show_each_primarys_memory(tmp_path):
    require_redis()
    server = RedisServer(tmp_path, extra=["--maxmemory", "64mb"])
    url = server.url() + "&socket_timeout=0.2"  # a paused server times calls out quickly
    opened = RedisMapStore.open(url, create=True, settings=RedisSettings(failover_seconds=4.0))
    try:
        opened.create_namespace("ns", model="tiny", fingerprint="f" * 64, layout=small_layout())
        stats = opened.redis_stats()
        assert stats.retries == RetryTotals(0, 0, 0)
        ((node, used, limit),) = [(n.node, n.used_bytes, n.max_bytes) for n in stats.nodes]
        assert node == server.address and used > 0 and limit == 64 << 20
        stop(server.process.pid)  # a failover in progress, as a client sees it: no answers
        # Paused past redis-py's own quick retries (under a second), within the failover wait.
        threading.Timer(1.5, server.process.send_signal, (signal.SIGCONT,)).start()
        assert [ns.name for ns in opened.list_namespaces()] == ["ns"]  # read from Redis (never cached): waited out
        waited = opened.redis_stats().retries
        assert waited.retries > 0 and waited.waited_out == 1 and waited.gave_up == 0
        server.stop()
        with pytest.raises(UnavailableError):
            opened.list_namespaces()
        gone = opened.redis_stats()
        assert gone.retries.gave_up == 1 and gone.retries.retries > waited.retries and gone.nodes == ()
    finally:
        opened.close()
        server.stop()
