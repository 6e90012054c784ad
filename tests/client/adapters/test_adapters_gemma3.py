"""Gemma 3 (``gemma3_text``): Llama's layout plus query and key norms, ``query_pre_attn_scalar``, scaled embeddings,
sliding-window layers alternating with full ones (each kind with its own rotary table), causal (Gemma 3 instruct
models) or bidirectional (``use_bidirectional_attention``: EmbeddingGemma, its sliding window on both sides).

The shared suite (``test_adapters_shared``, ``test_adapters_packed``) runs both as every family; here what is
particular to them, against the model's own forward: capture equals the model's eager attention probabilities,
replaying captured maps reproduces the forward, packed equals padded equals the model's own forward on right- and
left-padded batches, windows are honoured in rows longer than them, and neither has the prefix or chunk tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnstore.errors import MapShapeError, UnsupportedModelError
from attnstore_client.adapters import (
    Adapter,
    BidirectionalGemma3Adapter,
    Gemma3Adapter,
    LlamaAdapter,
    adapter_for,
)
from attnstore_client.adapters.attention import allowed_keys
from attnstore_client.adapters.batch import Batch, batch_from_ids
from attnstore_client.adapters.packed import pack
from attnstore_client.models import LoadedModel, is_causal, load_model
from attnstore_client.tiers.available import cache_tiers
from attnstore_client.tiers.prefix.shared import shareable
from tests.support.adapters import max_diff, random_rows, save_tiny_family, tiny_model

TOL = 1e-4
LENGTHS = [14, 3, 9, 11]  # longer than every window (6 causal, |i - j| < 4 bidirectional)
KINDS = ["gemma3_text", "embeddinggemma"]  # causal, bidirectional


def _padded(rows: list[list[int]], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` padded with 0 on ``side``: input ids and attention mask ``(B, P)``."""
    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(rows):
        span = slice(0, len(tokens)) if side == "right" else slice(width - len(tokens), width)
        ids[row, span], mask[row, span] = torch.tensor(tokens), 1
    return ids, mask


