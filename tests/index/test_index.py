"""Vector indexes: one shared suite for every backend, then backend and bucket specifics."""

from __future__ import annotations

import numpy as np
import pytest

from attnstore.errors import FormatVersionError, VectorIndexError
from attnstore.index import BucketedIndex, Candidate, ExactIndex, FaissIndex, FaissIndexConfig, Match, VectorIndex

DIM = 16


def _random(n: int, dim: int = DIM, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def _brute_force(stored: np.ndarray, ids: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    d = np.linalg.norm(queries[:, None, :].astype(np.float64) - stored[None, :, :], axis=2)  # (q, n)
    order = np.argsort(d, axis=1)[:, :k]
    return np.take_along_axis(d, order, axis=1), ids[order].astype(np.int64)


class VectorIndexTests:
    """Behaviour every ``VectorIndex`` backend must have; subclasses provide ``make``."""

    def make(self, dim: int = DIM) -> VectorIndex:
        raise NotImplementedError

    def test_search_returns_exact_nearest_ids_and_l2_distances(self) -> None:
        index = self.make()
        stored, ids = _random(300), np.arange(300, dtype=np.uint64) * 11 + 5
        index.add(ids, stored)
        queries = _random(40, seed=1)
        distances, found = index.search(queries, k=3)
        want_d, want_ids = _brute_force(stored, ids, queries, 3)
        assert found.dtype == np.int64 and distances.dtype == np.float32
        np.testing.assert_array_equal(found, want_ids)
        np.testing.assert_allclose(distances, want_d, rtol=1e-4, atol=1e-4)

    def test_distance_is_not_squared(self) -> None:
        index = self.make(2)
        index.add(np.array([7]), np.array([[0.0, 0.0]], dtype=np.float32))
        distances, ids = index.search(np.array([[3.0, 4.0]], dtype=np.float32))
        assert ids[0, 0] == 7
        assert distances[0, 0] == pytest.approx(5.0, rel=1e-6)

    def test_exact_duplicate_comes_back_at_distance_zero(self) -> None:
        index = self.make()
        stored = _random(50) * 10
        index.add(np.arange(50), stored)
        distances, ids = index.search(stored[[17]])
        assert ids[0, 0] == 17
        assert distances[0, 0] < 1e-3

    def test_k_beyond_size_pads_with_minus_one_and_inf(self) -> None:
        index = self.make()
        index.add(np.array([1, 2]), _random(2))
        distances, ids = index.search(_random(3, seed=2), k=4)
        assert (ids[:, 2:] == -1).all() and np.isinf(distances[:, 2:]).all()
        assert (ids[:, :2] >= 1).all()

    def test_empty_index_finds_nothing(self) -> None:
        distances, ids = self.make().search(_random(2), k=2)
        assert (ids == -1).all() and np.isinf(distances).all()

    def test_remove_hides_ids_and_counts_only_present_ones(self) -> None:
        index = self.make()
        stored = _random(100)
        index.add(np.arange(100), stored)
        assert index.remove(np.array([3, 4, 1000])) == 2
        assert len(index) == 98
        _, ids = index.search(stored[[3, 4]], k=5)
        assert not np.isin(ids, [3, 4]).any()
        assert index.remove(np.array([3])) == 0

    def test_removed_id_can_be_added_again(self) -> None:
        index = self.make()
        stored = _random(20)
        index.add(np.arange(20), stored)
        index.remove(np.array([5]))
        index.add(np.array([5]), stored[[9]])
        distances, ids = index.search(stored[[9]], k=2)
        assert set(ids[0].tolist()) == {5, 9}
        assert distances.max() < 1e-3

    def test_adding_a_present_id_is_refused(self) -> None:
        index = self.make()
        index.add(np.array([1, 2]), _random(2))
        with pytest.raises(VectorIndexError, match="already present"):
            index.add(np.array([2, 3]), _random(2, seed=3))
        assert len(index) == 2

    @pytest.mark.parametrize(
        ("ids", "vectors", "message"),
        [
            (np.array([1, 1]), _random(2), "repeat"),
            (np.array([-1]), _random(1), ">= 0"),
            (np.array([2**63], dtype=np.uint64), _random(1), "2\\*\\*63"),
            (np.array([1, 2]), _random(1), "2 ids for 1 vectors"),
            (np.array([1]), _random(1, dim=DIM + 1), "shape"),
            (np.array([1]), np.full((1, DIM), np.nan, dtype=np.float32), "NaN or Inf"),
            (np.array([1]), np.full((1, DIM), np.inf, dtype=np.float32), "NaN or Inf"),
            (np.array([1.5]), _random(1), "integers"),
            (np.array([1]), np.ones((1, DIM), dtype=np.int32), "float"),
        ],
    )
    def test_bad_add_input_raises_a_clear_value_error(self, ids: np.ndarray, vectors: np.ndarray, message: str) -> None:
        index = self.make()
        with pytest.raises(VectorIndexError, match=message) as caught:
            index.add(ids, vectors)
        assert isinstance(caught.value, ValueError)
        assert len(index) == 0

    def test_bad_queries_raise(self) -> None:
        index = self.make()
        index.add(np.array([1]), _random(1))
        with pytest.raises(VectorIndexError, match="NaN or Inf"):
            index.search(np.full((1, DIM), np.nan, dtype=np.float32))
        with pytest.raises(VectorIndexError, match="shape"):
            index.search(_random(1)[0])
        with pytest.raises(VectorIndexError, match="k must be"):
            index.search(_random(1), k=0)

    def test_bytes_round_trip_answers_the_same(self) -> None:
        index = self.make()
        stored = _random(200)
        index.add(np.arange(200, dtype=np.uint64) + 2**62, stored)
        index.remove(np.array([2**62 + 3]))
        copy = VectorIndex.from_bytes(index.to_bytes())
        assert type(copy) is type(index) and len(copy) == len(index)
        queries = _random(25, seed=4)
        for got, want in zip(copy.search(queries, k=4), index.search(queries, k=4), strict=True):
            np.testing.assert_array_equal(got, want)

    def test_foreign_or_truncated_bytes_are_refused(self) -> None:
        index = self.make()
        index.add(np.arange(5), _random(5))
        with pytest.raises(FormatVersionError, match="does not start with"):
            type(index).from_bytes(b"not an index")
        with pytest.raises(VectorIndexError, match="truncated"):
            VectorIndex.from_bytes(index.to_bytes()[:-1])


    def test_nbytes_counts_at_least_every_held_vector_and_grows_with_them(self) -> None:
        index = self.make()
        empty = index.nbytes
        index.add(np.arange(300, dtype=np.uint64), _random(300))
        assert index.nbytes >= empty + 300 * DIM * 4
        held = index.nbytes
        index.add(np.arange(300, 600, dtype=np.uint64), _random(300, seed=2))
        assert index.nbytes >= held + 300 * DIM * 4


class TestExactIndex(VectorIndexTests):
    def make(self, dim: int = DIM) -> VectorIndex:
        return ExactIndex(dim)


class TestFaissFlat(VectorIndexTests):
    def make(self, dim: int = DIM) -> VectorIndex:
        return FaissIndex(dim)

    def test_matches_exact_index_on_batches_through_the_blas_path(self) -> None:
        stored, queries = _random(2000, dim=64), _random(100, dim=64, seed=5)
        exact, flat = ExactIndex(64), FaissIndex(64)
        for index in (exact, flat):
            index.add(np.arange(2000), stored)
        d_exact, i_exact = exact.search(queries, k=5)
        d_flat, i_flat = flat.search(queries, k=5)
        np.testing.assert_array_equal(i_flat, i_exact)
        np.testing.assert_allclose(d_flat, d_exact, rtol=1e-4, atol=1e-3)
        assert not flat.is_hnsw


class TestFaissHnsw(VectorIndexTests):
    """The shared suite with the HNSW backend (switches at 16 vectors); recall is exact at this size."""

    def make(self, dim: int = DIM) -> VectorIndex:
        return FaissIndex(dim, FaissIndexConfig(hnsw_threshold=16, ef_search=256, ef_construction=200))


def test_faiss_index_switches_to_hnsw_at_the_threshold() -> None:
    index = FaissIndex(DIM, FaissIndexConfig(hnsw_threshold=100))
    index.add(np.arange(99), _random(99))
    assert not index.is_hnsw
    index.add(np.array([99]), _random(1, seed=1))
    assert index.is_hnsw and len(index) == 100


def test_hnsw_recall_at_1_on_random_data() -> None:
    stored, queries = _random(5000, dim=32), _random(200, dim=32, seed=6)
    hnsw = FaissIndex(32, FaissIndexConfig(hnsw_threshold=1000))
    hnsw.add(np.arange(5000), stored)
    assert hnsw.is_hnsw
    _, want = _brute_force(stored, np.arange(5000), queries, 1)
    _, got = hnsw.search(queries, k=1)
    assert (got[:, 0] == want[:, 0]).mean() >= 0.95


def test_hnsw_rebuilds_once_enough_is_deleted_and_shrinks_back_to_flat() -> None:
    index = FaissIndex(DIM, FaissIndexConfig(hnsw_threshold=100, rebuild_fraction=0.5))
    stored = _random(120)
    index.add(np.arange(120), stored)
    index.remove(np.arange(40))
    assert index.is_hnsw  # 40 masked of 120: below the rebuild fraction
    index.remove(np.arange(40, 80))
    assert not index.is_hnsw  # rebuilt with 40 live, under half the threshold
    _, ids = index.search(stored[80:], k=1)
    np.testing.assert_array_equal(ids[:, 0], np.arange(80, 120))


def test_backend_from_bytes_refuses_another_backends_bytes() -> None:
    exact = ExactIndex(DIM)
    exact.add(np.arange(3), _random(3))
    with pytest.raises(VectorIndexError, match="backend 'exact'"):
        FaissIndex.from_bytes(exact.to_bytes())


def test_faiss_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="hnsw_threshold"):
        FaissIndexConfig(hnsw_threshold=0)
    with pytest.raises(ValueError, match="rebuild_fraction"):
        FaissIndexConfig(rebuild_fraction=0.0)


def _bucketed(causal_lengths: dict[int, np.ndarray]) -> BucketedIndex:
    index = BucketedIndex(2, ExactIndex)
    next_id = 0
    for length, vectors in causal_lengths.items():
        n = vectors.shape[0]
        index.add(np.arange(next_id, next_id + n), vectors.astype(np.float32), np.full(n, length))
        next_id += n
    return index


def test_bidirectional_search_uses_only_the_exact_length() -> None:
    index = _bucketed({5: np.array([[10.0, 0.0]]), 6: np.array([[0.0, 0.0]])})
    matches = index.search(np.zeros((2, 2), np.float32), np.array([5, 7]), causal=False, max_distance=100.0)
    assert matches[0] == Match(0, 10.0, 5)
    assert matches[1] == Match(None, float("inf"), None)


def test_causal_search_adds_the_length_penalty_and_never_uses_shorter_entries() -> None:
    index = _bucketed({4: np.array([[0.0, 0.0]]), 5: np.array([[3.0, 0.0]]), 7: np.array([[0.5, 0.0]])})
    queries = np.zeros((1, 2), np.float32)
    # Same length at 3.0 versus two tokens longer at 0.5 + 2 * 1.0.
    assert index.search(queries, np.array([5]), causal=True, max_distance=10.0)[0] == Match(2, 2.5, 7)
    steep = index.search(queries, np.array([5]), causal=True, max_distance=10.0, length_penalty=2.0)
    assert steep[0] == Match(1, 3.0, 5)
    assert index.search(queries, np.array([8]), causal=True, max_distance=10.0)[0].entry_id is None


def test_candidates_merge_buckets_nearest_first_and_keep_k() -> None:
    index = _bucketed({5: np.array([[3.0, 0.0], [1.0, 0.0]]), 7: np.array([[0.5, 0.0], [9.0, 0.0]])})
    queries = np.zeros((1, 2), np.float32)
    (found,) = index.candidates(queries, np.array([5]), causal=True, k=3)
    # 1.0 (same length), 0.5 + 2 tokens longer = 2.5, 3.0; the fourth (9.0 + 2) is dropped.
    assert found == [Candidate(1, 1.0, 5), Candidate(2, 2.5, 7), Candidate(0, 3.0, 5)]
    (exact_length,) = index.candidates(queries, np.array([5]), causal=False, k=5)
    assert [c.entry_id for c in exact_length] == [1, 0]
    with pytest.raises(VectorIndexError, match="k must be"):
        index.candidates(queries, np.array([5]), causal=False, k=0)


def test_threshold_decides_hit_and_a_miss_keeps_the_nearest_distance() -> None:
    index = _bucketed({3: np.array([[0.3, 0.4]])})
    hit, miss = (
        index.search(np.zeros((1, 2), np.float32), np.array([3]), causal=False, max_distance=t)[0] for t in (0.5, 0.49)
    )
    assert hit.hit and hit.distance == pytest.approx(0.5) and hit.similarity == pytest.approx(0.5)
    assert not miss.hit and miss.distance == pytest.approx(0.5) and miss.stored_length is None


def test_bucketed_remove_and_len_cover_every_bucket() -> None:
    index = _bucketed({3: _random(4, dim=2), 9: _random(5, dim=2, seed=1)})
    assert len(index) == 9 and index.lengths == (3, 9)
    assert index.remove(np.array([0, 8, 99])) == 2
    assert len(index) == 7


def test_bucketed_search_validates_lengths_and_threshold() -> None:
    index = _bucketed({3: _random(2, dim=2)})
    with pytest.raises(VectorIndexError, match="lengths"):
        index.search(_random(1, dim=2), np.array([0]), causal=False, max_distance=1.0)
    with pytest.raises(VectorIndexError, match="expected 1 lengths"):
        index.search(_random(1, dim=2), np.array([3, 3]), causal=False, max_distance=1.0)
    with pytest.raises(VectorIndexError, match="max_distance"):
        index.search(_random(1, dim=2), np.array([3]), causal=False, max_distance=float("nan"))


def test_bucketed_default_backend_is_faiss_and_buckets_persist_through_bytes() -> None:
    index = BucketedIndex(DIM)
    index.add(np.arange(10), _random(10), np.full(10, 4))
    bucket = index.bucket(4)
    assert isinstance(bucket, FaissIndex)
    restored = BucketedIndex(DIM)
    restored.set_bucket(4, VectorIndex.from_bytes(bucket.to_bytes()))
    queries = _random(3, seed=9)
    lengths = np.full(3, 4)
    assert restored.search(queries, lengths, causal=False, max_distance=9.0) == index.search(
        queries, lengths, causal=False, max_distance=9.0
    )


def test_bucketed_nbytes_is_the_sum_of_its_buckets() -> None:
    index = BucketedIndex(DIM)
    index.add(np.arange(30, dtype=np.uint64), _random(30), np.array([5] * 10 + [9] * 20))
    assert index.nbytes == sum(bucket.nbytes for _, bucket in index.buckets()) > 30 * DIM * 4
