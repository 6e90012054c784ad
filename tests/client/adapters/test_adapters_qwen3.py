"""Qwen3 (issue 49 item 1): Llama's layout plus per-head RMSNorm on queries and keys before RoPE.

The shared suite (``test_adapters_shared``, ``test_adapters_packed``) runs it as every family; here what is
particular to it: capture equals the maps the model's own eager attention gives (after the norms, whose weights
the tiny model draws far from 1 so that dropping them shows), sliding-window layers as ``layer_types`` says,
and a folder of it loads with every capability on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from attnstore.errors import UnsupportedModelError
from attnstore_client.adapters import LlamaAdapter, Qwen3Adapter, adapter_for
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.adapters.packed import pack
from attnstore_client.models import LoadedModel, load_model
from attnstore_client.tiers.prefix.shared import shareable
from tests.support.adapters import VOCAB, max_diff, random_rows, save_tiny_family, tiny_model

TOL = 1e-4
LENGTHS = [9, 3, 6]


def _eager_maps(loaded: LoadedModel, batch) -> list[torch.Tensor]:
    with torch.no_grad():
        own = loaded.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_attentions=True)
    return [torch.stack([layer[row, :, :length, :length] for layer in own.attentions])  # (layers, H, L, L)
            for row, length in enumerate(batch.lengths)]


def test_capture_equals_the_maps_of_the_models_own_eager_attention() -> None:
    adapter = adapter_for(tiny_model("qwen3"))
    assert type(adapter) is Qwen3Adapter and adapter.capabilities.complete
    batch = batch_from_ids(random_rows(LENGTHS), pad_id=0)
    captured = adapter.capture(batch).maps
    eager = _eager_maps(tiny_model("qwen3", attn_implementation="eager"), batch)  # the same seed: the same weights
    for row in range(batch.size):
        assert max_diff(captured[row], eager[row]) <= 1e-5


def test_the_query_and_key_norms_are_in_the_maps() -> None:
    """Llama's adapter on the same model (no norms) captures other maps, and they replay other rows."""
    loaded = tiny_model("qwen3")
    batch = batch_from_ids(random_rows([8]), pad_id=0)
    normed = adapter_for(loaded).capture(batch).maps[0]
    unnormed = LlamaAdapter(loaded).capture(batch).maps[0]
    assert max_diff(normed, unnormed) > 0.05
    adapter = adapter_for(loaded)
    baseline = adapter.forward(batch)
    assert max_diff(adapter.forward(batch, {0: normed}), baseline) <= TOL
    assert max_diff(adapter.forward(batch, {0: unnormed}), baseline) > 1e-2


def test_a_qwen3_attention_without_its_norms_is_refused_by_name() -> None:
    loaded = tiny_model("qwen3")
    del loaded.model.layers[0].self_attn.k_norm
    with pytest.raises(UnsupportedModelError, match=r"lacks Qwen3's query and key norms \(missing \['k_norm'\]\)"):
        Qwen3Adapter(loaded)


def test_sliding_window_layers_are_honoured_per_layer_and_share_no_prefix() -> None:
    def windowed(attn_implementation: str) -> LoadedModel:
        torch.manual_seed(0)
        config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                             use_sliding_window=True, sliding_window=4, max_window_layers=1,
                             attn_implementation=attn_implementation)  # layer 0 full, layers 1 and 2 windowed
        causal_lm = Qwen3ForCausalLM(config).eval()
        return LoadedModel(name="qwen3-window", model=causal_lm.get_decoder(), tokenizer=None,
                           lm_head=causal_lm.lm_head)

    adapter = adapter_for(windowed("sdpa"))
    batch = batch_from_ids(random_rows([11, 5]), pad_id=0)
    captured = adapter.capture(batch).maps
    eager = _eager_maps(windowed("eager"), batch)
    query, key = torch.meshgrid(torch.arange(11), torch.arange(11), indexing="ij")
    assert captured[0][0][..., key <= query - 4].min() > 0  # layer 0: full attention
    assert captured[0][1:][..., key <= query - 4].abs().max() == 0
    for row in range(batch.size):
        assert max_diff(captured[row], eager[row]) <= 1e-5
    baseline = adapter.forward(batch)
    replayed = adapter.forward(batch, dict(enumerate(captured)))
    packed = pack([batch.row_ids(row).tolist() for row in range(batch.size)])
    out, _ = adapter.forward_packed(packed)
    for row, length in enumerate(batch.lengths):
        assert max_diff(replayed[row, :length], baseline[row, :length]) <= TOL
        assert max_diff(packed.row(out, row), baseline[row, :length]) <= TOL
    assert not shareable(adapter)  # a suffix cannot run on a whole prefix's keys and values


def test_a_folder_of_it_loads_with_every_capability_and_left_padding(tmp_path: Path) -> None:
    # As Qwen3-Embedding is used: last-token pooling, the tokenizer padding on the left.
    loaded = load_model(str(save_tiny_family("qwen3", tmp_path / "qwen3", padding_side="left", pooling="lasttoken")))
    adapter = adapter_for(loaded)
    assert type(adapter) is Qwen3Adapter and adapter.capabilities.complete and adapter.causal
    assert adapter.head_dim == 8 and adapter.num_kv_heads == 2 and shareable(adapter)
    texts = ["A man is playing a guitar.", "hi", "Three dogs run across a snowy field."]
    rows = [loaded.tokenizer(text)["input_ids"] for text in texts]
    batch = batch_from_ids(rows, pad_id=loaded.tokenizer.pad_token_id)
    baseline = adapter.forward(batch)
    replayed = adapter.forward(batch, dict(enumerate(adapter.capture(batch).maps)))
    packed = pack(rows)
    out, _ = adapter.forward_packed(packed)
    for row, length in enumerate(batch.lengths):
        assert max_diff(replayed[row, :length], baseline[row, :length]) <= TOL
        assert max_diff(packed.row(out, row), baseline[row, :length]) <= TOL
    layer = adapter.embedding_layer()  # the projector's embedding stage is the adapter's feature source
    for row, features in enumerate(adapter.feature_source(batch)):
        assert max_diff(layer.feature_source(rows[row]), features) <= 1e-5
