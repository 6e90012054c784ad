"""Written-back entries: every store (LMDB, in-memory, Redis server and Redis Cluster) keeps, serves, verifies,
compacts and evicts outputs-only entries and full ones alike. The Redis stores run on real ``redis-server``
processes (see ``tests/support/redis_servers.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from attnstore.errors import MapShapeError, MapsNotStoredError
from attnstore.store import MapStoreBase, NewEntry
from tests.support.stores import make_entry, small_layout, token_hash


@pytest.fixture
def make_ns_store(make_store):
    """Every backend (``make_store``, tests/store/conftest.py) with namespace ``ns`` of ``small_layout()``."""

    def factory(max_bytes: int | None = None) -> MapStoreBase:
        store = make_store(max_bytes)
        store.create_namespace("ns", model="tiny", fingerprint="f" * 64, layout=small_layout())
        return store

    return factory


@pytest.fixture
def store(make_ns_store):
    return make_ns_store()


def _outputs_only(length: int, seed: int) -> NewEntry:
    rng = np.random.default_rng(seed)
    return NewEntry(
        maps=None, token_hash=token_hash("wb", seed), outputs=rng.normal(size=(length, 8)).astype(np.float32),
        token_ids=rng.integers(0, 1000, size=length),
    )


def test_outputs_only_entry_is_found_by_hash_and_serves_its_outputs(store):
    entry = _outputs_only(7, 1)
    (entry_id,) = store.ingest("ns", [entry]).entry_ids
    (ref,) = store.find_by_hashes("ns", [entry.token_hash])
    assert ref is not None and (ref.id, ref.length) == (entry_id, 7)
    np.testing.assert_array_equal(store.read_outputs("ns", entry_id), np.asarray(entry.outputs, dtype=np.float16))
    assert store.entry("ns", entry_id).feature is None


def test_reading_maps_of_an_outputs_only_entry_raises_maps_not_stored(store):
    (entry_id,) = store.ingest("ns", [_outputs_only(4, 2)]).entry_ids
    with pytest.raises(MapsNotStoredError, match="outputs only"):
        store.read_layer("ns", entry_id, 0)


def test_entry_without_maps_or_outputs_is_refused_and_nothing_is_stored(store):
    with pytest.raises(MapShapeError, match="needs outputs"):
        store.ingest("ns", [NewEntry(maps=None, token_hash=token_hash("x"))])
    assert store.stats().entries == 0


def test_entry_without_maps_but_with_a_feature_is_refused(store):
    entry = _outputs_only(4, 3)
    bad = NewEntry(maps=None, token_hash=entry.token_hash, outputs=entry.outputs, feature=np.zeros(16, np.float32))
    with pytest.raises(MapShapeError, match="feature"):
        store.ingest("ns", [bad])


def test_token_ids_disagreeing_with_outputs_length_are_refused(store):
    entry = _outputs_only(5, 4)
    bad = NewEntry(maps=None, token_hash=entry.token_hash, outputs=entry.outputs, token_ids=[1, 2, 3])
    with pytest.raises(MapShapeError, match="token_ids"):
        store.ingest("ns", [bad])
    assert store.find_by_hashes("ns", [entry.token_hash]) == [None]


def test_outputs_only_entries_pass_verify_and_survive_compaction(store):
    full = make_entry(small_layout(), 6, 9)
    ids = store.ingest("ns", [_outputs_only(6, 5), full]).entry_ids
    report = store.verify()
    assert not report.corrupt and not report.problems
    store.compact()
    (ref,) = store.find_by_hashes("ns", [token_hash("wb", 5)])
    assert ref is not None and ref.id == ids[0]
    assert store.read_outputs("ns", ids[0]) is not None
    assert store.read_layer("ns", ids[1], 0).shape == (2, 6, 6)


def test_a_written_back_duplicate_of_a_stored_entry_keeps_the_stored_one(store):
    full = make_entry(small_layout(), 6, 9)
    (stored,) = store.ingest("ns", [full]).entry_ids
    again = NewEntry(maps=None, token_hash=full.token_hash, outputs=full.outputs)
    report = store.ingest("ns", [again])
    assert report.entry_ids == [stored] and report.duplicates == 1
    assert store.read_layer("ns", stored, 0).shape == (2, 6, 6)


def test_a_duplicate_with_a_feature_never_puts_an_outputs_only_entry_in_the_map_tier(store):
    full = make_entry(small_layout(), 6, 11)
    (stored,) = store.ingest("ns", [NewEntry(maps=None, token_hash=full.token_hash, outputs=full.outputs)]).entry_ids
    report = store.ingest("ns", [full])
    assert report.entry_ids == [stored] and report.featured == [] and report.duplicates == 1
    assert store.entry("ns", stored).feature is None


def test_a_written_back_full_entry_serves_maps_outputs_and_feature(store):
    full = make_entry(small_layout(), 7, 12)
    (entry_id,) = store.ingest("ns", [full]).entry_ids
    np.testing.assert_array_equal(store.read_maps("ns", entry_id), np.asarray(full.maps, dtype=np.float16))
    np.testing.assert_array_equal(store.read_outputs("ns", entry_id), np.asarray(full.outputs, dtype=np.float16))
    np.testing.assert_array_equal(store.entry("ns", entry_id).feature, full.feature)


def test_the_byte_cap_evicts_written_back_entries_least_recently_hit_first(make_ns_store):
    layout = small_layout()
    full_bytes = layout.map_nbytes(16) + layout.outputs_nbytes(16)
    store = make_ns_store(max_bytes=5 * full_bytes)
    first = store.ingest("ns", [make_entry(layout, 16, s) for s in range(2)]).entry_ids
    written = store.ingest("ns", [_outputs_only(16, 20 + s) for s in range(2)]).entry_ids
    store.record_hits("ns", [written[0]])  # an old written-back entry, hit since: kept
    report = store.ingest("ns", [make_entry(layout, 16, s) for s in range(30, 33)])
    live = {e.id for e in store.entries("ns")}
    assert written[0] in live and set(report.entry_ids) <= live
    assert first[0] not in live  # least recently hit goes first, written back or built
    assert set(report.evicted["ns"]) == set(first + written) - live
    assert store.stats().stored_bytes <= 5 * full_bytes
