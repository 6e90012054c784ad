"""The one attention function (``adapters.attention``): the explicit softmax and the fused fast path agree."""

from __future__ import annotations

import pytest
import torch

from attnstore_client.adapters.attention import allowed_keys, attention, attention_probs
from tests.support.adapters import max_diff


def _qkv(batch: int, heads: int, kv_heads: int, length: int, head_dim: int = 8, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, length, head_dim, generator=generator)  # (B, H, T, d)
    key = torch.randn(batch, kv_heads, length, head_dim, generator=generator)  # (B, KVH, T, d)
    value = torch.randn(batch, kv_heads, length, head_dim, generator=generator)  # (B, KVH, T, d)
    return query, key, value


@pytest.mark.parametrize(("causal", "window"), [(False, None), (True, None), (True, 3), (False, 3)])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_explicit_map_gives_the_fused_kernels_context(causal: bool, window: int | None, kv_heads: int) -> None:
    query, key, value = _qkv(3, 4, kv_heads, 9)
    fused, none = attention(query, key, value, scaling=0.3, causal=causal, window=window)
    explicit, probs = attention(query, key, value, scaling=0.3, causal=causal, window=window, explicit=True)
    assert none is None and probs is not None and probs.dtype == torch.float32
    assert probs.shape == (3, 4, 9, 9) and torch.allclose(probs.sum(-1), torch.ones(3, 4, 9))
    assert max_diff(explicit, fused) < 1e-5
    if causal or window is not None:  # no later key (causal), none outside the window (on both sides if not causal)
        assert probs[..., ~allowed_keys(9, window, causal=causal)].abs().max() == 0
        assert probs[..., allowed_keys(9, window, causal=causal)].min() > 0


def test_query_heads_of_one_group_read_their_kv_head() -> None:
    query, key, _ = _qkv(1, 4, 2, 5)
    grouped = attention_probs(query, key, scaling=1.0, causal=False)  # (1, 4, 5, 5)
    repeated = attention_probs(query, key.repeat_interleave(2, dim=1), scaling=1.0, causal=False)
    assert max_diff(grouped, repeated) < 1e-6


@pytest.mark.parametrize(("causal", "window"), [(False, None), (True, None), (False, 3)])
def test_a_padded_rows_map_is_its_map_alone_at_its_true_length(causal: bool, window: int | None) -> None:
    query, key, _ = _qkv(3, 4, 2, 8)
    lengths = [8, 5, 2]
    padded = attention_probs(query, key, scaling=0.5, causal=causal, window=window, lengths=lengths)  # (3, 4, 8, 8)
    assert padded.isfinite().all()  # a pad query with no true key in its window is no row of -inf
    for row, length in enumerate(lengths):
        alone = attention_probs(query[row : row + 1, :, :length], key[row : row + 1, :, :length], scaling=0.5,
                                causal=causal, window=window)[0]  # (4, L, L)
        assert max_diff(padded[row, :, :length, :length], alone) < 1e-6
