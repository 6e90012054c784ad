"""Capture and replay on BERT-like encoders (BERT, RoBERTa): bidirectional, exact length only."""

from __future__ import annotations

import pytest
import torch

from attnstore.errors import MapShapeError
from attnstore_client.adapters import BertAdapter, adapter_for
from attnstore_client.adapters.batch import batch_from_ids, tokenize
from tests.support.adapters import max_diff, pad_id, random_rows, tiny_model

TOL = 1e-4
LENGTHS = [9, 3, 6]


@pytest.fixture(params=["bert", "roberta"], scope="module")
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def adapter(kind) -> BertAdapter:
    return adapter_for(tiny_model(kind))


@pytest.fixture(scope="module")
def batch(kind):
    return batch_from_ids(random_rows(LENGTHS), pad_id=pad_id(kind))














def test_bidirectional_maps_of_another_length_are_refused(adapter, batch):
    maps = adapter.capture(batch).maps
    with pytest.raises(MapShapeError, match="exact length"):
        adapter.forward(batch, {1: maps[0]})  # 9 tokens of maps for a 3-token row


def test_feature_source_is_embeddings_output_with_layernorm(adapter, batch):
    features = adapter.feature_source(batch)
    expected = adapter.model.embeddings(input_ids=batch.input_ids)  # (B, P, hidden)
    for row, length in enumerate(batch.lengths):
        assert features[row].shape == (length, 64)
        assert torch.allclose(features[row], expected[row, :length].detach())
    assert torch.allclose(features[0].mean(-1), torch.zeros(9), atol=1e-4)  # LayerNorm'd, zero-init bias


@pytest.mark.real_model
def test_minilm_replays_own_maps_single_padded_and_mixed(minilm_model):
    adapter = adapter_for(minilm_model)
    texts = ["A man is playing a guitar.", "Hello", "Three dogs run across a snowy field near the old barn."]
    batch = tokenize(minilm_model.tokenizer, texts)
    capture = adapter.capture(batch)
    baseline = adapter.forward(batch)
    for row, length in enumerate(batch.lengths):
        single = tokenize(minilm_model.tokenizer, texts[row : row + 1])
        assert max_diff(adapter.forward(single)[0], baseline[row, :length]) <= TOL
        assert max_diff(adapter.forward(single, {0: capture.maps[row]})[0], baseline[row, :length]) <= TOL
        assert max_diff(capture.hidden[row], baseline[row, :length]) <= TOL
    replayed = adapter.forward(batch, dict(enumerate(capture.maps)))
    mixed = adapter.forward(batch, {2: capture.maps[2]})
    for row, length in enumerate(batch.lengths):
        assert max_diff(replayed[row, :length], baseline[row, :length]) <= TOL
        assert max_diff(mixed[row, :length], baseline[row, :length]) <= TOL
    assert torch.equal(mixed[0, : batch.lengths[0]], baseline[0, : batch.lengths[0]])
