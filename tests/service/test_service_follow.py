"""Two services on one real Redis store, as two stateless daemons would be: each follows the store's log.

What one ingests, deletes, drops or re-projects reaches the other's index
within ``FOLLOW_SECONDS`` (waited for with room below); a follower whose log
position was trimmed away rebuilds its index from the store's keys.
"""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.numpy

from attnstore.index import FaissIndex
from attnstore.service import AttnStoreService, Query
from attnstore.service.follower import FOLLOW_SECONDS
from attnstore.service.indexes import NamespaceIndexes
from attnstore.store.redis.mapstore import RedisMapStore
from attnstore.store.redis.urls import RedisSettings
from tests.support.stores import make_entry, small_layout
from tests.support.wait import wait_until

FP = "f" * 64
BOUND = FOLLOW_SECONDS + 1.5


@pytest.fixture
def pair(redis_server):
    url = redis_server.url()
    services = [AttnStoreService(RedisMapStore.open(url, create=True, settings=RedisSettings()))
                for _ in range(2)]
    yield services
    for service in services:
        service.close()


def _kinds(service: AttnStoreService, seeds: list[int], ns: str = "ns") -> list[tuple[str, int | None]]:
    queries = [Query(make_entry(small_layout(), 6, seed=s).feature, 6) for s in seeds]
    return [(r.kind, r.entry_id) for r in service.lookup(ns, FP, queries, max_distance=0.01, exact=False)]


def _weights(value: float) -> bytes:
    return safetensors.numpy.save({"w": np.full(2, value, np.float32)})


def _until(check, seconds: float = BOUND,
           what: str = "the other service's answers current with the store's log (the staleness bound)") -> None:
    wait_until(check, seconds, what)


def test_a_namespace_created_and_filled_through_one_service_is_searchable_through_the_other(pair):
    a, b = pair
    a.create_namespace("ns", model="tiny", fingerprint=FP, layout=small_layout())
    ids = a.ingest("ns", FP, [make_entry(small_layout(), 6, seed=s) for s in range(3)]).entry_ids
    _until(lambda: _kinds(b, [0, 1, 2]) == [("map", i) for i in ids])


def test_a_projector_replaced_through_one_service_empties_the_others_index(pair):
    a, b = pair
    a.create_namespace("ns", model="tiny", fingerprint=FP, layout=small_layout())
    a.set_projector("ns", _weights(1.0))
    (entry_id,) = a.ingest("ns", FP, [make_entry(small_layout(), 6, seed=1)]).entry_ids
    _until(lambda: _kinds(b, [1]) == [("map", entry_id)])
    a.set_projector("ns", _weights(2.0), replace=True)  # other weights: every stored feature goes
    _until(lambda: _kinds(b, [1]) == [("miss", None)])


def test_a_namespace_dropped_and_made_again_through_one_service_is_rebuilt_in_the_other(pair):
    a, b = pair
    a.create_namespace("ns", model="tiny", fingerprint=FP, layout=small_layout())
    (old,) = a.ingest("ns", FP, [make_entry(small_layout(), 6, seed=1)]).entry_ids
    _until(lambda: _kinds(b, [1]) == [("map", old)])
    a.drop_namespace("ns")
    a.create_namespace("ns", model="tiny", fingerprint=FP, layout=small_layout())
    (new,) = a.ingest("ns", FP, [make_entry(small_layout(), 6, seed=2)]).entry_ids
    _until(lambda: _kinds(b, [1, 2]) == [("miss", None), ("map", new)])


def test_a_follower_whose_log_position_was_trimmed_away_rebuilds_from_the_store(redis_server):
    url = redis_server.url()
    with RedisMapStore.open(url, create=True, settings=RedisSettings(log_max_events=2)) as writer, \
            RedisMapStore.open(url, settings=RedisSettings(log_max_events=2)) as reader:
        writer.create_namespace("ns", model="tiny", fingerprint=FP, layout=small_layout())
        (first,) = writer.ingest("ns", [make_entry(small_layout(), 6, seed=1)]).entry_ids
        indexes = NamespaceIndexes(reader, FaissIndex, length_penalty=1.0)  # follows only when told (no thread)
        assert _searched(indexes, reader, [1]) == [first]
        writer.delete("ns", [first])
        later = [writer.ingest("ns", [make_entry(small_layout(), 6, seed=s)]).entry_ids[0] for s in (2, 3, 4)]
        feed = reader.change_feed()
        assert feed.changes("ns", "0-0").rebuild  # four changes logged, the log keeps two: the first are gone
        indexes.follow()
        assert _searched(indexes, reader, [1, 2, 3, 4]) == [None, *later]


