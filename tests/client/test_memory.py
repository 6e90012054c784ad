"""The memory budget: how one setting splits between the store's indexes, the forwards and the exact tier, and a
cache under it (a real LMDB store in embedded mode)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from transformers import BertConfig

from attnstore.errors import ConfigError
from attnstore.service import AttnStoreService
from attnstore_client.cache import AttnCache
from attnstore_client.memory import forward_bytes_per_token, plan_memory
from attnstore_client.settings import CacheSettings
from tests.support.caches import fill_namespace, sentences, tiny_loaded

MIB = 2**20


def test_the_budget_goes_to_the_indexes_first_then_half_the_rest_to_the_forwards_and_the_rest_to_the_tier() -> None:
    plan = plan_memory(100 * MIB, indexes=20 * MIB, exact_cache_bytes=256 * MIB, bytes_per_token=1000,
                       forwards_at_once=2, max_length=128)
    assert plan.indexes == 20 * MIB
    assert plan.forward_tokens == (80 * MIB // 2) // (2 * 1000)
    assert plan.forwards == 2 * plan.forward_tokens * 1000 <= 40 * MIB
    assert plan.exact_tier == 80 * MIB - plan.forwards
    assert plan.total <= plan.budget


def test_the_exact_tier_never_gets_more_than_its_own_cap() -> None:
    plan = plan_memory(1024 * MIB, indexes=0, exact_cache_bytes=64 * MIB, bytes_per_token=1000, forwards_at_once=1,
                       max_length=128)
    assert plan.exact_tier == 64 * MIB and plan.total < plan.budget


def test_indexes_over_half_the_budget_are_refused_naming_what_they_need() -> None:
    with pytest.raises(ConfigError, match=r"indexes take 60 MiB.*at least 120 MiB.*daemon"):
        plan_memory(100 * MIB, indexes=60 * MIB, exact_cache_bytes=MIB, bytes_per_token=1000, forwards_at_once=1,
                    max_length=128)


def test_a_budget_without_room_for_one_full_length_row_per_forward_is_refused_naming_the_least() -> None:
    least = 2 * 2 * 512 * 40_000
    with pytest.raises(ConfigError, match=rf"fewer than one row of the model's 512; give at least {least // MIB} MiB"):
        plan_memory(10 * MIB, indexes=0, exact_cache_bytes=MIB, bytes_per_token=40_000, forwards_at_once=2,
                    max_length=512)
    plan_memory(least, indexes=0, exact_cache_bytes=MIB, bytes_per_token=40_000, forwards_at_once=2, max_length=512)


def test_forward_bytes_per_token_counts_one_layers_activations_and_scores_and_every_layers_maps() -> None:
    config = BertConfig(hidden_size=384, num_attention_heads=12, intermediate_size=1536, num_hidden_layers=6)
    assert forward_bytes_per_token(config, 256) == 4 * (8 * 384 + 2 * 1536 + 12 * 256) + 2 * 6 * 12 * 256


def test_memory_budget_must_be_a_positive_int_or_none() -> None:
    for bad in (0, -1, 1.5, True, "1GiB"):
        with pytest.raises(ConfigError, match="memory_budget"):
            CacheSettings(memory_budget=bad)  # type: ignore[arg-type]


# ---- a cache under a budget -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert():
    return tiny_loaded("bert")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, bert) -> Path:
    path = tmp_path_factory.mktemp("memory") / "store"
    with AttnStoreService.open(path, create=True) as service:
        fill_namespace(service, bert, sentences(40, seed=3))
    return path


def test_a_cache_under_a_budget_counts_the_indexes_caps_its_tier_and_forwards_and_its_rows_stay_exact(
    bert, store: Path
) -> None:
    texts = sentences(40, seed=3)[:10] + sentences(30, seed=4, min_words=20, max_words=60)
    with AttnCache(bert, f"local:{store}", side_by_side=False) as plain:
        expected = plain.encode(texts, convert_to_numpy=True)
        indexes, max_length = plain.connection.resident_bytes, plain.head.max_length
    assert indexes > 40 * 4 * 8  # every entry's feature vector at least
    per_token = forward_bytes_per_token(bert.model.config, max_length)
    budget = 2 * indexes + 2 * 2 * max_length * per_token  # forwards of about two full-length rows
    with AttnCache(bert, f"local:{store}", side_by_side=False, memory_budget=budget) as cache:
        plan = cache.memory
        assert plan is not None and plan.indexes == indexes
        assert cache.local_tier.stats().capacity_bytes == plan.exact_tier <= budget - indexes
        assert max_length <= plan.forward_tokens == (budget - indexes) // 2 // per_token
        got = cache.encode(texts, convert_to_numpy=True, batch_size=32)
        assert cache.last_stats.exact_hits == 10
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_a_budget_the_store_indexes_do_not_fit_in_is_refused_before_any_call(bert, store: Path) -> None:
    with pytest.raises(ConfigError, match=r"memory_budget .* the store's indexes take"):
        AttnCache(bert, f"local:{store}", memory_budget=64)


def test_without_a_budget_the_cache_has_no_plan_and_its_tier_keeps_its_own_cap(bert, store: Path) -> None:
    with AttnCache(bert, f"local:{store}", exact_cache_bytes=3 * MIB) as cache:
        assert cache.memory is None and cache.local_tier.stats().capacity_bytes == 3 * MIB
