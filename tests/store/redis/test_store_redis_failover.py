"""A Redis Cluster master SIGKILLed under load: its replica takes over, and the store loses nothing it committed.

Runs on its own 3-master, 3-replica cluster (the session's stays whole). The
master killed is the one holding the namespace's index keys, the busiest.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from attnstore.errors import EntryNotFoundError
from attnstore.store.redis.mapstore import RedisMapStore
from attnstore.store.redis.urls import RedisSettings
from tests.support.redis_servers import RedisClusterServers, require_redis
from tests.support.stores import make_entry, small_layout
from tests.support.wait import wait_until


@pytest.fixture
def cluster(tmp_path):
    require_redis()
    servers = RedisClusterServers(tmp_path)
    yield servers
    servers.stop()


def test_killing_the_namespaces_master_mid_load_costs_latency_not_errors_and_no_wrong_or_kept_entry_lost(cluster):
    url = cluster.url()
    layout = small_layout()
    committed: dict[int, int] = {}  # seed -> entry id, for every ingest that returned
    errors: list[BaseException] = []
    stop = threading.Event()
    with RedisMapStore.open(url, create=True, settings=RedisSettings()) as store:
        store.create_namespace("ns", model="tiny", fingerprint="f" * 64, layout=layout)

        def ingest() -> None:
            seed = 0
            while not stop.is_set():
                try:
                    (entry_id,) = store.ingest("ns", [make_entry(layout, 6, seed=seed)]).entry_ids
                    committed[seed] = entry_id
                except Exception as exc:  # counted: the test wants none
                    errors.append(exc)
                seed += 1

        wrong: list[int] = []
        reads = [0]

        def read() -> None:  # reads of committed entries the whole time: a miss may happen, a wrong row never
            while not stop.is_set():
                for seed, entry_id in list(committed.copy().items())[-20:]:  # copy(): one C call, no race
                    try:
                        maps = store.read_maps("ns", entry_id)
                    except EntryNotFoundError:
                        continue
                    except Exception as exc:
                        errors.append(exc)
                        continue
                    reads[0] += 1
                    if not np.array_equal(maps, make_entry(layout, 6, seed=seed).maps.astype(np.float16)):
                        wrong.append(entry_id)

        writer, reader = threading.Thread(target=ingest), threading.Thread(target=read)
        writer.start()
        reader.start()
        try:
            # The load is under way: ingests committed and read back.
            wait_until(lambda: errors or (len(committed) >= 5 and reads[0] > 0), 60,
                       lambda: f"5 ingests committed and read back (committed {len(committed)}, reads {reads[0]})")
            namespace_key = store._keys.namespace("ns").info
            cluster.wait_replicated(namespace_key)  # the namespace itself on the replica that will take over
            victim = cluster.master_of(namespace_key)
            victim.kill()
            killed_at = len(committed)
            # The replica takes over about 2 s later (cluster-node-timeout 2000 ms), then ingests resume: wait for
            # some (a loaded machine is slow, so by count, within a generous deadline).
            wait_until(lambda: errors or len(committed) > killed_at + 5, 90,
                       lambda: f"ingests resumed after the failover (committed {len(committed) - killed_at} since)",
                       poll=0.1)
        finally:
            stop.set()
            writer.join(60)
            reader.join(60)
        assert not errors, errors[:3]
        assert not wrong and reads[0] > 0
        assert len(committed) > killed_at + 5  # ingests went on after the failover
        waited = store.redis_stats().retries  # what a daemon's attnstore_redis_* metrics show of a failover
        assert waited.retries > 0 and waited.waited_out > 0 and waited.gave_up == 0
        cluster.wait_ok()
        lost = 0
        for seed, entry_id in committed.items():
            entry = make_entry(layout, 6, seed=seed)
            found = store.find_by_hash("ns", entry.token_hash)
            if found is None:
                lost += 1  # acknowledged by the dead master, not yet on its replica: Redis did not keep it
                continue
            assert found == entry_id
            try:
                maps = store.read_maps("ns", entry_id)
            except EntryNotFoundError:
                lost += 1  # its hash was on the dead master and not replicated: a miss, never wrong
                continue
            np.testing.assert_array_equal(maps, entry.maps.astype(np.float16))
        # Replication is asynchronous: at most the writes of the last moment before the kill can be gone.
        assert lost <= 2, f"{lost} of {len(committed)} committed entries lost"