def test_the_follower_status_counts_changes_applied_and_reads_within_the_bound(pair):
    first, second = pair
    first.create_namespace("ns", model="tiny", fingerprint=FP, layout=small_layout())
    assert _kinds(second, [1]) == [("miss", None)]  # a search indexes it now: what follows comes by the log
    before = second.monitoring.follower_status().changes_applied
    ids = first.ingest("ns", FP, [make_entry(small_layout(), 6, seed=s) for s in (1, 2)]).entry_ids
    first.delete("ns", ids[:1])
    _until(lambda: second.monitoring.follower_status().changes_applied >= before + 2, BOUND,
           "one ingest and one delete applied by the second")
    status = second.monitoring.follower_status()
    assert status.failed_reads == 0 and status.seconds_since_read < FOLLOW_SECONDS * 2  # read at every interval


def test_a_service_on_a_store_no_one_shares_has_no_follower_status(tmp_path):
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        assert service.monitoring.follower_status() is None and service.monitoring.redis_stats() is None


def _searched(indexes: NamespaceIndexes, store: RedisMapStore, seeds: list[int]) -> list[int | None]:
    info = store.get_namespace("ns")
    features = np.stack([make_entry(small_layout(), 6, seed=s).feature for s in seeds])
    matches = indexes.search(info, features, np.full(len(seeds), 6), max_distance=0.01)
    return [m.entry_id if m.hit else None for m in matches]


def test_features_set_through_one_service_are_searchable_through_the_other(pair):
    a, b = pair
    a.create_namespace("ns", model="tiny", fingerprint=FP, layout=small_layout())
    a.set_projector("ns", _weights(1.0))
    entries = [make_entry(small_layout(), 6, seed=s, feature=False) for s in (1, 2)]
    ids = a.ingest("ns", FP, entries).entry_ids
    features = np.stack([make_entry(small_layout(), 6, seed=s).feature for s in (1, 2)])
    a.set_features("ns", ids, features, projector_version=1)
    _until(lambda: _kinds(b, [1, 2]) == [("map", i) for i in ids])


def test_a_log_record_that_does_not_decode_is_skipped_counted_and_the_follower_goes_on(pair, redis_server):
    a, b = pair
    a.create_namespace("ns", model="tiny", fingerprint=FP, layout=small_layout())
    (first,) = a.ingest("ns", FP, [make_entry(small_layout(), 6, seed=1)]).entry_ids
    _until(lambda: _kinds(b, [1]) == [("map", first)])
    log_key = a.store._keys.namespace("ns").log
    with redis_server.client() as raw:  # what a bug or a hand edit could leave in the log
        raw.xadd(log_key, {"op": "add", "ids": "not-a-number"})
        raw.xadd(log_key, {"op": "del"})
    (second,) = a.ingest("ns", FP, [make_entry(small_layout(), 6, seed=2)]).entry_ids
    _until(lambda: _kinds(b, [1, 2]) == [("map", first), ("map", second)])
    status = b.monitoring.follower_status()
    assert status.skipped_records == 2 and status.errors == 0
    assert b.monitoring.dead_threads() == []


def test_an_unexpected_error_in_a_follower_step_is_counted_and_the_next_step_runs(pair, monkeypatch):
    a, b = pair
    a.create_namespace("ns", model="tiny", fingerprint=FP, layout=small_layout())
    (first,) = a.ingest("ns", FP, [make_entry(small_layout(), 6, seed=1)]).entry_ids
    _until(lambda: _kinds(b, [1]) == [("map", first)])  # b indexes the namespace: what follows comes by its log
    indexes = b._indexes
    follow = indexes.follow
    failures = [RuntimeError("a bug in a step"), ZeroDivisionError("another")]

    def failing_then_following() -> int:
        if failures:
            raise failures.pop()
        return follow()

    monkeypatch.setattr(indexes, "follow", failing_then_following)
    (entry_id,) = a.ingest("ns", FP, [make_entry(small_layout(), 6, seed=3)]).entry_ids
    _until(lambda: _kinds(b, [3]) == [("map", entry_id)])
    assert b.monitoring.follower_status().errors == 2 and b.monitoring.dead_threads() == []
