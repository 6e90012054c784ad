"""ModernBERT: a fused q/k/v projection, rotary positions (a theta per layer type), global layers alternating with
local ones that attend within ``local_attention // 2`` tokens on either side.

The shared suites (``test_adapters_shared``, ``test_adapters_packed``) run it as every family; here what is
particular to it: capture equals the model's own eager maps, a local layer's maps are zero outside its window and
a map without the window replays another row, padded, replayed and packed rows equal the model's own forward of
each row alone and of left- and right-padded batches, a folder of it loads with every capability on and its
embedding layer is its feature source, and a layer it does not know takes no map.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnstore.errors import UnsupportedModelError
from attnstore_client.adapters import ModernBertAdapter, adapter_for
from attnstore_client.adapters.batch import Batch, batch_from_ids
from attnstore_client.adapters.packed import pack
from attnstore_client.models import LoadedModel, load_model
from tests.support.adapters import max_diff, random_rows, save_tiny_family, tiny_model

TOL = 1e-4
# Longer than the local layers' window (3 tokens each side) but for the last; runs of equal lengths when packed.
LENGTHS = [45, 11, 9, 9, 6, 3]
REACH = 3  # tiny_model's local_attention // 2


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return tiny_model("modernbert")


@pytest.fixture(scope="module")
def adapter(loaded: LoadedModel) -> ModernBertAdapter:
    adapter = adapter_for(loaded)
    assert isinstance(adapter, ModernBertAdapter) and adapter.capabilities.complete
    return adapter


@pytest.fixture(scope="module")
def batch() -> Batch:
    return batch_from_ids(random_rows(LENGTHS, seed=7), pad_id=0)


def _alone(loaded: LoadedModel, batch: Batch) -> list[torch.Tensor]:
    """Each row through the model's own forward by itself: ``(L, hidden)``."""
    with torch.no_grad():
        return [loaded.model(input_ids=batch.row_ids(row)[None]).last_hidden_state[0] for row in range(batch.size)]


def test_capture_equals_the_maps_of_the_models_own_eager_attention(adapter: ModernBertAdapter, batch: Batch) -> None:
    captured = adapter.capture(batch).maps
    eager = tiny_model("modernbert", attn_implementation="eager")  # the same seed: the same weights
    with torch.no_grad():
        own = eager.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_attentions=True)
    for row, length in enumerate(batch.lengths):
        theirs = torch.stack([layer[row, :, :length, :length] for layer in own.attentions])  # (layers, H, L, L)
        assert max_diff(captured[row], theirs) <= 1e-5


def test_a_local_layers_maps_are_zero_outside_its_window_and_a_global_layers_see_every_key(
    adapter: ModernBertAdapter, batch: Batch
) -> None:
    assert adapter.model.config.layer_types == ["full_attention", "sliding_attention", "full_attention"]
    for row, maps in enumerate(adapter.capture(batch).maps):
        length = batch.lengths[row]
        offsets = torch.arange(length)
        inside = (offsets[:, None] - offsets[None, :]).abs() <= REACH  # (L, L)
        assert bool((maps[0] > 0).all()) and bool((maps[2] > 0).all())
        assert torch.equal(maps[1] > 0, inside.expand(adapter.num_heads, length, length))
        assert torch.allclose(maps.sum(-1), torch.ones(3, adapter.num_heads, length), atol=1e-5)


def test_replaying_a_map_without_the_window_gives_another_row(adapter: ModernBertAdapter, batch: Batch) -> None:
    """The window is in the map (replay adds none): a map captured without it is not the row's."""
    unwindowed = tiny_model("modernbert")  # the same weights
    unwindowed.model.config.local_attention = 1000
    wide = adapter_for(unwindowed).capture(batch).maps
    own = adapter.capture(batch).maps
    baseline = adapter.forward(batch)
    row, length = 1, batch.lengths[1]
    assert max_diff(wide[row][1], own[row][1]) > 0.05 and max_diff(wide[row][0], own[row][0]) == 0
    assert max_diff(adapter.forward(batch, {row: own[row]})[row, :length], baseline[row, :length]) <= TOL
    assert max_diff(adapter.forward(batch, {row: wide[row]})[row, :length], baseline[row, :length]) > 1e-2