def _own(loaded: LoadedModel, rows: list[list[int]], side: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The model's own forward of ``rows`` padded on ``side``: per row its last hidden states ``(L, hidden)`` and its
    attention probabilities ``(layers, H, L, L)`` (eager models only; else empty)."""
    ids, mask = _padded(rows, side)
    eager = loaded.model.config._attn_implementation == "eager"
    with torch.no_grad():
        out = loaded.model(input_ids=ids, attention_mask=mask, output_attentions=eager)
    width = ids.shape[1]
    spans = [slice(0, len(r)) if side == "right" else slice(width - len(r), width) for r in rows]
    hidden = [out.last_hidden_state[row, span] for row, span in enumerate(spans)]
    if not eager:
        return hidden, []
    return hidden, [torch.stack([layer[row, :, span, span] for layer in out.attentions])
                    for row, span in enumerate(spans)]


@pytest.fixture(params=KINDS, scope="module")
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def adapter(kind: str) -> Adapter:
    return adapter_for(tiny_model(kind))


@pytest.fixture(scope="module")
def rows() -> list[list[int]]:
    return random_rows(LENGTHS, seed=7)


@pytest.fixture(scope="module")
def batch(rows: list[list[int]]) -> Batch:
    return batch_from_ids(rows, pad_id=0)


def test_the_config_chooses_the_adapter_and_whether_it_is_causal(adapter: Adapter, kind: str) -> None:
    bidirectional = kind == "embeddinggemma"
    assert type(adapter) is (BidirectionalGemma3Adapter if bidirectional else Gemma3Adapter)
    assert adapter.causal is not bidirectional and is_causal(adapter.model.config) is not bidirectional
    assert (adapter.family, adapter.num_layers, adapter.num_heads, adapter.num_kv_heads, adapter.head_dim) == (
        "llama", 3, 4, 2, 16)
    assert adapter._scaling(adapter.attention_modules[0]) == 12**-0.5  # query_pre_attn_scalar, not head_dim
    windows = [adapter._sliding_window(module) for module in adapter.attention_modules]
    assert windows == ([4, None, 4] if bidirectional else [6, None, 6])  # the config halves a bidirectional one


@pytest.mark.parametrize("side", ["right", "left"])
def test_capture_equals_the_models_own_eager_attention_probs(
    kind: str, rows: list[list[int]], batch: Batch, side: str
) -> None:
    captured = adapter_for(tiny_model(kind)).capture(batch)
    hidden, eager = _own(tiny_model(kind, attn_implementation="eager"), rows, side)  # same seed: same weights
    for row in range(batch.size):
        assert max_diff(captured.maps[row], eager[row]) <= 1e-5
        assert max_diff(captured.hidden[row], hidden[row]) <= TOL


def test_sliding_layers_keep_to_their_window_and_full_layers_do_not(adapter: Adapter, batch: Batch) -> None:
    maps = adapter.capture(batch).maps[0]  # (layers, H, 14, 14)
    for layer, module in enumerate(adapter.attention_modules):
        window = adapter._sliding_window(module)
        allowed = allowed_keys(14, window, causal=adapter.causal)  # (14, 14)
        if (~allowed).any():  # a bidirectional full layer masks nothing
            assert maps[layer][..., ~allowed].abs().max() == 0
        assert maps[layer][..., allowed].min() > 0
        if window is not None:
            assert (~allowed & allowed_keys(14, None, causal=adapter.causal)).any()  # the window cut keys off


@pytest.mark.parametrize("side", ["right", "left"])
def test_packed_equals_padded_equals_the_models_own_forward(
    adapter: Adapter, rows: list[list[int]], batch: Batch, side: str
) -> None:
    own, _ = _own(adapter.loaded, rows, side)
    padded = adapter.forward(batch)
    packed = pack(rows)
    out, _ = adapter.forward_packed(packed)
    for row, length in enumerate(batch.lengths):
        assert max_diff(padded[row, :length], own[row]) <= TOL
        assert max_diff(packed.row(out, row), own[row]) <= TOL


def test_replaying_captured_maps_reproduces_the_forward_padded_and_packed(
    adapter: Adapter, rows: list[list[int]], batch: Batch
) -> None:
    baseline = adapter.forward(batch)
    captured = adapter.capture(batch).maps
    replay = {0: captured[0], 2: captured[2]}  # the others compute: hits and misses in one forward
    replayed = adapter.forward(batch, replay)
    kept_out, kept = adapter.forward_keeping(batch, keep=[1, 3], replay=replay)
    packed = pack(rows)
    packed_out, packed_kept = adapter.forward_packed(packed, replay=replay, keep=[1])
    for row, length in enumerate(batch.lengths):
        assert max_diff(replayed[row, :length], baseline[row, :length]) <= TOL
        assert max_diff(kept_out[row, :length], baseline[row, :length]) <= TOL
        assert max_diff(packed.row(packed_out, row), baseline[row, :length]) <= TOL
    for row, maps in (*kept.items(), *packed_kept.items()):
        assert max_diff(maps.float(), captured[row]) <= 1e-3  # kept as fp16


def test_a_bidirectional_map_replays_at_its_exact_length_only(batch: Batch) -> None:
    encoder = adapter_for(tiny_model("embeddinggemma"))
    longer = encoder.capture(batch).maps[0]  # row 0: 14 tokens
    with pytest.raises(MapShapeError, match="bidirectional: exact length"):
        encoder.forward(batch, {2: longer})  # row 2: 9 tokens
    decoder = adapter_for(tiny_model("gemma3_text"))
    decoder.forward(batch, {2: decoder.capture(batch).maps[0]})  # a causal map crops to the row's length


def test_the_query_and_key_norms_are_in_the_maps(batch: Batch) -> None:
    """Without the norms (Llama's queries and keys) the maps differ, and replaying them gives other rows."""
    loaded = tiny_model("gemma3_text")
    adapter = adapter_for(loaded)
    normed = adapter.capture(batch).maps[0]
    plain = LlamaAdapter(loaded).capture(batch).maps[0]  # the same forward, Llama's queries and keys
    assert max_diff(normed, plain) > 0.05
    baseline = adapter.forward(batch)
    assert max_diff(adapter.forward(batch, {0: plain})[0, :14], baseline[0, :14]) > 1e-2


def test_a_gemma3_attention_without_its_norms_or_the_matching_adapter_is_refused_by_name() -> None:
    loaded = tiny_model("gemma3_text")
    del loaded.model.layers[0].self_attn.q_norm
    with pytest.raises(UnsupportedModelError, match=r"lacks Gemma 3's query and key norms .*\['q_norm'\]"):
        Gemma3Adapter(loaded)
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention is True"):
        Gemma3Adapter(tiny_model("embeddinggemma"))
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention is False"):
        BidirectionalGemma3Adapter(tiny_model("gemma3_text"))


def test_neither_shares_keys_and_values_and_the_tiers_say_why(adapter: Adapter, kind: str) -> None:
    capabilities = adapter.capabilities
    assert capabilities.can_replay and capabilities.can_pack and not capabilities.can_share_kv
    assert not shareable(adapter)
    with pytest.raises(UnsupportedModelError, match="sliding window"):
        adapter.decoder_steps()

    class Switches:
        exact = maps = prefix = packed = True
        chunks: object = object()

    tiers = cache_tiers(adapter, Switches(), write_back_off=None, has_projector=True)
    assert tiers.maps and tiers.packed and not (tiers.prefix or tiers.chunks)
    why = "a bidirectional model" if kind == "embeddinggemma" else "sliding-window attention"
    assert why in tiers.absent["prefix"] and why in tiers.absent["chunks"], tiers.absent


def test_the_adapters_feature_source_is_the_scaled_embeddings_normed(adapter: Adapter, batch: Batch) -> None:
    decoder = adapter.model
    for row, source in enumerate(adapter.feature_source(batch)):
        ids = batch.row_ids(row)[None]
        with torch.no_grad():
            expected = decoder.layers[0].input_layernorm(decoder.embed_tokens(ids))[0]  # (L, hidden)
        assert max_diff(source, expected) == 0
    assert float(decoder.embed_tokens.embed_scale) == pytest.approx(64**0.5)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_a_folder_loads_as_its_config_says(tmp_path: Path, bidirectional: bool) -> None:
    folder = save_tiny_family("gemma3_text", tmp_path / "gemma", bidirectional=bidirectional, causal_lm=True)
    loaded = load_model(str(folder))
    adapter = adapter_for(loaded)
    assert type(adapter) is (BidirectionalGemma3Adapter if bidirectional else Gemma3Adapter)
    assert (loaded.lm_head is None) is bidirectional  # an encoder loads without its head
    texts = ["A man is playing a guitar.", "hi", "Three dogs run across a snowy field in the early morning light."]
    rows = [loaded.tokenizer(text)["input_ids"] for text in texts]
    batch = batch_from_ids(rows, pad_id=loaded.tokenizer.pad_token_id)
    baseline = adapter.forward(batch)
    replayed = adapter.forward(batch, dict(enumerate(adapter.capture(batch).maps)))
    packed = pack(rows)
    out, _ = adapter.forward_packed(packed)
    for row, length in enumerate(batch.lengths):
        assert max_diff(replayed[row, :length], baseline[row, :length]) <= TOL
        assert max_diff(packed.row(out, row), baseline[row, :length]) <= TOL
