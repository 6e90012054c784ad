"""One call through the tiers: repeats once (across chunks too), the local tier, the store's exact tier before any
projection, map hits replaying in forwards of their own, rows pooled as each forward ends, and map lookups only
where the cost model expects them to pay."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from attnstore.index import ExactIndex
from attnstore.protocol.records import LookupBatch
from attnstore.server.auth import TokenTable
from attnstore.server.server import create_server
from attnstore.service import AttnStoreService
from attnstore.service.admission import Admission, AdmissionConfig
from attnstore.store import MemoryMapStore
from attnstore_client.adapters.batch import Batch
from attnstore_client.cache import AttnCache
from attnstore_client.call.rows import ROW_KINDS
from attnstore_client.connection import Match
from attnstore_client.connection.daemon import DaemonClient
from attnstore_client.connection.local import LocalConnection
from attnstore_client.tiers import compute
from attnstore_client.tiers.cost_model import CostSettings
from attnstore_client.tiers.write_back import WriteBackSettings
from attnstore_tools.admin.cold_start import create_exact_namespace
from tests.support.caches import fill_namespace, mean_pooled, sentences, tiny_loaded

TEXTS = sentences(12, seed=11)
STORED = TEXTS[:4]
TOLERANCE = 2e-3  # fp16 maps and outputs


class CountingConnection(LocalConnection):
    """A real embedded connection that records which rows each tier was asked for."""

    def __init__(self, service: AttnStoreService) -> None:
        super().__init__("local:memory", service)
        self.exact_rows: list[int] = []  # rows per exact-tier call
        self.searched_rows: list[int] = []  # rows per search

    def exact(self, namespace: str, fingerprint: str, hashes: Sequence[bytes], lengths: Sequence[int], *,
              timeout: float | None) -> dict[int, np.ndarray]:
        self.exact_rows.append(len(hashes))
        return super().exact(namespace, fingerprint, hashes, lengths, timeout=timeout)

    def search(self, batch: LookupBatch, *, timeout: float | None) -> list[Match]:
        self.searched_rows.append(len(batch.lengths))
        return super().search(batch, timeout=timeout)


@pytest.fixture(scope="module")
def bert():
    return tiny_loaded("bert")


@pytest.fixture()
def service(bert) -> AttnStoreService:
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, bert, STORED)
    return service


def _forward_sizes(cache: AttnCache) -> list[tuple[int, int]]:
    """Records (rows, rows replaying) of every forward the cache's adapter runs, packed or padded."""
    calls: list[tuple[int, int]] = []
    adapter = cache.adapter
    packed, padded = adapter.forward_packed, adapter.forward

    def recorded_packed(batch, replay=None, keep=()):
        calls.append((batch.size, len(replay or {})))
        return packed(batch, replay, keep)

    def recorded_padded(batch: Batch, replay=None):
        calls.append((batch.size, len(replay or {})))
        return padded(batch, replay)

    adapter.forward_packed = recorded_packed  # type: ignore[method-assign]
    adapter.forward = recorded_padded  # type: ignore[method-assign]
    return calls


def test_identical_rows_in_one_call_are_computed_once_and_every_copy_answered(bert, service) -> None:
    texts = [TEXTS[5], TEXTS[6], TEXTS[5], TEXTS[5], TEXTS[6], TEXTS[7]]
    connection = CountingConnection(service)
    cache = AttnCache(bert, connection, exact_cache_bytes=0)
    forwards = _forward_sizes(cache)
    embeddings = cache.encode(texts, batch_size=8)
    np.testing.assert_allclose(embeddings, mean_pooled(bert, texts), atol=TOLERANCE)
    stats = cache.last_stats
    assert (stats.rows, stats.deduplicated, stats.misses) == (6, 3, 3)
    assert connection.exact_rows == [3] and sum(rows for rows, _ in forwards) == 3
    assert cache.last_row_kinds == ("miss",) * 6


