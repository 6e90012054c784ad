"""The shared ``Adapter`` suite: every attention family (BERT-like and Llama-like, each model type) passes it.

Family-specific behaviour (bidirectional length rules, causal crops, sliding
windows, the real models) is in ``test_adapters_bert`` and ``test_adapters_llama``.
"""

from __future__ import annotations

import pytest
import torch

from attnstore.errors import MapShapeError
from attnstore_client.adapters import Adapter, adapter_for
from attnstore_client.adapters.attention import allowed_keys
from attnstore_client.adapters.batch import Batch, batch_from_ids
from tests.support.adapters import max_diff, pad_id, random_rows, tiny_model

TOL = 1e-4
LENGTHS = [9, 3, 6]
KINDS = ["bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "modernbert", "llama", "mistral", "qwen2", "qwen3",
         "gemma3_text", "embeddinggemma"]
# (family, causal, layers, heads, kv heads, head dim) of each tiny model
LAYOUTS = {
    "bert": ("bert", False, 3, 4, 4, 16),
    "roberta": ("bert", False, 3, 4, 4, 16),
    "xlm-roberta": ("bert", False, 3, 4, 4, 16),
    "distilbert": ("bert", False, 3, 4, 4, 16),
    "mpnet": ("bert", False, 3, 4, 4, 16),
    "modernbert": ("bert", False, 3, 4, 4, 16),
    "llama": ("llama", True, 3, 4, 2, 16),
    "mistral": ("llama", True, 3, 4, 2, 16),
    "qwen2": ("llama", True, 3, 4, 2, 16),
    "qwen3": ("llama", True, 3, 4, 2, 16),  # head_dim explicit in its config
    "gemma3_text": ("llama", True, 3, 4, 2, 16),  # likewise
    "embeddinggemma": ("llama", False, 3, 4, 2, 16),  # Gemma 3 with use_bidirectional_attention
}


@pytest.fixture(params=KINDS, scope="module")
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def adapter(kind: str) -> Adapter:
    return adapter_for(tiny_model(kind))


@pytest.fixture(scope="module")
def batch(kind: str) -> Batch:
    return batch_from_ids(random_rows(LENGTHS), pad_id=pad_id(kind))


def test_adapter_reports_its_family_and_attention_layout(adapter: Adapter, kind: str) -> None:
    layout = (adapter.family, adapter.causal, adapter.num_layers, adapter.num_heads, adapter.num_kv_heads,
              adapter.head_dim)
    assert layout == LAYOUTS[kind]
    assert adapter.hidden_size == 64


def test_padded_batch_rows_equal_unpadded_single_rows(adapter: Adapter, batch: Batch, kind: str) -> None:
    padded = adapter.forward(batch)
    for row, length in enumerate(batch.lengths):
        alone = adapter.forward(batch_from_ids([batch.row_ids(row).tolist()], pad_id=pad_id(kind)))[0]
        assert max_diff(padded[row, :length], alone) <= TOL


def test_capture_gives_row_stochastic_maps_at_true_length_and_the_baseline_hidden(adapter: Adapter, batch: Batch):
    capture = adapter.capture(batch)
    baseline = adapter.forward(batch)
    for row, length in enumerate(batch.lengths):
        maps = capture.maps[row]
        assert maps.shape == (3, 4, length, length) and maps.dtype == torch.float32
        assert torch.allclose(maps.sum(-1), torch.ones(3, 4, length), atol=1e-5)
        if adapter.causal:
            assert maps.triu(diagonal=1).abs().max() == 0  # no token sees a later one
        else:  # every real token sees every real token within its layer's window (Gemma 3's, ModernBERT's)
            for layer, module in enumerate(adapter.attention_modules):
                seen = allowed_keys(length, adapter._sliding_window(module), causal=False).expand_as(maps[layer])
                assert torch.equal(maps[layer] > 0, seen)
        assert max_diff(capture.hidden[row], baseline[row, :length]) <= TOL


def test_replaying_own_maps_reproduces_a_single_row(adapter: Adapter, kind: str) -> None:
    single = batch_from_ids(random_rows([7]), pad_id=pad_id(kind))
    maps = adapter.capture(single).maps[0]
    assert max_diff(adapter.forward(single, {0: maps}), adapter.forward(single)) <= TOL


