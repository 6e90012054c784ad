"""A daemon's feature of a row, derived from its tokens, equals the client's (tiny random models).

The client projects ``adapter.feature_source(batch)`` (its model's embedding stage on
a padded batch); the daemon runs ``FeatureDeriver`` over the embedding layer stored in
the namespace's projector blob. Both must give the same vector to float rounding,
else a written-back row would land elsewhere than the client's own search looks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnstore.errors import MapShapeError
from attnstore.projector.blob import has_embedding_layer, same_weights, without_embedding_layer
from attnstore.projector.embedding_layer import FeatureDeriver
from attnstore_client.adapters import Gemma3Adapter, adapter_for
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.projector import Projector, ProjectorConfig
from tests.support.adapters import TinyKind, pad_id, random_rows, tiny_model

LENGTHS = [3, 9, 17, 1, 40]


def _projector(hidden: int) -> Projector:
    torch.manual_seed(3)
    return Projector(ProjectorConfig(hidden=hidden)).eval()


@pytest.mark.parametrize("kind", ["bert", "roberta", "llama"])
def test_the_daemons_derived_feature_equals_the_clients_projected_one(kind: TinyKind) -> None:
    adapter = adapter_for(tiny_model(kind))
    projector = _projector(adapter.hidden_size)
    rows = random_rows(LENGTHS, seed=5)
    expected = projector.project(adapter.feature_source(batch_from_ids(rows, pad_id(kind))))  # (n, dim)

    blob = adapter.embedding_layer().attach_to(projector.to_safetensors_bytes())
    deriver = FeatureDeriver.from_projector_blob(blob)
    assert deriver is not None
    derived = deriver.features([np.asarray(row) for row in rows])
    np.testing.assert_allclose(derived, expected, rtol=1e-5, atol=1e-5)


def test_the_blob_sent_to_clients_holds_the_same_projector_without_the_layer() -> None:
    adapter = adapter_for(tiny_model("bert"))
    projector = _projector(adapter.hidden_size)
    plain = projector.to_safetensors_bytes()
    blob = adapter.embedding_layer().attach_to(plain)
    sent = without_embedding_layer(blob)
    assert has_embedding_layer(blob) and not has_embedding_layer(sent) and not has_embedding_layer(plain)
    assert len(sent) < len(blob) and same_weights(blob, plain) and same_weights(sent, plain)
    assert FeatureDeriver.from_projector_blob(sent) is None  # a client's copy derives nothing
    rows = [torch.tensor(row) for row in random_rows([6], seed=2)]
    source = adapter.feature_source(batch_from_ids([r.tolist() for r in rows], 0))
    for loaded in (Projector.from_safetensors_bytes(blob), Projector.from_safetensors_bytes(sent)):
        np.testing.assert_array_equal(loaded.project(source), projector.project(source))


def test_a_row_the_layer_cannot_embed_is_refused_as_the_rows_own_error() -> None:
    adapter = adapter_for(tiny_model("bert"))
    deriver = FeatureDeriver.from_projector_blob(
        adapter.embedding_layer().attach_to(_projector(adapter.hidden_size).to_safetensors_bytes()))
    assert deriver is not None
    with pytest.raises(MapShapeError, match="inside the vocabulary"):
        deriver.features([np.array([5, 10_000])])
    with pytest.raises(MapShapeError, match="positions"):
        deriver.features([np.full(300, 5)])


@pytest.mark.parametrize("kind", ["gemma3_text", "embeddinggemma"])
def test_a_gemma3_models_derived_feature_equals_the_clients_after_its_scale_and_norm(kind: TinyKind) -> None:
    """Gemma 3's stage: embeddings times ``sqrt(hidden)``, then an RMSNorm scaling by ``1 + weight`` (the tiny model's
    norm weights far from 0, so Llama's reading of them would show)."""
    adapter = adapter_for(tiny_model(kind))
    assert isinstance(adapter, Gemma3Adapter)
    projector = _projector(adapter.hidden_size)
    rows = random_rows(LENGTHS, seed=5)
    sources = adapter.feature_source(batch_from_ids(rows, 0))
    layer = adapter.embedding_layer()
    assert layer.kind == "gemma3" and layer.embed_scale == pytest.approx(adapter.hidden_size**0.5)
    for row, source in zip(rows, sources, strict=True):
        torch.testing.assert_close(layer.feature_source(row), source, rtol=0, atol=1e-6)
    deriver = FeatureDeriver.from_projector_blob(layer.attach_to(projector.to_safetensors_bytes()))
    assert deriver is not None and deriver.layer.kind == "gemma3" and deriver.layer.embed_scale == layer.embed_scale
    derived = deriver.features([np.asarray(row) for row in rows])
    np.testing.assert_allclose(derived, projector.project(sources), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_bias", [False, True])
def test_a_modernbert_layer_without_positions_derives_the_clients_feature(norm_bias: bool) -> None:
    """ModernBERT's stage is its token embeddings' LayerNorm (bias-free unless ``norm_bias``); positions are rotary."""
    loaded = tiny_model("modernbert")
    norm = loaded.model.embeddings.norm
    if norm_bias:
        norm.bias = torch.nn.Parameter(torch.randn(norm.weight.shape))
    adapter = adapter_for(loaded)
    projector = _projector(adapter.hidden_size)
    rows = random_rows(LENGTHS + [300], seed=5)  # longer than any position table: there is none
    expected = projector.project(adapter.feature_source(batch_from_ids(rows, pad_id("modernbert"))))  # (n, dim)

    deriver = FeatureDeriver.from_projector_blob(adapter.embedding_layer().attach_to(projector.to_safetensors_bytes()))
    assert deriver is not None
    assert deriver.layer.kind == "modernbert" and deriver.layer.positions is None
    assert (deriver.layer.norm_bias is not None) is norm_bias
    np.testing.assert_allclose(deriver.features([np.asarray(row) for row in rows]), expected, rtol=1e-5, atol=1e-5)