def test_a_repeated_text_whose_first_occurrence_copies_an_earlier_row_is_answered(bert, service) -> None:
    # The case: "Quick Brown Fox", "quick brown fox", "quick brown fox" on an uncased model. The word
    # tokenizer maps capitalised words to [UNK], so rows 0 and 1 have one set of tokens and row 2 repeats row 1's
    # text: its row was never written (uninitialised memory, kind '').
    texts = ["w2 W3 w4", "w2 W5 w4", "w2 W5 w4"]
    cache = AttnCache(bert, CountingConnection(service), exact_cache_bytes=0)
    embeddings = cache.encode(texts)
    assert cache.last_row_kinds == ("miss",) * 3
    np.testing.assert_array_equal(embeddings[1], embeddings[0])
    np.testing.assert_array_equal(embeddings[2], embeddings[0])
    np.testing.assert_allclose(embeddings, mean_pooled(bert, texts), atol=TOLERANCE)


def test_repeats_of_token_duplicates_are_answered_across_windows_in_any_order(bert, service) -> None:
    # batch_size 1: a window of the stream is 16 rows, so the copies and their roots fall in different windows.
    # Capitalised words are all [UNK]: "W7 w3 w4" and "W9 w3 w4" are one row, each text repeated many times.
    rests = [text.split(" ", 1)[1] for text in sentences(6, seed=31, min_words=3, max_words=3)]
    variants = [f"W{k} {rest}" for rest in rests for k in range(4)] * 3
    texts = [variants[k] for k in np.random.default_rng(5).permutation(len(variants))]
    cache = AttnCache(bert, CountingConnection(service), exact_cache_bytes=0)
    embeddings = cache.encode(texts, batch_size=1)
    assert all(cache.last_row_kinds)
    np.testing.assert_allclose(embeddings, mean_pooled(bert, texts), atol=TOLERANCE)


def test_the_local_tier_answers_a_call_repeated_a_third_time_without_asking_the_store(bert, service) -> None:
    connection = CountingConnection(service)
    cache = AttnCache(bert, connection)
    first = cache.encode(TEXTS, batch_size=4)
    assert cache.local_tier.stats().entries == 0  # rows seen once are not kept
    cache.encode(TEXTS, batch_size=4)  # seen twice: kept
    asked = (len(connection.exact_rows), len(connection.searched_rows))
    again = cache.encode(TEXTS, batch_size=4)
    assert (len(connection.exact_rows), len(connection.searched_rows)) == asked  # not asked again
    assert cache.last_stats.local_hits == cache.last_stats.exact_hits == len(TEXTS)
    assert cache.last_stats.forward_s == 0.0
    np.testing.assert_allclose(again, first, atol=TOLERANCE)
    np.testing.assert_allclose(again, mean_pooled(bert, TEXTS), atol=TOLERANCE)
    assert cache.local_tier.stats().entries == len(TEXTS)


def test_a_local_tier_of_zero_bytes_keeps_nothing_and_the_store_is_asked_again(bert, service) -> None:
    connection = CountingConnection(service)
    cache = AttnCache(bert, connection, exact_cache_bytes=0)
    cache.encode(TEXTS[:6])
    cache.encode(TEXTS[:6])
    assert connection.exact_rows == [6, 6] and cache.last_stats.local_hits == 0
    assert cache.last_stats.exact_hits == len(STORED)


def test_exact_hits_are_answered_by_hash_before_anything_is_projected_or_searched(bert, service) -> None:
    connection = CountingConnection(service)
    cache = AttnCache(bert, connection, exact_cache_bytes=0)
    forwards = _forward_sizes(cache)
    embeddings = cache.encode(STORED)
    np.testing.assert_allclose(embeddings, mean_pooled(bert, STORED), atol=TOLERANCE)
    assert cache.last_stats.exact_hits == len(STORED)
    assert connection.searched_rows == [] and cache.last_stats.projection_s == 0.0 and forwards == []


