"""A model without a family adapter (issue 49, item 2): the model's own forward, capabilities off, maps refused.

Tiny random ``deberta-v2`` and ``electra`` encoders and a ``gpt2`` decoder: the
generic adapter's forwards (padded and packed) equal the model's own forward, it
says what it cannot do, and it refuses maps rather than run without them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModel, GPT2Config, GPT2Model

from attnstore.errors import UnsupportedModelError
from attnstore_client.adapters import BertAdapter, GenericAdapter, GenericDecoderAdapter, adapter_for
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.adapters.packed import pack
from attnstore_client.models import LoadedModel, is_causal, load_model
from tests.support.adapters import VOCAB, random_rows, save_tiny_family, tiny_model

FAMILIES = ("deberta-v2", "electra")


def _tiny(family: str) -> LoadedModel:
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=64)
    return LoadedModel(name=f"tiny-{family}", model=AutoModel.from_config(config).eval(), tokenizer=None,
                       lm_head=None)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_without_an_adapter_gets_the_generic_one_which_says_what_is_off(family: str) -> None:
    adapter = adapter_for(_tiny(family))
    assert type(adapter) is GenericAdapter and adapter.family == "generic" and not adapter.causal
    capabilities = adapter.capabilities
    assert not (capabilities.can_replay or capabilities.can_pack or capabilities.can_share_kv)
    assert not capabilities.complete
    assert capabilities.missing == (f"no adapter for model_type {family!r}: map replay, packed forwards, prefix and"
                                    " chunk tiers need one")
    assert adapter_for(tiny_model("bert")).capabilities.complete  # a family's adapter has them all


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_and_packed_forwards_are_the_models_own(family: str) -> None:
    loaded = _tiny(family)
    adapter = adapter_for(loaded)
    rows = random_rows([7, 3, 5])
    batch = batch_from_ids(rows, pad_id=0)
    with torch.no_grad():
        own = loaded.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    out = adapter.forward(batch)  # (B, P, hidden)
    for row, length in enumerate(batch.lengths):
        torch.testing.assert_close(out[row, :length], own[row, :length])
    packed = pack(rows)
    flat, kept = adapter.forward_packed(packed)  # (T, hidden)
    assert kept == {} and flat.shape == (packed.tokens, adapter.hidden_size)
    for row, length in enumerate(batch.lengths):
        torch.testing.assert_close(packed.row(flat, row), own[row, :length], atol=1e-5, rtol=1e-5)


def test_maps_are_refused_never_run_without() -> None:
    adapter = adapter_for(_tiny("electra"))
    batch = batch_from_ids(random_rows([4, 4]), pad_id=0)
    maps = torch.full((2, 4, 4, 4), 0.25)
    for attempt in (
        lambda: adapter.forward(batch, {0: maps}),
        lambda: adapter.forward_keeping(batch, [1]),
        lambda: adapter.forward_packed(pack(random_rows([4])), {0: maps}),
        lambda: adapter.forward_packed(pack(random_rows([4])), keep=[0]),
        lambda: adapter.capture(batch),
        lambda: adapter.feature_source(batch),
    ):
        with pytest.raises(UnsupportedModelError, match="no adapter for model_type 'electra'"):
            attempt()


def test_a_decoder_without_an_adapter_is_causal() -> None:
    gpt2 = LoadedModel(name="gpt2", model=GPT2Model(GPT2Config(n_layer=1, n_embd=32, n_head=2)), tokenizer=None,
                       lm_head=None)
    adapter = adapter_for(gpt2)
    assert type(adapter) is GenericDecoderAdapter and adapter.causal
    assert not adapter.capabilities.can_share_kv  # no prefix or chunk tier without an adapter
    for model_type, causal in (("electra", False), ("deberta-v2", False), ("bert", False), ("qwen3", True),
                               ("gemma3_text", True), ("llama", True)):
        assert is_causal(AutoConfig.for_model(model_type)) is causal, model_type


def test_a_folder_of_any_model_type_loads_where_it_was_refused(tmp_path: Path) -> None:
    loaded = load_model(str(save_tiny_family("deberta-v2", tmp_path / "deberta", pooling="mean")))
    assert loaded.sentence_transformer is not None and type(adapter_for(loaded)) is GenericAdapter
    # DeBERTa-v2 has no sdpa kernel: transformers' own choice is kept instead of a refusal.
    assert loaded.model.config._attn_implementation == "eager"
    decoder = load_model(str(save_tiny_family("gpt2", tmp_path / "gpt2")))
    assert decoder.lm_head is not None and type(adapter_for(decoder)) is GenericDecoderAdapter
    assert isinstance(adapter_for(load_model(str(save_tiny_family("bert", tmp_path / "bert")))), BertAdapter)
