"""The BERT-like families beyond BERT and RoBERTa (issue 49 item 1): XLM-RoBERTa, DistilBERT, MPNet.

The shared suite (``test_adapters_shared``, ``test_adapters_packed``) runs them as every family; here what is
particular to them: capture equals the maps the model's own eager attention gives (for MPNet, after its relative
position bias), each is chosen by its ``model_type`` and loads from a folder with every capability on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnstore_client.adapters import BertAdapter, DistilBertAdapter, MPNetAdapter, adapter_for
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.adapters.packed import pack
from attnstore_client.models import SUPPORTED_MODEL_TYPES, load_model
from tests.support.adapters import max_diff, pad_id, random_rows, save_tiny_family, tiny_model

TOL = 1e-4
LENGTHS = [9, 3, 6]
ADAPTERS = {"xlm-roberta": BertAdapter, "distilbert": DistilBertAdapter, "mpnet": MPNetAdapter}


@pytest.fixture(params=sorted(ADAPTERS), scope="module")
def kind(request) -> str:
    return request.param


def test_capture_equals_the_maps_of_the_models_own_eager_attention(kind: str) -> None:
    adapter = adapter_for(tiny_model(kind))
    assert type(adapter) is ADAPTERS[kind]
    eager = tiny_model(kind, attn_implementation="eager")  # the same seed: the same weights
    batch = batch_from_ids(random_rows(LENGTHS), pad_id=pad_id(kind))
    captured = adapter.capture(batch).maps
    with torch.no_grad():
        own = eager.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_attentions=True)
    for row, length in enumerate(batch.lengths):
        theirs = torch.stack([layer[row, :, :length, :length] for layer in own.attentions])  # (layers, H, L, L)
        assert max_diff(captured[row], theirs) <= 1e-5


def test_mpnet_maps_hold_its_relative_position_bias() -> None:
    """Capture takes the map after the bias; a map without it would replay another row (the bias is not small)."""
    adapter = adapter_for(tiny_model("mpnet"))
    batch = batch_from_ids(random_rows([8]), pad_id=pad_id("mpnet"))
    with_bias = adapter.capture(batch).maps[0]
    bias = adapter.model.encoder.relative_attention_bias.weight
    saved = bias.detach().clone()
    try:
        with torch.no_grad():
            bias.zero_()
        without = adapter.capture(batch).maps[0]
    finally:
        with torch.no_grad():
            bias.copy_(saved)
    assert max_diff(with_bias, without) > 0.05
    baseline = adapter.forward(batch)
    assert max_diff(adapter.forward(batch, {0: with_bias}), baseline) <= TOL
    assert max_diff(adapter.forward(batch, {0: without}), baseline) > 1e-2  # the bias matters to the rows
    packed = pack([batch.row_ids(0).tolist()])
    assert max_diff(adapter.forward_packed(packed)[0], baseline[0]) <= TOL  # the packed run adds it per length


def test_every_supported_model_type_has_its_adapter_and_a_folder_of_it_loads_with_every_capability(
    kind: str, tmp_path: Path
) -> None:
    assert kind in SUPPORTED_MODEL_TYPES
    loaded = load_model(str(save_tiny_family(kind, tmp_path / kind, pooling="mean")))
    adapter = adapter_for(loaded)
    assert type(adapter) is ADAPTERS[kind] and adapter.capabilities.complete
    # Positions numbered from the pad id (XLM-RoBERTa, MPNet) need the tokenizer's pad id to be the model's.
    padding_idx = getattr(adapter.model.embeddings, "padding_idx", None)
    if padding_idx is not None:
        assert loaded.tokenizer.pad_token_id == padding_idx == loaded.model.config.pad_token_id
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
    # The projector's embedding stage (what a daemon derives written-back rows' features with) is the adapter's.
    layer = adapter.embedding_layer()
    for row, features in enumerate(adapter.feature_source(batch)):
        assert max_diff(layer.feature_source(rows[row]), features) <= 1e-5


def test_the_adapter_registry_and_the_supported_model_types_agree() -> None:
    from attnstore_client.adapters import _ADAPTERS

    assert set(_ADAPTERS) == set(SUPPORTED_MODEL_TYPES)
