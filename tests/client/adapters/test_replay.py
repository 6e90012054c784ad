"""Replay maps: validation, crop and cast, and maps·V without repeating KV heads."""

from __future__ import annotations

import pytest
import torch

import attnstore_client.adapters.replay as replay_module
from attnstore.errors import MapShapeError
from attnstore_client.adapters.replay import apply_maps, check_replay, layer_maps


def _causal_maps(heads: int, length: int) -> torch.Tensor:
    scores = torch.randn(heads, length, length).masked_fill(torch.ones(length, length).triu(1).bool(), float("-inf"))
    return scores.softmax(-1)  # (H, L, L)


def _reference(maps: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    repeated = values.repeat_interleave(maps.shape[0] // values.shape[0], dim=0)  # (H, L, d)
    return (maps @ repeated).transpose(0, 1).reshape(maps.shape[1], -1)  # (L, H*d)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_rows", [4, 128])
def test_apply_maps_equals_repeat_kv_reference_and_leaves_padding(causal, block_rows, monkeypatch):
    monkeypatch.setattr(replay_module, "CAUSAL_BLOCK_ROWS", block_rows)
    torch.manual_seed(0)
    maps = [_causal_maps(6, 10), _causal_maps(6, 7)]  # 6 query heads, 2 KV heads
    values = torch.randn(2, 10, 2 * 8)  # (B, P, KVH*d)
    out = torch.full((2, 10, 6 * 8), 7.0)  # (B, P, H*d)
    apply_maps(maps, values, [10, 7], out=out, causal=causal)
    for row, length in enumerate((10, 7)):
        value_heads = values[row, :length].view(length, 2, 8).transpose(0, 1)  # (KVH, L, d)
        assert torch.allclose(out[row, :length], _reference(maps[row], value_heads), atol=1e-6)
    assert torch.equal(out[1, 7:], torch.full((3, 48), 7.0))


def test_layer_maps_crops_causal_maps_and_casts_without_copy_when_possible():
    maps = torch.rand(2, 3, 7, 7)
    same = layer_maps(maps, 0, 1, 7, heads=3, causal=True, dtype=torch.float32)
    assert same.data_ptr() == maps[1].data_ptr()
    cropped = layer_maps(maps.half(), 0, 1, 4, heads=3, causal=True, dtype=torch.float32)
    assert cropped.shape == (3, 4, 4) and cropped.dtype == torch.float32
    assert torch.equal(cropped, maps.half()[1, :, :4, :4].float())


def test_check_replay_accepts_good_maps_and_refuses_crop_for_bidirectional():
    maps = torch.rand(2, 3, 7, 7)
    check_replay({0: maps, 1: maps[..., :5, :5]}, [7, 5], layers=2, heads=3, causal=False)
    check_replay({0: maps}, [5], layers=2, heads=3, causal=True)
    with pytest.raises(MapShapeError, match=r"length 7.*== 5"):
        check_replay({0: maps}, [5], layers=2, heads=3, causal=False)
    with pytest.raises(MapShapeError, match=r"length 4.*>= 5"):
        check_replay({0: maps[..., :4, :4]}, [5], layers=2, heads=3, causal=True)
