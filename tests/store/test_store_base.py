"""Shared behaviour suite: every map store implementation (LMDB, in-memory, Redis server and Redis Cluster)
must pass it. The Redis ones run on real ``redis-server`` processes (see ``tests/support/redis_servers.py``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import safetensors.numpy
import torch

from attnstore.errors import (
    ConfigError,
    EntryNotFoundError,
    MapShapeError,
    NamespaceExistsError,
    NamespaceNotFoundError,
    ProjectorChangedError,
    WireFormatError,
)
from attnstore.protocol.chunks import ChunkLayout, StoredChunk
from attnstore.protocol.records import TokenLimits
from attnstore.store import MapStoreBase, NewEntry
from attnstore.store.codecs import q8_error_bound
from tests.support.stores import make_entry, projector_blob, small_layout, token_hash


@pytest.fixture
def store(make_store) -> MapStoreBase:
    return make_store()


def _namespace(store: MapStoreBase, codec: str = "fp16", name: str = "ns", causal: bool = True) -> str:
    store.create_namespace(name, model="tiny", fingerprint="f" * 64, layout=small_layout(codec, causal))
    return name


@pytest.mark.parametrize("codec", ["fp16", "zstd"])
def test_lossless_codecs_round_trip_maps_outputs_and_feature_exactly(store, codec):
    ns = _namespace(store, codec)
    entries = [make_entry(small_layout(codec), length, seed) for seed, length in enumerate([5, 9, 9, 40])]
    ids = store.ingest(ns, entries).entry_ids
    assert ids == [1, 2, 3, 4]
    for entry_id, entry in zip(ids, entries, strict=True):
        maps = store.read_maps(ns, entry_id)
        assert maps.dtype == np.float16 and maps.flags.c_contiguous
        assert np.array_equal(maps, entry.maps.astype(np.float16))
        assert np.array_equal(store.read_outputs(ns, entry_id), entry.outputs.astype(np.float16))
        info = store.entry(ns, entry_id)
        assert info.length == entry.maps.shape[-1] and info.token_hash == entry.token_hash
        assert np.array_equal(info.feature, entry.feature)


def test_token_ids_are_read_back_in_one_call_none_where_absent_or_deleted(store):
    ns = _namespace(store)
    with_ids, without = make_entry(small_layout(), 5, seed=1), make_entry(small_layout(), 6, seed=2, tokens=False)
    first, second = store.ingest(ns, [with_ids, without]).entry_ids
    store.delete(ns, [second])
    found = store.token_ids(ns, [first, second, 999])
    assert found[0].dtype == np.uint32 and np.array_equal(found[0], with_ids.token_ids)
    assert found[1:] == [None, None]
    assert np.array_equal(store.entry(ns, first).token_ids, with_ids.token_ids)


@pytest.mark.parametrize("codec", ["q8", "q8+zstd"])
def test_q8_codecs_round_trip_within_the_documented_bound(store, codec):
    ns = _namespace(store, codec)
    entry = make_entry(small_layout(codec), 33, seed=7)
    (entry_id,) = store.ingest(ns, [entry]).entry_ids
    decoded = store.read_maps(ns, entry_id).astype(np.float32)
    bound = q8_error_bound(entry.maps.max(axis=-1))[..., None]  # per row
    assert (np.abs(decoded - entry.maps) <= bound).all()
    assert np.abs(decoded - entry.maps).max() > 0  # lossy: the test can see the loss


def test_fp16_maps_in_give_the_same_bits_out(store):
    ns = _namespace(store)
    entry = make_entry(small_layout(), 12, seed=3, dtype=np.float16)
    (entry_id,) = store.ingest(ns, [entry]).entry_ids
    assert np.array_equal(store.read_maps(ns, entry_id).view(np.uint16), entry.maps.view(np.uint16))


def test_torch_tensors_are_accepted_as_input(store):
    ns = _namespace(store)
    entry = make_entry(small_layout(), 6, seed=1)
    as_torch = NewEntry(torch.from_numpy(entry.maps), entry.token_hash, torch.from_numpy(entry.outputs), entry.feature)
    (entry_id,) = store.ingest(ns, [as_torch]).entry_ids
    assert np.array_equal(store.read_maps(ns, entry_id), entry.maps.astype(np.float16))


def test_exact_duplicates_are_stored_once(store):
    ns = _namespace(store)
    a = make_entry(small_layout(), 6, seed=1)
    ids = store.ingest(ns, [a, make_entry(small_layout(), 6, seed=2), a]).entry_ids
    assert ids[0] == ids[2] != ids[1]
    assert store.ingest(ns, [a]).entry_ids == [ids[0]]
    assert store.stats().entries == 2
    assert store.find_by_hash(ns, a.token_hash) == ids[0]
    assert store.find_by_hash(ns, token_hash("never stored")) is None


def test_ids_are_never_reused_after_delete(store):
    ns = _namespace(store)
    ids = store.ingest(ns, [make_entry(small_layout(), 4, seed=s) for s in range(3)]).entry_ids
    assert store.delete(ns, [ids[-1], ids[-1], 999]) == 1
    (new_id,) = store.ingest(ns, [make_entry(small_layout(), 4, seed=10)]).entry_ids
    assert new_id > max(ids)


def test_delete_makes_reads_raise_entry_not_found(store):
    ns = _namespace(store)
    entry = make_entry(small_layout(), 4, seed=1)
    (entry_id,) = store.ingest(ns, [entry]).entry_ids
    store.read_maps(ns, entry_id)  # may now sit in a DRAM cache
    assert store.delete(ns, [entry_id]) == 1
    for read in (store.read_maps, store.read_outputs, store.entry):
        with pytest.raises(EntryNotFoundError):
            read(ns, entry_id)
    assert store.find_by_hash(ns, entry.token_hash) is None
    assert store.lengths(ns) == []


def test_entries_and_lengths_list_live_entries_by_bucket(store):
    ns = _namespace(store)
    lengths = [4, 7, 4, 9, 7, 4]
    ids = store.ingest(ns, [make_entry(small_layout(), n, seed=s) for s, n in enumerate(lengths)]).entry_ids
    assert store.lengths(ns) == [4, 7, 9]
    assert [e.id for e in store.entries(ns)] == ids
    assert [e.id for e in store.entries(ns, length=4)] == [ids[0], ids[2], ids[5]]
    assert list(store.entries(ns, length=5)) == []
    store.delete(ns, [ids[3]])
    assert store.lengths(ns) == [4, 7]


def test_record_hits_counts_hits_and_last_hit(store):
    ns = _namespace(store)
    a, b = store.ingest(ns, [make_entry(small_layout(), 4, seed=s) for s in range(2)]).entry_ids
    store.record_hits(ns, [a, a, b, 12345])
    store.record_hits(ns, [a])
    assert store.entry(ns, a).hits == 3
    assert store.entry(ns, b).hits == 1
    assert store.entry(ns, a).last_hit >= store.entry(ns, a).created


def test_read_layer_matches_read_maps(store):
    ns = _namespace(store, "q8+zstd")
    (entry_id,) = store.ingest(ns, [make_entry(small_layout("q8+zstd"), 10, seed=4)]).entry_ids
    maps = store.read_maps(ns, entry_id)
    for layer in range(3):
        assert np.array_equal(store.read_layer(ns, entry_id, layer), maps[layer])
    with pytest.raises(MapShapeError, match="layer 3 is out of range"):
        store.read_layer(ns, entry_id, 3)


@pytest.mark.parametrize("layer", [True, False, -1, 3, 1.0, "0"], ids=repr)
def test_read_layer_refuses_a_layer_that_is_not_an_int_in_range_on_every_backend(store, layer):
    ns = _namespace(store)
    (entry_id,) = store.ingest(ns, [make_entry(small_layout(), 6, seed=4)]).entry_ids
    with pytest.raises(MapShapeError, match=f"layer {layer!r} is out of range: namespace 'ns' has 3 layers"):
        store.read_layer(ns, entry_id, layer)


def test_returned_arrays_belong_to_the_caller(store):
    ns = _namespace(store)
    entry = make_entry(small_layout(), 5, seed=2)
    (entry_id,) = store.ingest(ns, [entry]).entry_ids
    for _ in range(2):  # the second read may come from a DRAM cache
        store.read_maps(ns, entry_id)[...] = 0
        store.read_layer(ns, entry_id, 0)[...] = 0
    assert np.array_equal(store.read_maps(ns, entry_id), entry.maps.astype(np.float16))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda e: NewEntry(e.maps.astype(np.float64), e.token_hash, e.outputs, e.feature), "dtype float64"),
        (lambda e: NewEntry(e.maps[:2], e.token_hash, e.outputs, e.feature), "shape"),
        (lambda e: NewEntry(e.maps[..., :5], e.token_hash, e.outputs, e.feature), "shape"),
        (lambda e: NewEntry(np.log(e.maps + 1e-9), e.token_hash, e.outputs, e.feature), r"\[0, 1\]"),
        (lambda e: NewEntry(np.transpose(e.maps, (0, 1, 3, 2)).copy(), e.token_hash, e.outputs, e.feature), "diagonal"),
        (lambda e: NewEntry(e.maps, e.token_hash[:8], e.outputs, e.feature), "32 bytes"),
        (lambda e: NewEntry(e.maps, e.token_hash, e.outputs[:4], e.feature), "outputs shape"),
        (lambda e: NewEntry(e.maps, e.token_hash, e.outputs, e.feature[:3]), "feature shape"),
        (lambda e: NewEntry(e.maps.tolist(), e.token_hash, e.outputs, e.feature), "numpy array or a torch tensor"),
        (lambda e: NewEntry(np.zeros_like(e.maps), e.token_hash, e.outputs, e.feature), "rows must sum to 1"),
        (lambda e: NewEntry(e.maps * 0.9, e.token_hash, e.outputs, e.feature), r"sums to 0\.9"),
    ],
)
def test_bad_input_raises_a_clear_error_and_writes_nothing(store, change, message):
    ns = _namespace(store)
    good = make_entry(small_layout(), 6, seed=1)
    bad = change(make_entry(small_layout(), 6, seed=2))
    with pytest.raises(MapShapeError, match=message):
        store.ingest(ns, [good, bad])
    assert store.stats().entries == 0
    assert store.find_by_hash(ns, good.token_hash) is None
    assert store.ingest(ns, [good]).entry_ids == [1]  # no id was used up either


def test_nan_maps_are_refused(store):
    ns = _namespace(store)
    entry = make_entry(small_layout(), 6, seed=1)
    entry.maps[1, 0, 3, 0] = np.nan
    with pytest.raises(MapShapeError, match="NaN"):
        store.ingest(ns, [entry])


def test_namespaces_create_get_list_and_projector(store):
    info = store.create_namespace("a", model="m", fingerprint="fp", layout=small_layout())
    assert store.create_namespace("a", model="m", fingerprint="fp", layout=small_layout()) == info
    with pytest.raises(NamespaceExistsError, match="fingerprint"):
        store.create_namespace("a", model="m", fingerprint="other", layout=small_layout())
    with pytest.raises(ConfigError, match="namespace name"):
        store.create_namespace("a/b", model="m", fingerprint="fp", layout=small_layout())
    store.create_namespace("b", model="m", fingerprint="fp", layout=small_layout("q8"))
    assert [n.name for n in store.list_namespaces()] == ["a", "b"]
    assert store.get_namespace("b").layout.codec == "q8"
    store.set_projector("a", projector_blob())
    assert store.get_namespace("a").projector == projector_blob()
    with pytest.raises(NamespaceNotFoundError):
        store.get_namespace("zzz")
    with pytest.raises(NamespaceNotFoundError):
        store.ingest("zzz", [make_entry(small_layout(), 4, seed=1)])


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda s: s.create_namespace("a", model="m", fingerprint="", layout=small_layout()), ConfigError, "finger"),
        (lambda s: s.create_namespace("a", model="m", fingerprint="fp", layout={"layers": 2}), ConfigError, "layout"),
        (lambda s: s.set_projector("ns", "not bytes"), ConfigError, "bytes"),
        (lambda s: s.set_projector("ns", b"\x80pickle"), WireFormatError, "not safetensors"),
        (lambda s: s.find_by_hash("ns", b"short"), MapShapeError, "32 bytes"),
        (lambda s: s.delete("ns", [1, 2**63]), ConfigError, "position 1"),
    ],
    ids=["empty fingerprint", "layout dict", "projector str", "projector pickle", "short hash", "id 2**63"],
)
def test_every_backend_refuses_the_same_bad_arguments_and_changes_nothing(store, call, error, match):
    ns = _namespace(store, name="ns")
    (kept,) = store.ingest(ns, [make_entry(small_layout(), 5, seed=1)]).entry_ids
    with pytest.raises(error, match=match):
        call(store)
    assert [n.name for n in store.list_namespaces()] == ["ns"]
    assert store.get_namespace("ns").projector is None
    assert [e.id for e in store.entries("ns")] == [kept]


def test_drop_namespace_removes_its_entries_and_leaves_others_intact(store):
    keep = _namespace(store, name="a")
    gone = _namespace(store, name="a.b")
    kept_id, = store.ingest(keep, [make_entry(small_layout(), 5, seed=1)]).entry_ids
    dropped = [make_entry(small_layout(), 5, seed=2), make_entry(small_layout(), 6, seed=3)]
    dropped_ids = store.ingest(gone, dropped).entry_ids
    store.set_projector(gone, projector_blob())
    store.drop_namespace(gone)
    assert [n.name for n in store.list_namespaces()] == ["a"]
    with pytest.raises(NamespaceNotFoundError):
        store.read_maps(gone, dropped_ids[0])
    np.testing.assert_array_equal(
        store.read_maps(keep, kept_id), make_entry(small_layout(), 5, seed=1).maps.astype(np.float16)
    )
    assert store.stats().entries == 1
    # The name is free again, with nothing left over from before.
    _namespace(store, name="a.b", codec="zstd")
    assert store.lengths("a.b") == [] and store.get_namespace("a.b").projector is None
    assert store.find_by_hash("a.b", make_entry(small_layout(), 5, seed=2).token_hash) is None
    with pytest.raises(NamespaceNotFoundError):
        store.drop_namespace("zzz")


def test_stats_report_entries_bytes_and_ratio_per_bucket_and_codec(store):
    fp16 = _namespace(store, "fp16", "plain")
    packed = _namespace(store, "q8+zstd", "packed")
    for ns in (fp16, packed):
        store.ingest(ns, [make_entry(small_layout(), n, seed=s, outputs=False) for s, n in enumerate([8, 8, 16])])
    stats = store.stats()
    by_name = {n.name: n for n in stats.namespaces}
    assert stats.entries == 6
    assert by_name["plain"].ratio == pytest.approx(1.0)
    assert by_name["packed"].ratio < 0.6
    assert by_name["packed"].codec == "q8+zstd"
    assert [(b.length, b.entries) for b in by_name["plain"].buckets] == [(8, 2), (16, 1)]
    assert by_name["plain"].buckets[0].raw_bytes == 2 * small_layout().map_nbytes(8)
    assert stats.to_dict()["namespaces"][0]["ratio"] > 0


def test_byte_cap_evicts_the_least_recently_hit_entries(make_store):
    entry_bytes = small_layout().map_nbytes(16)
    store = make_store(max_bytes=5 * entry_bytes)
    ns = _namespace(store)
    first = store.ingest(ns, [make_entry(small_layout(), 16, seed=s, outputs=False) for s in range(4)]).entry_ids
    store.record_hits(ns, [first[0]])  # the oldest entry is now the most recently hit
    report = store.ingest(ns, [make_entry(small_layout(), 16, seed=s, outputs=False) for s in range(10, 12)])
    more = report.entry_ids
    live = {e.id for e in store.entries(ns)}
    assert first[0] in live and set(more) <= live
    assert first[1] not in live  # least recently hit goes first
    # The ingest names exactly what it evicted, so indexes can forget it.
    assert set(report.evicted) == {ns} and set(report.evicted[ns]) == set(first) - live
    stats = store.stats()
    assert stats.evicted_entries == len(report.evicted[ns]) and stats.stored_bytes <= 5 * entry_bytes


@pytest.mark.parametrize(("low_water", "evicted"), [(0.5, 6), (1.0, 1)])
def test_byte_cap_evicts_entries_down_to_the_low_water_mark_and_no_further(make_store, low_water, evicted):
    entry_bytes = small_layout().map_nbytes(16)  # fp16 without outputs: stored as it is
    store = make_store(max_bytes=10 * entry_bytes, evict_low_water=low_water)
    ns = _namespace(store)
    first = store.ingest(ns, [make_entry(small_layout(), 16, seed=s, outputs=False) for s in range(10)]).entry_ids
    assert store.entry(ns, first[0]).nbytes == entry_bytes and store.stats().evicted_entries == 0  # at the cap
    report = store.ingest(ns, [make_entry(small_layout(), 16, seed=10, outputs=False)])
    # 11 entries over a cap of 10: down to at most low_water * 10, the new one kept.
    assert len(report.evicted[ns]) == evicted and set(report.evicted[ns]) <= set(first)
    assert store.stats().stored_bytes == (11 - evicted) * entry_bytes <= int(low_water * 10 * entry_bytes)


@pytest.mark.parametrize(("low_water", "evicted"), [(0.5, 6), (1.0, 1)])
def test_byte_cap_evicts_chunks_down_to_the_low_water_mark_and_no_further(make_store, low_water, evicted):
    layout = ChunkLayout(layers=3, kv_heads=2, head_dim=4, dtype="float32")
    chunk_bytes = layout.chunk_bytes(5)
    store = make_store(max_bytes=10 * chunk_bytes, evict_low_water=low_water)
    if store.chunks is None:
        pytest.skip(f"{type(getattr(store, 'inner', store)).__name__} keeps no chunk entries")
    _namespace(store)
    store.chunks.set_layout("ns", layout)
    rng = np.random.default_rng(0)
    chunks = [StoredChunk(token_hash(f"chunk {i}"), rng.standard_normal((3, *layout.layer_shape(5)), np.float32))
              for i in range(11)]
    for chunk in chunks[:10]:
        store.chunks.put("ns", [chunk])
    store.chunks.put("ns", [chunks[10]])
    # 11 chunks over a cap of 10: down to at most low_water * 10, the new one kept.
    kept = [length is not None for length in store.chunks.lengths("ns", [c.key for c in chunks])]
    assert sum(kept) == 11 - evicted and kept[10]
    assert store.stats().chunk_bytes == (11 - evicted) * chunk_bytes <= int(low_water * 10 * chunk_bytes)


def test_ingest_reports_which_entries_it_added_and_how_many_duplicates(store):
    ns = _namespace(store)
    a, b = (make_entry(small_layout(), 6, seed=s) for s in (1, 2))
    first = store.ingest(ns, [a, a])
    assert first.added == [first.entry_ids[0]] and first.entry_ids[0] == first.entry_ids[1]
    assert first.duplicates == 1 and first.evicted == {}
    second = store.ingest(ns, [b, a])
    assert second.added == [second.entry_ids[0]] and second.entry_ids[1] == first.entry_ids[0]
    assert second.duplicates == 1


def _weights(value: float, tag: str = "") -> bytes:
    return safetensors.numpy.save({"w": np.full(2, value, np.float32)}, metadata={"tag": tag})


def test_a_projector_with_other_weights_is_refused_unless_replaced_which_bumps_the_version_and_drops_features(
    store,
):
    ns = _namespace(store)
    assert store.get_namespace(ns).projector_version == 0
    first = store.set_projector(ns, _weights(1.0))
    assert (first.projector_version, first.projector) == (1, _weights(1.0))
    entries = [make_entry(small_layout(), 5, seed=s) for s in (1, 2)]
    ids = store.ingest(ns, entries, projector_version=1).entry_ids
    assert store.set_projector(ns, _weights(1.0)).projector_version == 1  # the same one: no change
    with pytest.raises(NamespaceExistsError, match="another projector .*replace"):
        store.set_projector(ns, _weights(2.0))  # what `admin ingest --from-store` did silently
    assert store.get_namespace(ns).projector == _weights(1.0)
    assert all(e.feature is not None for e in store.entries(ns))

    second = store.set_projector(ns, _weights(2.0), replace=True)
    assert (second.projector_version, second.projector) == (2, _weights(2.0))
    # Features of the old projector are gone in the same write; the entries (and exact hits) stay.
    assert [e.feature for e in store.entries(ns)] == [None, None]
    assert [r.id for r in store.find_by_hashes(ns, [e.token_hash for e in entries])] == ids
    with pytest.raises(ProjectorChangedError, match="version 2.*version 1"):
        store.ingest(ns, entries, projector_version=1)
    # Ingesting again with features of the new projector gives the stored entries theirs.
    report = store.ingest(ns, entries[:1], projector_version=2)
    assert (report.entry_ids, report.added, report.featured) == (ids[:1], [], ids[:1])
    features = {e.id: e.feature for e in store.entries(ns)}
    np.testing.assert_array_equal(features[ids[0]], entries[0].feature)
    assert features[ids[1]] is None


def test_a_projector_with_the_same_weights_and_a_new_gate_is_a_new_version_that_keeps_the_features(store):
    ns = _namespace(store)
    store.set_projector(ns, _weights(1.0))
    store.ingest(ns, [make_entry(small_layout(), 5, seed=1)])
    updated = store.set_projector(ns, _weights(1.0, tag="gate"))  # features project as before: no replace
    assert (updated.projector_version, updated.projector) == (2, _weights(1.0, tag="gate"))
    assert all(e.feature is not None for e in store.entries(ns))


def _featureless(store: MapStoreBase, ns: str, count: int = 3) -> list[int]:
    """Entries with maps and no feature vector, as write-back stores them; the namespace gets projector version 1."""
    store.set_projector(ns, _weights(1.0))
    entries = [make_entry(small_layout(), 5 + seed, seed=seed, feature=False) for seed in range(count)]
    return store.ingest(ns, entries).entry_ids


def _features(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(count, small_layout().feature_dim)).astype(np.float32)


def test_set_features_gives_entries_vectors_replacing_old_ones_and_reports_gone_ids(store):
    ns = _namespace(store)
    ids = _featureless(store, ns)
    store.delete(ns, [ids[2]])
    first = _features(3)
    report = store.set_features(ns, ids, first, projector_version=1)
    assert (report.updated, report.lengths, report.missing) == (ids[:2], [5, 6], [ids[2]])
    stored = {e.id: e.feature for e in store.entries(ns)}
    np.testing.assert_array_equal(stored[ids[0]], first[0])
    np.testing.assert_array_equal(stored[ids[1]], first[1])
    again = _features(1, seed=1)
    assert store.set_features(ns, ids[1:2], again, projector_version=1).updated == ids[1:2]
    np.testing.assert_array_equal(store.entry(ns, ids[1]).feature, again[0])
    np.testing.assert_array_equal(store.entry(ns, ids[0]).feature, first[0])  # untouched
    assert all(e.has_maps for e in store.entries(ns))


def test_set_features_of_another_projector_version_is_refused_and_writes_nothing(store):
    ns = _namespace(store)
    with pytest.raises(ProjectorChangedError, match="version 0.*version 1"):
        store.set_features(ns, [], _features(0), projector_version=1)  # no projector yet
    ids = _featureless(store, ns)
    store.set_projector(ns, _weights(2.0), replace=True)
    with pytest.raises(ProjectorChangedError, match="version 2.*version 1"):
        store.set_features(ns, ids, _features(3), projector_version=1)
    assert [e.feature for e in store.entries(ns)] == [None, None, None]


@pytest.mark.parametrize(
    ("ids", "features", "version", "error", "match"),
    [
        ([1, 2, 3], _features(3)[:, :8], 1, MapShapeError, r"shape \(3, 8\).*\(3, 16\)"),
        ([1, 2, 3], _features(2), 1, MapShapeError, r"shape \(2, 16\)"),
        ([1, 2, 3], np.full((3, 16), np.nan, np.float32), 1, MapShapeError, "NaN or inf"),
        ([1, 2, 1], _features(3), 1, ConfigError, r"entry ids \[1\] are given more than once"),
        ([1, 0, 3], _features(3), 1, ConfigError, r"entry id 0 \(position 1\)"),
        ([1, 2, 3], _features(3), 0, ConfigError, "must be stated"),
        ([1, 2, 3], _features(3).astype(np.int64), 1, MapShapeError, "dtype int64"),
    ],
)
def test_set_features_with_bad_arguments_is_refused_and_writes_nothing(store, ids, features, version, error, match):
    ns = _namespace(store)
    assert _featureless(store, ns) == [1, 2, 3]
    with pytest.raises(error, match=match):
        store.set_features(ns, ids, features, projector_version=version)
    assert [e.feature for e in store.entries(ns)] == [None, None, None]


def test_set_features_refuses_an_entry_that_stores_outputs_only_and_writes_nothing(store):
    if not store.supports_outputs_only:
        pytest.skip("the store keeps no outputs-only entries (supports_outputs_only)")
    ns = _namespace(store)
    ids = _featureless(store, ns, count=1)
    entry = make_entry(small_layout(), 7, seed=9, feature=False)
    (outputs_only,) = store.ingest(ns, [NewEntry(maps=None, token_hash=entry.token_hash,
                                                 outputs=entry.outputs, token_ids=entry.token_ids)]).entry_ids
    assert [e.has_maps for e in store.entries(ns)] == [True, False]
    with pytest.raises(MapShapeError, match=f"entry {outputs_only} .* stores outputs only"):
        store.set_features(ns, [ids[0], outputs_only], _features(2), projector_version=1)
    assert [e.feature for e in store.entries(ns)] == [None, None]


def test_token_limits_are_recorded_with_a_namespace_and_added_to_one_made_before_them(store):
    limits = TokenLimits(vocab_size=30522, max_length=512)
    made = store.create_namespace("new", model="m", fingerprint="fp", layout=small_layout(), limits=limits)
    assert made.limits == store.get_namespace("new").limits == limits
    old = store.create_namespace("old", model="m", fingerprint="fp", layout=small_layout())
    assert old.limits is None
    upgraded = store.create_namespace("old", model="m", fingerprint="fp", layout=small_layout(), limits=limits)
    assert upgraded.limits == store.get_namespace("old").limits == limits
    other = TokenLimits(vocab_size=5, max_length=5)
    assert store.create_namespace("old", model="m", fingerprint="fp", layout=small_layout(), limits=other).limits == \
        limits  # recorded limits are kept


def test_the_writer_of_an_entry_is_recorded_and_listed(store):
    ns = _namespace(store)
    first, second = make_entry(small_layout(), 6, seed=1), make_entry(small_layout(), 6, seed=2)
    store.ingest(ns, [dataclasses.replace(first, writer="node-a"), second])
    writers = {info.token_hash: info.writer for info in store.entries(ns)}
    assert writers == {first.token_hash: "node-a", second.token_hash: None}
