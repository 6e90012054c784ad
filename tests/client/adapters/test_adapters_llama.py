"""Capture and replay on Llama-like decoders (Llama, Mistral, Qwen2): GQA, RoPE, causal crop."""

from __future__ import annotations

import pytest
import torch

import attnstore_client.adapters.replay as replay_module
from attnstore.errors import UnsupportedModelError
from attnstore_client.adapters import LlamaAdapter, adapter_for
from attnstore_client.adapters.batch import batch_from_ids, tokenize
from tests.support.adapters import max_diff, random_rows, tiny_model

TOL = 1e-4
LENGTHS = [11, 4, 8]


@pytest.fixture(params=["llama", "mistral", "qwen2"], scope="module")
def adapter(request) -> LlamaAdapter:
    return adapter_for(tiny_model(request.param))


@pytest.fixture(scope="module")
def rows() -> list[list[int]]:
    return random_rows(LENGTHS)


def test_mistral_capture_honours_sliding_window():
    adapter = adapter_for(tiny_model("mistral"))
    maps = adapter.capture(batch_from_ids(random_rows([11]), pad_id=0)).maps[0]  # (layers, H, 11, 11)
    query, key = torch.meshgrid(torch.arange(11), torch.arange(11), indexing="ij")
    assert maps[..., key <= query - 6].abs().max() == 0
    assert maps[..., key == query - 5].min() > 0


def test_a_sliding_window_shares_no_keys_and_values_and_says_why():
    adapter = adapter_for(tiny_model("mistral"))
    assert not adapter.capabilities.can_share_kv and "sliding-window" in adapter.capabilities.missing
    with pytest.raises(UnsupportedModelError, match="sliding window"):
        adapter.decoder_steps()  # the chunk tier's fused forward


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_decoder_steps_run_a_row_as_its_forward_does(kind, rows):
    adapter = adapter_for(tiny_model(kind))
    steps = adapter.decoder_steps()
    ids = torch.tensor(rows[0])  # (L,)
    positions = torch.arange(len(ids))  # (L,)
    with torch.no_grad():
        cos, sin = steps.rotations(len(ids), torch.float32, ids.device)  # (1, L, d) each
        hidden = steps.embed(ids)  # (L, hidden)
        for layer in range(steps.layers):
            query, key, value = steps.queries_keys_values(layer, hidden)  # (H|KVH, L, d)
            query, key = steps.rotate(query[None], key[None], cos, sin)
            hidden = steps.finish_layer(layer, hidden, steps.attend(query[0], key[0], value, positions))
        out = steps.final_norm(hidden)  # (L, hidden)
    assert max_diff(out, adapter.forward(batch_from_ids(rows[:1], pad_id=0))[0]) <= TOL


def test_causal_crop_of_longer_prefix_maps_reproduces_shorter_input(adapter, rows):
    long_maps = adapter.capture(batch_from_ids(rows[:1], pad_id=0)).maps[0]  # (layers, H, 11, 11)
    short = batch_from_ids([rows[0][:7], rows[1]], pad_id=0)
    baseline = adapter.forward(short)
    replayed = adapter.forward(short, {0: long_maps})
    assert max_diff(replayed[0, :7], baseline[0, :7]) <= TOL
    assert torch.equal(replayed[1, :4], baseline[1, :4])


def test_row_blocked_causal_path_equals_baseline(adapter, rows, monkeypatch):
    monkeypatch.setattr(replay_module, "CAUSAL_BLOCK_ROWS", 3)
    batch = batch_from_ids(rows, pad_id=0)
    maps = adapter.capture(batch).maps
    baseline = adapter.forward(batch)
    replayed = adapter.forward(batch, {0: maps[0], 1: maps[1]})
    for row in (0, 1):
        length = batch.lengths[row]
        assert max_diff(replayed[row, :length], baseline[row, :length]) <= TOL


def test_eager_baseline_model_replays_too(rows):
    adapter = adapter_for(tiny_model("llama", attn_implementation="eager"))
    batch = batch_from_ids(rows, pad_id=0)
    maps = adapter.capture(batch).maps
    baseline = adapter.forward(batch)
    mixed = adapter.forward(batch, {1: maps[1]})
    assert torch.equal(mixed[0], baseline[0])
    assert max_diff(mixed[1, :4], baseline[1, :4]) <= TOL


def test_feature_source_is_layer0_input_norm_of_token_embeddings(adapter, rows):
    batch = batch_from_ids(rows, pad_id=0)
    features = adapter.feature_source(batch)
    model = adapter.model
    for row, ids in enumerate(rows):
        expected = model.layers[0].input_layernorm(model.embed_tokens(torch.tensor(ids)))
        assert features[row].shape == (len(ids), 64)
        assert torch.allclose(features[row], expected.detach())


@pytest.mark.real_model
def test_smollm2_replays_own_maps_single_padded_mixed_and_cropped(smollm2_model):
    adapter = adapter_for(smollm2_model)
    texts = ["The capital of France is Paris.", "Hi", "Logs: disk /dev/sda1 is 93% full on host web-04."]
    batch = tokenize(smollm2_model.tokenizer, texts)
    capture = adapter.capture(batch)
    baseline = adapter.forward(batch)
    for row, length in enumerate(batch.lengths):
        single = adapter.forward(batch_from_ids([batch.row_ids(row).tolist()], smollm2_model.tokenizer.pad_token_id))
        assert max_diff(single[0], baseline[row, :length]) <= TOL
        assert max_diff(capture.hidden[row], baseline[row, :length]) <= TOL
        assert max_diff(adapter.forward(batch, {row: capture.maps[row]})[row, :length], baseline[row, :length]) <= TOL
    replayed = adapter.forward(batch, dict(enumerate(capture.maps)))
    mixed = adapter.forward(batch, {0: capture.maps[0], 2: capture.maps[2]})
    for row, length in enumerate(batch.lengths):
        assert max_diff(replayed[row, :length], baseline[row, :length]) <= TOL
    assert torch.equal(mixed[1, : batch.lengths[1]], baseline[1, : batch.lengths[1]])

    # Past CAUSAL_BLOCK_ROWS the row-blocked path runs; the crop to 100 tokens folds.
    long_ids = torch.randint(1000, 40000, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    pad = smollm2_model.tokenizer.pad_token_id
    long = batch_from_ids([long_ids], pad)
    long_capture = adapter.capture(long)
    assert max_diff(adapter.forward(long, {0: long_capture.maps[0]}), adapter.forward(long)) <= TOL
    short = batch_from_ids([long_ids[:100]], pad)
    assert max_diff(adapter.forward(short, {0: long_capture.maps[0]}), adapter.forward(short)) <= TOL
