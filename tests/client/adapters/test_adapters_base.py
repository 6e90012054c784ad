"""Shared adapter mechanics: choosing an adapter, refusing bad maps before compute, unpatching."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2Model

from attnstore.errors import MapShapeError
from attnstore_client.adapters import BertAdapter, GenericDecoderAdapter, LlamaAdapter, adapter_for
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.models import LoadedModel
from tests.support.adapters import random_rows, tiny_model


@pytest.fixture(scope="module")
def llama() -> LlamaAdapter:
    return adapter_for(tiny_model("llama"))


@pytest.fixture(scope="module")
def batch():
    return batch_from_ids(random_rows([6, 4]), pad_id=0)


@pytest.fixture(scope="module")
def maps(llama, batch) -> list[torch.Tensor]:
    return llama.capture(batch).maps


def _count_attention_calls(adapter) -> tuple[list[int], list]:
    calls: list[int] = []
    handles = [m.register_forward_pre_hook(lambda *_: calls.append(1)) for m in adapter.attention_modules]
    return calls, handles


def test_adapter_for_picks_the_family_by_architecture():
    assert isinstance(adapter_for(tiny_model("qwen2")), LlamaAdapter)
    assert isinstance(adapter_for(tiny_model("roberta")), BertAdapter)


def test_adapter_for_an_architecture_without_a_family_gives_the_models_own_forward():
    gpt2 = LoadedModel(
        name="gpt2", model=GPT2Model(GPT2Config(n_layer=1, n_embd=32, n_head=2)), tokenizer=None, lm_head=None
    )
    adapter = adapter_for(gpt2)  # issue 49 item 2: slower, never refused (tests/client/adapters/test_adapters_generic)
    assert isinstance(adapter, GenericDecoderAdapter) and not adapter.capabilities.can_replay


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda m: m[0][:2], "shape"),  # 2 layers of 3
        (lambda m: m[0][:, :3], "heads=4"),  # 3 heads of 4
        (lambda m: m[0][..., :5, :5], "length 5"),  # shorter than the 6-token row
        (lambda m: m[0].double(), "dtype torch.float64"),
        (lambda m: m[0].to(torch.int32), "dtype torch.int32"),
        (lambda m: m[0][..., :5], "shape"),  # not square
        (lambda m: m[0].numpy(), "ndarray"),
        (lambda m: [m[0][0], m[0][1]], "2 layers"),
    ],
)
def test_bad_maps_raise_value_error_before_any_attention_runs(llama, batch, maps, bad, message):
    calls, handles = _count_attention_calls(llama)
    try:
        with pytest.raises(MapShapeError, match=message) as raised:
            llama.forward(batch, {0: bad(maps)})
    finally:
        for handle in handles:
            handle.remove()
    assert isinstance(raised.value, ValueError)
    assert calls == []


def test_replay_row_outside_the_batch_is_refused(llama, batch, maps):
    with pytest.raises(MapShapeError, match="row 5"):
        llama.forward(batch, {5: maps[0]})


def test_bad_lazy_layer_raises_when_reached_and_model_is_unpatched_after(llama, batch, maps):
    lazy = [maps[0][0], maps[0][1], maps[0][2, :3]]  # layer 2 lacks a head
    with pytest.raises(MapShapeError, match="layer 2"):
        llama.forward(batch, {0: lazy})
    assert all("forward" not in module.__dict__ for module in llama.attention_modules)
    assert llama.forward(batch).shape == (2, 6, 64)


def test_model_is_unpatched_between_calls(llama, batch, maps):
    llama.forward(batch, {1: maps[1]})
    llama.capture(batch)
    assert all("forward" not in module.__dict__ for module in llama.attention_modules)


def test_forward_without_hits_runs_the_plain_model(llama, batch):
    direct = llama.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    assert torch.equal(llama.forward(batch, {}), direct)
    assert torch.equal(llama.forward(batch), direct)
