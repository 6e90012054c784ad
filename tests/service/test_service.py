"""The store service: exact tier first, thresholded vector search, index kept in step."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import safetensors.numpy

from attnstore.errors import FingerprintMismatchError, MapShapeError, NamespaceNotFoundError, NamespaceNotReadyError
from attnstore.index import ExactIndex
from attnstore.projector.blob import GATE_METADATA_KEY
from attnstore.projector.gate import FidelityGate
from attnstore.service import AttnStoreService, IngestResult, Query
from attnstore.store import LmdbMapStore, MemoryMapStore, NamespaceLayout, NewEntry

FP = "f" * 64
LAYERS, HEADS, HIDDEN, DIM = 2, 3, 8, 4


def _softmax_maps(length: int, seed: int, causal: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(LAYERS, HEADS, length, length))
    if causal:
        logits = np.where(np.tril(np.ones((length, length), dtype=bool)), logits, -np.inf)
    maps = np.exp(logits - logits.max(-1, keepdims=True))
    return (maps / maps.sum(-1, keepdims=True)).astype(np.float32)


def _entry(length: int, seed: int, feature: list[float], *, causal: bool = False) -> NewEntry:
    return NewEntry(
        maps=_softmax_maps(length, seed, causal),
        token_hash=seed.to_bytes(32, "little"),
        outputs=np.full((length, HIDDEN), seed, dtype=np.float32),
        feature=np.array(feature, dtype=np.float32),
    )


def _service(causal: bool = False, store=None) -> AttnStoreService:
    service = AttnStoreService(store or MemoryMapStore(), make_index=ExactIndex)
    layout = NamespaceLayout(layers=LAYERS, heads=HEADS, causal=causal, hidden=HIDDEN, feature_dim=DIM)
    service.create_namespace("ns", model="tiny", fingerprint=FP, layout=layout)
    return service


def test_exact_tier_answers_before_the_index() -> None:
    service = _service()
    (entry_id,) = service.ingest("ns", FP, [_entry(5, 1, [0, 0, 0, 0])]).entry_ids
    query = Query(feature=np.array([9, 9, 9, 9], dtype=np.float32), length=5, token_hash=(1).to_bytes(32, "little"))
    (match,) = service.lookup("ns", FP, [query], max_distance=0.1)
    assert (match.kind, match.entry_id, match.distance) == ("exact", entry_id, 0.0)
    np.testing.assert_array_equal(service.store.read_outputs("ns", entry_id), np.full((5, HIDDEN), 1, np.float16))


@pytest.mark.parametrize("claimed", [4, 6, 2**32 - 1])
def test_an_exact_hit_needs_the_stored_length_not_whatever_length_the_query_claims(claimed: int) -> None:
    service = _service()
    service.ingest("ns", FP, [_entry(5, 1, [0, 0, 0, 0])])
    query = Query(np.array([9, 9, 9, 9], dtype=np.float32), length=claimed, token_hash=(1).to_bytes(32, "little"))
    (match,) = service.lookup("ns", FP, [query], max_distance=0.1)
    assert match.kind == "miss"


def test_exact_hits_of_a_batch_are_found_in_one_store_read_in_row_order() -> None:
    service = _service()
    ids = service.ingest("ns", FP, [_entry(5, 1, [0, 0, 0, 0]), _entry(7, 2, [1, 0, 0, 0])]).entry_ids
    refs = service.store.find_by_hashes("ns", [(2).to_bytes(32, "little"), (3).to_bytes(32, "little"),
                                               (1).to_bytes(32, "little")])
    assert [(r.id, r.length) if r else None for r in refs] == [(ids[1], 7), None, (ids[0], 5)]


def test_nearest_entry_within_threshold_is_a_map_hit_and_farther_is_a_miss() -> None:
    service = _service()
    ids = service.ingest("ns", FP, [_entry(5, 1, [0, 0, 0, 0]), _entry(5, 2, [1, 0, 0, 0])]).entry_ids
    near = Query(feature=np.array([0.9, 0, 0, 0], dtype=np.float32), length=5)
    far = Query(feature=np.array([5, 5, 5, 5], dtype=np.float32), length=5)
    hit, miss = service.lookup("ns", FP, [near, far], max_distance=0.5)
    assert hit.kind == "map" and hit.entry_id == ids[1] and hit.distance == pytest.approx(0.1, abs=1e-6)
    assert miss.kind == "miss" and miss.entry_id is None and miss.distance > 0.5


def test_bidirectional_queries_only_match_their_own_length() -> None:
    service = _service()
    service.ingest("ns", FP, [_entry(6, 1, [0, 0, 0, 0])])
    (match,) = service.lookup("ns", FP, [Query(np.zeros(DIM, np.float32), 5)], max_distance=10.0)
    assert match.kind == "miss"


def test_causal_queries_reuse_a_longer_entry_cropped() -> None:
    service = _service(causal=True)
    (entry_id,) = service.ingest("ns", FP, [_entry(6, 1, [0, 0, 0, 0], causal=True)]).entry_ids
    (match,) = service.lookup("ns", FP, [Query(np.zeros(DIM, np.float32), 5)], max_distance=10.0)
    assert (match.kind, match.entry_id, match.stored_length) == ("map", entry_id, 6)
    full = service.read_layer("ns", entry_id, 1)
    cropped = service.read_layer("ns", entry_id, 1, length=5)
    np.testing.assert_array_equal(cropped, full[:, :5, :5])


def test_bidirectional_entries_cannot_be_cropped() -> None:
    service = _service()
    (entry_id,) = service.ingest("ns", FP, [_entry(6, 1, [0, 0, 0, 0])]).entry_ids
    with pytest.raises(MapShapeError, match="bidirectional"):
        service.read_layer("ns", entry_id, 0, length=5)


def test_wrong_fingerprint_is_refused_with_the_namespace_model_named() -> None:
    service = _service()
    with pytest.raises(FingerprintMismatchError, match="tiny"):
        service.lookup("ns", "0" * 64, [Query(np.zeros(DIM, np.float32), 5)], max_distance=1.0)
    with pytest.raises(FingerprintMismatchError):
        service.ingest("ns", "0" * 64, [_entry(5, 1, [0, 0, 0, 0])])


def test_unknown_namespace_and_wrong_feature_dimension_raise() -> None:
    service = _service()
    with pytest.raises(NamespaceNotFoundError):
        service.lookup("nope", FP, [], max_distance=1.0)
    with pytest.raises(MapShapeError, match="4 values"):
        service.lookup("ns", FP, [Query(np.zeros(3, np.float32), 5)], max_distance=1.0)


def test_duplicates_are_stored_once_and_counted() -> None:
    service = _service()
    first = service.ingest("ns", FP, [_entry(5, 1, [0, 0, 0, 0])])
    again = service.ingest("ns", FP, [_entry(5, 1, [0, 0, 0, 0]), _entry(5, 2, [1, 1, 1, 1])])
    assert again.entry_ids[0] == first.entry_ids[0] and again.duplicates == 1
    assert len(list(service.store.entries("ns"))) == 2


def test_deleted_entries_leave_the_index() -> None:
    service = _service()
    (entry_id,) = service.ingest("ns", FP, [_entry(5, 1, [0, 0, 0, 0])]).entry_ids
    service.delete("ns", [entry_id])
    (match,) = service.lookup("ns", FP, [Query(np.zeros(DIM, np.float32), 5)], max_distance=1.0)
    assert match.kind == "miss"


@pytest.mark.parametrize("backend", ["lmdb", "memory"])
def test_entries_evicted_by_the_byte_cap_leave_the_index_at_once(tmp_path, backend) -> None:
    entry_bytes = 2 * LAYERS * HEADS * 5 * 5 + 2 * 5 * HIDDEN  # fp16 maps and outputs of one length-5 entry
    cap = 3 * entry_bytes
    if backend == "lmdb":
        store = LmdbMapStore.open(tmp_path / "s", create=True, max_bytes=cap)
    else:
        store = MemoryMapStore(max_bytes=cap)
    service = _service(store=store)
    features = [[float(i), 0, 0, 0] for i in range(6)]
    ids = [service.ingest("ns", FP, [_entry(5, i + 1, features[i])]).entry_ids[0] for i in range(6)]
    live = {e.id for e in service.store.entries("ns")}
    evicted = [entry_id for entry_id in ids if entry_id not in live]
    assert evicted, "the cap must have evicted something for this test to mean anything"
    queries = [Query(np.array(f, dtype=np.float32), 5) for f in features]
    matches = service.lookup("ns", FP, queries, max_distance=0.01)
    for entry_id, match in zip(ids, matches, strict=True):
        if entry_id in live:
            assert (match.kind, match.entry_id) == ("map", entry_id)
        else:
            assert match.kind == "miss"  # never a hit on an entry whose maps are gone
    service.close()


def test_concurrent_ingests_of_one_new_input_both_succeed_and_index_it_once(tmp_path) -> None:
    service = _service(store=LmdbMapStore.open(tmp_path / "s", create=True))
    with ThreadPoolExecutor(2) as pool:
        for seed in range(1, 21):
            start = threading.Barrier(2)

            def ingest(entry: NewEntry = _entry(5, seed, [float(seed), 0, 0, 0]), start=start) -> IngestResult:
                start.wait()  # both threads check for the hash before either commits
                return service.ingest("ns", FP, [entry])

            results = [future.result() for future in [pool.submit(ingest) for _ in range(2)]]  # raises what they raised
            assert sorted(r.duplicates for r in results) == [0, 1]
            assert results[0].entry_ids == results[1].entry_ids
    (match,) = service.lookup("ns", FP, [Query(np.array([7.0, 0, 0, 0], np.float32), 5)], max_distance=0.01)
    assert match.kind == "map" and len(list(service.store.entries("ns"))) == 20
    service.close()


def test_reopened_lmdb_store_rebuilds_its_index_from_stored_features(tmp_path) -> None:
    service = _service(store=LmdbMapStore.open(tmp_path / "store", create=True))
    (entry_id,) = service.ingest("ns", FP, [_entry(5, 1, [0.5, 0, 0, 0])]).entry_ids
    service.close()
    with AttnStoreService.open(tmp_path / "store") as reopened:
        (match,) = reopened.lookup("ns", FP, [Query(np.zeros(DIM, np.float32), 5)], max_distance=1.0)
        assert (match.kind, match.entry_id) == ("map", entry_id)
        compacted = reopened.compact()
        assert compacted.entries == 1
        (match,) = reopened.lookup("ns", FP, [Query(np.zeros(DIM, np.float32), 5)], max_distance=1.0)
        assert match.entry_id == entry_id


def _gated_service(store=None, gate: FidelityGate | None = None) -> AttnStoreService:
    """A namespace whose projector blob carries a gate (by default one that trusts entries with the query's tokens)."""
    service = _service(store=store)
    gate = gate or FidelityGate(weights=(-1.0, 0.0, 0.0, 0.0, -5.0, 0.0), bias=3.0, min_probability=0.9,
                                candidates=2, fidelity=0.99, precision=0.95)
    blob = safetensors.numpy.save({"weight": np.zeros(1, np.float32)}, metadata={GATE_METADATA_KEY: gate.to_json()})
    service.set_projector("ns", blob)
    return service


def _with_tokens(entry: NewEntry, tokens: list[int]) -> NewEntry:
    return dataclasses.replace(entry, token_ids=np.array(tokens))


def test_a_gated_lookup_serves_the_candidate_whose_tokens_match_over_the_nearer_one() -> None:
    service = _gated_service()
    near, same = service.ingest("ns", FP, [_with_tokens(_entry(5, 1, [0, 0, 0, 0]), [1, 2, 3, 4, 5]),
                                          _with_tokens(_entry(5, 2, [1, 0, 0, 0]), [1, 2, 3, 4, 9])]).entry_ids
    feature = np.array([0.1, 0, 0, 0], dtype=np.float32)
    hit, miss = service.lookup("ns", FP, [Query(feature, 5, token_ids=np.array([1, 2, 3, 4, 9])),
                                          Query(feature, 5, token_ids=np.array([7, 7, 7, 7, 7]))],
                               max_distance=0.0, gate=True)
    assert (hit.kind, hit.entry_id) == ("map", same) and hit.distance == pytest.approx(0.9, abs=1e-6)
    assert hit.probability > 0.9
    assert miss.kind == "miss" and miss.entry_id is None and miss.probability < 0.9
    (plain,) = service.lookup("ns", FP, [Query(feature, 5)], max_distance=0.5)
    assert plain.entry_id == near  # the distance rule alone takes the nearer entry


@pytest.mark.parametrize(("precision", "served"), [(0.95, False), (0.85, True)])
def test_a_gated_candidate_needs_the_gates_precision_as_its_own_probability_not_only_min_probability(
    precision: float, served: bool
) -> None:
    # Every candidate is P(faithful) = sigmoid(2.2) = 0.90: over min_probability, under a 0.95 precision.
    gate = FidelityGate(weights=(0.0,) * 6, bias=2.2, min_probability=0.5, candidates=2, fidelity=0.99,
                        precision=precision)
    service = _gated_service(gate=gate)
    (entry_id,) = service.ingest("ns", FP, [_with_tokens(_entry(5, 1, [0, 0, 0, 0]), [1, 2, 3, 4, 5])]).entry_ids
    (match,) = service.lookup("ns", FP, [Query(np.zeros(4, np.float32), 5, token_ids=np.array([1, 2, 3, 4, 6]))],
                              max_distance=0.0, gate=True)
    assert match.probability == pytest.approx(0.900, abs=1e-3)
    assert (match.kind, match.entry_id) == (("map", entry_id) if served else ("miss", None))


def test_entries_stored_without_token_ids_are_never_gated_hits() -> None:
    service = _gated_service()
    service.ingest("ns", FP, [_entry(5, 1, [0, 0, 0, 0])])
    (match,) = service.lookup("ns", FP, [Query(np.zeros(DIM, np.float32), 5, token_ids=np.arange(5))],
                              max_distance=1.0, gate=True)
    assert match.kind == "miss"


def test_a_gated_lookup_needs_a_gate_and_token_ids_of_the_query_length() -> None:
    service = _service()
    with pytest.raises(NamespaceNotReadyError, match="no fidelity gate"):
        service.lookup("ns", FP, [Query(np.zeros(DIM, np.float32), 5, token_ids=np.arange(5))],
                       max_distance=0.1, gate=True)
    gated = _gated_service()
    with pytest.raises(MapShapeError, match="needs the row's token ids"):
        gated.lookup("ns", FP, [Query(np.zeros(DIM, np.float32), 5)], max_distance=0.1, gate=True)
    with pytest.raises(MapShapeError, match="for length 5"):
        gated.lookup("ns", FP, [Query(np.zeros(DIM, np.float32), 5, token_ids=np.arange(4))],
                     max_distance=0.1, gate=True)


def test_token_ids_are_stored_with_the_entry_and_survive_a_reopen(tmp_path) -> None:
    with LmdbMapStore.open(tmp_path / "store", create=True) as store:
        service = _service(store=store)
        (entry_id,) = service.ingest("ns", FP, [_with_tokens(_entry(5, 1, [0, 0, 0, 0]), [5, 4, 3, 2, 1])]).entry_ids
    with LmdbMapStore.open(tmp_path / "store") as store:
        np.testing.assert_array_equal(store.entry("ns", entry_id).token_ids, [5, 4, 3, 2, 1])


def test_token_ids_of_the_wrong_length_are_refused_and_nothing_is_stored() -> None:
    service = _service()
    with pytest.raises(MapShapeError, match="token_ids shape"):
        service.ingest("ns", FP, [_with_tokens(_entry(5, 1, [0, 0, 0, 0]), [1, 2, 3])])
    assert list(service.store.entries("ns")) == []


@pytest.mark.parametrize("backend", ["memory", "lmdb"])
def test_features_set_on_stored_entries_are_searchable_at_once_and_replace_their_old_rows(tmp_path, backend) -> None:
    store = MemoryMapStore() if backend == "memory" else LmdbMapStore.open(tmp_path / "store", create=True)
    service = _service(store=store)
    service.set_projector("ns", safetensors.numpy.save({"w": np.zeros(2, np.float32)}))
    featureless = [dataclasses.replace(_entry(5, seed, [0, 0, 0, 0]), feature=None) for seed in (1, 2)]
    ids = service.ingest("ns", FP, featureless).entry_ids
    origin = Query(np.zeros(DIM, np.float32), 5)
    assert service.lookup("ns", FP, [origin], max_distance=10.0)[0].kind == "miss"  # nothing indexed yet

    report = service.set_features("ns", ids, np.array([[1, 0, 0, 0], [3, 0, 0, 0]], np.float32), projector_version=1)
    assert report.updated == ids
    (hit,) = service.lookup("ns", FP, [origin], max_distance=10.0)
    assert (hit.kind, hit.entry_id, hit.distance) == ("map", ids[0], pytest.approx(1.0))
    service.set_features("ns", ids[:1], np.array([[5, 0, 0, 0]], np.float32), projector_version=1)
    (hit,) = service.lookup("ns", FP, [origin], max_distance=10.0)  # the old row of ids[0] is gone
    assert (hit.kind, hit.entry_id, hit.distance) == ("map", ids[1], pytest.approx(3.0))
    service.close()
