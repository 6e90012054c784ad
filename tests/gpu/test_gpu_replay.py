"""Map replay in the adapters on the GPU: maps captured by the fp32 model replay there to the plain forward's
outputs, padded and packed, in fp32 and in half precision."""

from __future__ import annotations

import pytest
import torch

from attnstore_client.adapters import adapter_for
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.adapters.packed import pack
from tests.support.adapters import random_rows, tiny_model

ROWS = random_rows([7, 12, 3, 12], seed=2)


def _cpu_maps(kind: str) -> list[torch.Tensor]:
    """Each row's maps ``(layers, H, L, L)`` fp32, captured on the CPU (as a store is filled)."""
    return adapter_for(tiny_model(kind)).capture(batch_from_ids(ROWS, pad_id=0)).maps


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_replayed_maps_give_the_plain_forward_on_the_device_padded_and_packed(device, kind) -> None:
    maps = _cpu_maps(kind)
    loaded = tiny_model(kind)
    loaded.model.to(device)
    adapter = adapter_for(loaded)
    batch = batch_from_ids(ROWS, pad_id=0).to(device)
    plain = adapter.forward(batch)  # (B, P, hidden)
    replay = {row: m.to(device) for row, m in enumerate(maps) if row % 2 == 0}  # hits and misses in one batch
    mixed = adapter.forward(batch, replay)
    packed_batch = pack(ROWS).to(device)
    packed, _ = adapter.forward_packed(packed_batch, replay)  # (T, hidden)
    for row, length in enumerate(batch.lengths):
        assert plain.device.type == device.type
        assert torch.allclose(mixed[row, :length], plain[row, :length], atol=1e-4)
        assert torch.allclose(packed_batch.row(packed, row), plain[row, :length], atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fp16_maps_replay_into_a_half_precision_model(device, dtype) -> None:
    if device.type == "cpu" and dtype == torch.float16:
        pytest.skip("fp16 matrix products are a GPU case")
    maps = _cpu_maps("llama")
    loaded = tiny_model("llama")
    loaded.model.to(device=device, dtype=dtype)
    adapter = adapter_for(loaded)
    batch = batch_from_ids(ROWS, pad_id=0).to(device)
    plain = adapter.forward(batch).float()
    replayed = adapter.forward(batch, {row: m.to(device=device, dtype=torch.float16) for row, m in enumerate(maps)})
    for row, length in enumerate(batch.lengths):
        assert torch.allclose(replayed[row, :length].float(), plain[row, :length], atol=0.05, rtol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_capture_runs_where_the_model_is(device, dtype) -> None:
    loaded = tiny_model("llama")
    loaded.model.to(device=device, dtype=dtype)
    adapter = adapter_for(loaded)
    batch = batch_from_ids(ROWS, pad_id=0).to(device)
    captured = adapter.capture(batch)
    plain = adapter.forward(batch).float()
    for row, length in enumerate(batch.lengths):
        assert torch.allclose(captured.hidden[row].float().to(device), plain[row, :length], atol=0.05)