def test_padded_replayed_and_packed_rows_equal_the_models_own_forward_of_each_row_alone(
    loaded: LoadedModel, adapter: ModernBertAdapter, batch: Batch
) -> None:
    alone = _alone(loaded, batch)
    maps = adapter.capture(batch).maps
    padded = adapter.forward(batch)
    replayed = adapter.forward(batch, {0: maps[0], 2: maps[2], 5: maps[5]})
    packed = pack([batch.row_ids(row).tolist() for row in range(batch.size)])
    plain, _ = adapter.forward_packed(packed)
    mixed, kept = adapter.forward_packed(packed, {0: maps[0], 3: maps[3]}, keep=[1, 4])
    for row, length in enumerate(batch.lengths):
        for out in (padded[row, :length], replayed[row, :length], packed.row(plain, row), packed.row(mixed, row)):
            assert max_diff(out, alone[row]) <= TOL
    for row in (1, 4):
        assert max_diff(kept[row].float(), maps[row]) <= 1e-3  # fp16 as stored


@pytest.mark.parametrize("side", ["right", "left"])
def test_the_models_own_padded_batches_give_the_adapters_rows(
    loaded: LoadedModel, adapter: ModernBertAdapter, batch: Batch, side: str
) -> None:
    """Rotary positions are relative and the window is a distance: padding on either side leaves a row as it is."""
    ids, mask = batch.input_ids.clone(), batch.attention_mask.clone()
    if side == "left":
        for row, length in enumerate(batch.lengths):
            ids[row] = ids[row].roll(batch.padded_length - length)
            mask[row] = mask[row].roll(batch.padded_length - length)
    with torch.no_grad():
        theirs = loaded.model(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, P, hidden)
    ours = adapter.forward(batch)
    for row, length in enumerate(batch.lengths):
        own = theirs[row, :length] if side == "right" else theirs[row, batch.padded_length - length :]
        assert max_diff(ours[row, :length], own) <= TOL


def test_a_folder_loads_with_every_capability_and_its_embedding_layer_is_its_feature_source(tmp_path: Path) -> None:
    loaded = load_model(str(save_tiny_family("modernbert", tmp_path / "modernbert", pooling="mean")))
    adapter = adapter_for(loaded)
    assert type(adapter) is ModernBertAdapter and adapter.capabilities.complete
    config = loaded.model.config
    assert config.sliding_window == 4 and config.layer_types == ["full_attention", "sliding_attention"]
    texts = ["A man is playing a guitar.", "hi", "Failed password for root from 10.0.0.7 port 22 ssh2 again"]
    rows = [loaded.tokenizer(text)["input_ids"] for text in texts]
    assert max(len(row) for row in rows) > 2 * config.sliding_window + 1  # the window matters
    batch = batch_from_ids(rows, pad_id=loaded.tokenizer.pad_token_id)
    baseline = adapter.forward(batch)
    replayed = adapter.forward(batch, dict(enumerate(adapter.capture(batch).maps)))
    packed = pack(rows)
    out, _ = adapter.forward_packed(packed)
    assert loaded.sentence_transformer is not None
    tokens = loaded.sentence_transformer.encode(texts, output_value="token_embeddings", convert_to_numpy=False)
    for row, length in enumerate(batch.lengths):
        assert max_diff(replayed[row, :length], baseline[row, :length]) <= TOL
        assert max_diff(packed.row(out, row), baseline[row, :length]) <= TOL
        assert max_diff(tokens[row], baseline[row, :length]) <= TOL  # sentence-transformers' own forward
    # The projector's embedding stage (what a daemon derives written-back rows' features with) is the adapter's.
    layer = adapter.embedding_layer()
    assert layer.kind == "modernbert" and layer.positions is None and layer.norm_bias is None  # norm_bias=False
    for row, features in enumerate(adapter.feature_source(batch)):
        assert max_diff(layer.feature_source(rows[row]), features) <= 1e-5


def test_a_layer_of_a_type_the_adapter_does_not_know_takes_no_map_and_capabilities_say_which(batch: Batch) -> None:
    loaded = tiny_model("modernbert")
    loaded.model.config.layer_types = ["full_attention", "chunked_attention", "full_attention"]
    adapter = adapter_for(loaded)
    capabilities = adapter.capabilities
    assert not (capabilities.can_replay or capabilities.can_pack)
    assert "layers [1] of attention type ['chunked_attention'] take no map" in capabilities.missing
    maps = adapter_for(tiny_model("modernbert")).capture(batch).maps
    for refused in (lambda: adapter.capture(batch), lambda: adapter.forward(batch, {0: maps[0]}),
                    lambda: adapter.forward_keeping(batch, [1]), lambda: adapter.forward_packed(pack([[5, 6, 7]]))):
        with pytest.raises(UnsupportedModelError, match="take no map"):
            refused()


def test_an_attention_without_its_fused_projection_is_refused_by_name() -> None:
    loaded = tiny_model("modernbert")
    del loaded.model.layers[0].attn.Wqkv
    with pytest.raises(UnsupportedModelError, match=r"lacks ModernBERT's attention layout \(missing \['Wqkv'\]\)"):
        adapter_for(loaded)