def test_replaying_own_maps_reproduces_a_padded_batch(adapter: Adapter, batch: Batch) -> None:
    maps = adapter.capture(batch).maps
    baseline = adapter.forward(batch)
    replayed = adapter.forward(batch, dict(enumerate(maps)))
    for row, length in enumerate(batch.lengths):
        assert max_diff(replayed[row, :length], baseline[row, :length]) <= TOL


def test_in_a_mixed_batch_misses_equal_the_baseline_exactly_and_hits_reproduce(adapter: Adapter, batch: Batch):
    maps = adapter.capture(batch).maps
    baseline = adapter.forward(batch)
    mixed = adapter.forward(batch, {0: maps[0], 2: maps[2]})
    if adapter.model.config._attn_implementation == "sdpa":
        assert torch.equal(mixed[1, : batch.lengths[1]], baseline[1, : batch.lengths[1]])
    else:  # eager attention (MPNet has no sdpa kernel): its matmuls round a subset of the rows differently
        assert max_diff(mixed[1, : batch.lengths[1]], baseline[1, : batch.lengths[1]]) <= 1e-6
    for row in (0, 2):
        length = batch.lengths[row]
        assert max_diff(mixed[row, :length], baseline[row, :length]) <= TOL


def test_lazy_per_layer_maps_are_read_in_layer_order(adapter: Adapter, kind: str) -> None:
    single = batch_from_ids(random_rows([7]), pad_id=pad_id(kind))
    maps = adapter.capture(single).maps[0]
    reads: list[int] = []

    class Streamed:
        def __len__(self) -> int:
            return maps.shape[0]

        def __getitem__(self, layer: int) -> torch.Tensor:
            reads.append(layer)
            return maps[layer]

    replayed = adapter.forward(single, {0: Streamed()})
    assert reads == [0, 1, 2]
    assert max_diff(replayed, adapter.forward(single)) <= TOL


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 5e-3), (torch.bfloat16, 5e-2)])
def test_half_precision_maps_are_cast_and_replayed(adapter: Adapter, kind: str, dtype: torch.dtype, tol: float):
    single = batch_from_ids(random_rows([7]), pad_id=pad_id(kind))
    maps = adapter.capture(single).maps[0].to(dtype)
    assert max_diff(adapter.forward(single, {0: maps}), adapter.forward(single)) <= tol


def test_feature_source_is_one_hidden_vector_per_real_token(adapter: Adapter, batch: Batch) -> None:
    features = adapter.feature_source(batch)
    assert [tuple(f.shape) for f in features] == [(length, 64) for length in batch.lengths]
    assert all(torch.isfinite(f).all() for f in features)


def test_forward_keeping_keeps_capture_maps_of_the_rows_asked_and_leaves_outputs_the_baseline(
    adapter: Adapter, batch: Batch
) -> None:
    capture = adapter.capture(batch)
    baseline = adapter.forward(batch)
    for keep in ([1], [0, 2], [0, 1, 2]):
        out, kept = adapter.forward_keeping(batch, keep)
        assert sorted(kept) == keep
        for row in keep:
            length = batch.lengths[row]
            assert kept[row].dtype == torch.float16 and kept[row].shape == (adapter.num_layers, adapter.num_heads,
                                                                            length, length)
            assert max_diff(kept[row].float(), capture.maps[row]) <= 1e-3  # fp16 rounding of the same maps
        for row, length in enumerate(batch.lengths):
            assert max_diff(out[row, :length], baseline[row, :length]) <= TOL


def test_forward_keeping_beside_replaying_rows_keeps_only_computing_rows(adapter: Adapter, batch: Batch) -> None:
    capture = adapter.capture(batch)
    baseline = adapter.forward(batch)
    out, kept = adapter.forward_keeping(batch, [2], {0: capture.maps[0]})
    assert list(kept) == [2] and max_diff(kept[2].float(), capture.maps[2]) <= 1e-3
    for row, length in enumerate(batch.lengths):
        assert max_diff(out[row, :length], baseline[row, :length]) <= TOL
    with pytest.raises(MapShapeError, match=r"rows \[0, 5\] cannot keep their maps"):
        adapter.forward_keeping(batch, [0, 5], {0: capture.maps[0]})