def test_map_hits_replay_in_packed_forwards_of_their_own_and_misses_compute_in_others(
    bert, service, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Exact tier off: the stored rows are map hits, interleaved with misses in the input.
    texts = [TEXTS[4], STORED[0], TEXTS[5], STORED[1], TEXTS[6], STORED[2], TEXTS[7], TEXTS[8], TEXTS[9]]
    monkeypatch.setattr(compute, "LEAST_TOKENS", 0)  # computing forwards cut to 4 padded rows' room, as pinned here
    cache = AttnCache(bert, CountingConnection(service), exact=False)
    cache.side_by_side = False  # forwards one at a time, cut as this pins (side by side they share the room)
    forwards = _forward_sizes(cache)
    embeddings = cache.encode(texts, batch_size=4)
    np.testing.assert_allclose(embeddings, mean_pooled(bert, texts), atol=TOLERANCE)
    assert (cache.last_stats.map_hits, cache.last_stats.misses) == (3, 6)
    # One forward of the 3 hits, all replaying; the 6 misses in forwards of at most 4 rows, none replaying.
    assert forwards == [(3, 3), (4, 0), (2, 0)]
    assert cache.last_row_kinds == ("miss", "map", "miss", "map", "miss", "map", "miss", "miss", "miss")
    assert cache.last_stats.rows_by_kind() == {kind: cache.last_row_kinds.count(kind) for kind in ROW_KINDS}


def test_a_call_larger_than_a_window_answers_copies_across_windows_and_keeps_input_order(bert, service) -> None:
    cache = AttnCache(bert, CountingConnection(service), exact_cache_bytes=0)
    distinct = sentences(40, seed=31, min_words=2, max_words=9)
    texts = distinct + distinct[::-1] + distinct[:7]  # 87 rows; a window is 16 batches of 2 rows
    embeddings = cache.encode(texts, batch_size=2)
    np.testing.assert_allclose(embeddings, mean_pooled(bert, texts), atol=TOLERANCE)
    stats = cache.last_stats
    assert (stats.rows, stats.deduplicated, stats.misses) == (87, 47, 40)
    assert cache.last_row_kinds == ("miss",) * 87


def test_each_forward_is_pooled_as_it_ends_never_the_whole_call_at_once(
    bert, service, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = AttnCache(bert, CountingConnection(service), exact_cache_bytes=0)
    monkeypatch.setattr(compute, "LEAST_TOKENS", 0)  # forwards of these short rows cut to 8 padded rows' room
    pooled: list[int] = []
    pool_rows = cache.head.pool_rows

    def recorded(hidden, prompt_length=0):
        pooled.append(hidden.size)
        return pool_rows(hidden, prompt_length)

    cache.head.pool_rows = recorded  # type: ignore[method-assign]
    texts = sentences(50, seed=32, min_words=2, max_words=9)
    cache.encode(texts, batch_size=8)
    # Packed forwards hold the tokens of 8 padded rows (their longest times 8), so more rows where they are short.
    assert sum(pooled) == 50 and len(pooled) > 1 and max(pooled) < 50


def test_time_outside_the_tiers_is_reported_apart_from_each_tiers_time(bert, service) -> None:
    cache = AttnCache(bert, CountingConnection(service), exact_cache_bytes=0)
    cache.encode(TEXTS, batch_size=4)
    stats = cache.last_stats
    assert set(stats.tier_s) == {"local_exact", "store_exact", "chunks", "prefix", "maps", "compute"}
    assert 0.0 < stats.overhead_s < stats.total_s
    assert stats.overhead_s + sum(stats.tier_s.values()) == pytest.approx(stats.total_s, rel=1e-6)


def test_once_forward_times_are_fitted_short_rows_skip_the_padding_of_long_ones_in_a_forward_of_their_own(
    bert, service
) -> None:
    cache = AttnCache(bert, CountingConnection(service), cost=CostSettings(min_forwards=4, decay=1.0), packed=False)
    cache.maps = False
    texts = sentences(2, seed=21, min_words=40, max_words=40) + sentences(6, seed=22, min_words=2, max_words=2)
    forwards = _forward_sizes(cache)
    cache.encode(texts, batch_size=8)
    assert [rows for rows, _ in forwards] == [8]  # no times fitted yet: one full batch, as the plain model does
    # Forwards that cost as much as 100 padded tokens each: padding six 4-token rows to about 42 costs more.
    for rows, padded in [(1, 8), (8, 8), (1, 64), (8, 64)]:
        cache.cost_model.record_forward(padded, computed_tokens=rows * padded, replayed_tokens=0,
                                        seconds=1e-4 * (100 + rows * padded))
    forwards.clear()
    texts = sentences(6, seed=23, min_words=2, max_words=2) + sentences(2, seed=24, min_words=40, max_words=40)
    embeddings = cache.encode(texts, batch_size=8)
    np.testing.assert_allclose(embeddings, mean_pooled(bert, texts), atol=TOLERANCE)
    assert [rows for rows, _ in forwards] == [2, 6]


def test_packed_and_padded_forwards_give_the_same_embeddings(bert, service) -> None:
    texts = sentences(30, seed=33, min_words=2, max_words=20)
    cache = AttnCache(bert, CountingConnection(service), exact=False)
    cache.maps = False
    packed = cache.encode(texts, batch_size=8)
    tokens = cache.last_stats.forward_tokens
    assert tokens > 0 and cache.last_stats.forwarded_tokens == tokens  # nothing padded
    cache.packed = False
    padded = cache.encode(texts, batch_size=8)
    assert cache.last_stats.forward_tokens == tokens < cache.last_stats.forwarded_tokens
    np.testing.assert_allclose(packed, padded, atol=1e-5)
    np.testing.assert_allclose(packed, mean_pooled(bert, texts), atol=1e-5)


def test_an_all_miss_workload_stops_asking_for_maps_after_the_warm_up_and_explores_a_small_share(bert) -> None:
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, bert, STORED)
    connection = CountingConnection(service)
    # Threshold 0: nothing the store holds is close enough, so every lookup is wasted.
    cache = AttnCache(bert, connection, max_distance=0.0, exact_cache_bytes=0,
                      cost=CostSettings(min_samples=16, explore=0.05, seed=3))
    traffic = sentences(400, seed=12, min_words=5, max_words=8)  # one length band (5-8 tokens)
    cache.encode(traffic[:40], batch_size=8)  # the warm-up: the band's first 16 rows asked, a few more explored
    warm_up = sum(connection.searched_rows)
    assert 16 <= warm_up <= 16 + 8 and cache.last_stats.skipped == 40 - warm_up
    connection.searched_rows.clear()
    cache.encode(traffic[40:], batch_size=8)
    asked = sum(connection.searched_rows)
    assert 0 < asked <= 0.1 * 360  # exploration only: about 5% of the rows
    stats = cache.last_stats
    assert stats.skipped == 360 - asked and stats.misses == 360 and stats.map_hits == 0
    [band] = stats.estimates
    assert (band.low, band.high, band.hit_rate, band.worth) == (1, 8, 0.0, False)
    assert band.asked == warm_up + asked and band.skipped == 400 - warm_up - asked


@pytest.mark.parametrize(("share", "kept"), [(0.5, 32), (1.0, 64)])
def test_batches_that_keep_maps_for_write_back_hold_at_most_the_capture_share_of_the_computed_tokens(
    share: float, kept: int
) -> None:
    loaded = tiny_loaded("bert")
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    service.admission = Admission(AdmissionConfig(admit_after=1))  # every miss admitted, maps wanted for all
    admin_token, write_token = "a" * 20, "w" * 20
    server, port = create_server(service, "127.0.0.1:0", tokens=TokenTable((("admin", admin_token),
                                                                             ("write", write_token))))
    server.start()
    try:
        url = f"grpc://127.0.0.1:{port}"
        with DaemonClient(f"127.0.0.1:{port}", token=admin_token) as admin:
            create_exact_namespace(admin, loaded, "cold")
        texts = sentences(64, seed=3, min_words=6, max_words=6)  # one length: batches of equal tokens
        with AttnCache(loaded, url, namespace="cold", token=write_token, exact_cache_bytes=0,
                       write_back=WriteBackSettings(capture_share=share)) as cache:
            cache.encode(texts, batch_size=8)  # 8 batches; at 0.5 every other one keeps maps
            assert cache.write_back is not None and cache.write_back.flush(30.0)
            stats = cache.write_back.stats()
    finally:
        server.stop(0)
    assert (stats.stored, stats.queued_maps, stats.maps_stored) == (64, kept, kept)
