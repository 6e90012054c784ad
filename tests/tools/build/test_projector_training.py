"""Projector training: the map-distance target, pair mining, Siamese training on tiny real models."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel, LlamaConfig, LlamaModel

from attnstore.errors import CorpusError, MapShapeError
from attnstore_client.projector import Projector
from attnstore_tools.build.training import (
    MIN_CORPUS,
    TrainConfig,
    _sample_pairs,
    map_distance,
    map_distances,
    rank_correlation,
    train_projector,
)

VOCAB = 96
FAST = TrainConfig(max_epochs=40, patience=5, batch_size=128, progress=False)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tensors this small are dominated by thread wake-ups: 40x faster on one busy-machine core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _templated_corpus(seed: int = 0) -> list[torch.Tensor]:
    """Token ids: 4 templates x 3 lengths, 8 fills each; fills change 1-2 slot tokens."""
    rng = np.random.default_rng(seed)
    corpus = []
    for length in (8, 11, 14):
        for _ in range(4):
            template = rng.integers(4, VOCAB, size=length)
            slots = rng.choice(length, size=2, replace=False)
            for _ in range(8):
                ids = template.copy()
                edits = int(rng.integers(1, 3))
                ids[slots[:edits]] = rng.integers(4, VOCAB, size=edits)
                corpus.append(torch.from_numpy(ids))
    return corpus


@torch.no_grad()
def _capture(model: torch.nn.Module, ids: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Feature sources and fp16 maps (layers, heads, L, L), one forward per length (no padding)."""
    sources: list[torch.Tensor] = [torch.empty(0)] * len(ids)
    maps: list[torch.Tensor] = [torch.empty(0)] * len(ids)
    for length in sorted({row.numel() for row in ids}):
        rows = [i for i, row in enumerate(ids) if row.numel() == length]
        batch = torch.stack([ids[i] for i in rows])  # (B, L)
        out = model(input_ids=batch, output_attentions=True)
        if isinstance(model, BertModel):
            source = model.embeddings(input_ids=batch)  # token + position + type embeddings, LayerNorm
        else:
            source = model.layers[0].input_layernorm(model.embed_tokens(batch))  # first RMSNorm
        attentions = torch.stack(out.attentions, dim=1).half()  # (B, layers, heads, L, L)
        for b, i in enumerate(rows):
            sources[i], maps[i] = source[b], attentions[b]
    return sources, maps


@pytest.fixture(scope="module")
def bert_corpus() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64)
    model = BertModel(config, add_pooling_layer=False).eval()
    model.set_attn_implementation("eager")
    return _capture(model, _templated_corpus())


@pytest.fixture(scope="module")
def llama_model() -> LlamaModel:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaModel(config).eval()
    model.set_attn_implementation("eager")
    return model


def _one_hot_maps(columns: list[int]) -> torch.Tensor:
    """(1, 1, L, L) maps whose row p puts all its weight on column ``columns[p]``."""
    length = len(columns)
    maps = torch.zeros(1, 1, length, length)
    maps[0, 0, torch.arange(length), torch.tensor(columns)] = 1.0
    return maps


def test_map_distance_is_alpha_times_mean_row_tv_plus_length_gap() -> None:
    a = _one_hot_maps([0, 0, 0, 0])
    b = _one_hot_maps([0, 1, 0, 3])  # two of four rows move all their weight: mean TV 0.5
    assert map_distance(a, a) == 0.0
    assert map_distance(a, b) == pytest.approx(0.2 * 0.5)
    assert map_distance(a, b, alpha=1.0) == pytest.approx(0.5)
    longer = _one_hot_maps([0, 0, 0, 0, 4, 4])  # same top-left 4x4 block, two tokens longer
    assert map_distance(a, longer) == pytest.approx(2.0)


def test_map_distances_matches_pairwise_and_accepts_fp16(bert_corpus) -> None:
    _, maps = bert_corpus
    same = [m for m in maps if m.shape[-1] == 11]
    batch = map_distances(same[0], torch.stack(same[1:6]))
    single = [map_distance(same[0].float(), m.float()) for m in same[1:6]]
    np.testing.assert_allclose(batch, single, rtol=1e-5)
    assert (batch > 0).all() and (batch < 0.2).all()  # TV of distributions is at most 1


def test_crop_of_a_causal_models_longer_maps_costs_only_the_length_gap(llama_model) -> None:
    prefix = torch.arange(4, 14)
    longer = torch.cat([prefix, torch.tensor([50, 60, 70])])
    _, maps = _capture(llama_model, [prefix, longer])
    assert map_distance(maps[0], maps[1]) == pytest.approx(3.0, abs=1e-3)


def test_map_distances_rejects_maps_of_other_layouts() -> None:
    with pytest.raises(MapShapeError, match="query maps"):
        map_distances(torch.zeros(2, 3, 4), torch.zeros(1, 2, 3, 4, 4))
    with pytest.raises(MapShapeError, match="layers, heads"):
        map_distances(torch.zeros(2, 3, 4, 4), torch.zeros(1, 2, 2, 4, 4))


def test_rank_correlation_handles_order_reversal_and_ties() -> None:
    assert rank_correlation(np.array([1, 2, 3, 4]), np.array([10, 20, 30, 40])) == pytest.approx(1.0)
    assert rank_correlation(np.array([1, 2, 3, 4]), np.array([4, 3, 2, 1])) == pytest.approx(-1.0)
    assert rank_correlation(np.array([0, 0, 1, 2]), np.array([0, 0, 5, 9])) == pytest.approx(1.0)
    assert rank_correlation(np.array([1.0, 1.0, 2.0]), np.array([1.0, 2.0, 3.0])) == pytest.approx(0.8660254)
    assert np.isnan(rank_correlation(np.array([1, 1, 1]), np.array([1, 2, 3])))


def test_pair_sampling_mines_near_neighbours_and_includes_identical_pairs() -> None:
    rng = np.random.default_rng(0)
    cheap = rng.standard_normal((40, 8))
    cheap[1] = cheap[0] + 1e-3  # 1 is 0's near duplicate
    lengths = np.full(40, 9)
    items = np.arange(40)
    config = dataclasses.replace(FAST, neighbours=1, random_pairs=1, duplicate_fraction=0.1)
    left, right = _sample_pairs(cheap, lengths, items, items, config, rng, symmetric=True)
    pairs = set(zip(left.tolist(), right.tolist(), strict=True))
    assert (0, 1) in pairs
    identical = int((left == right).sum())
    assert identical >= 1 and identical == round(0.1 * (left.size - identical))


def test_train_projector_on_tiny_bert_learns_to_rank_held_out_pairs(bert_corpus) -> None:
    sources, maps = bert_corpus
    projector, report = train_projector(sources, maps, config=FAST)
    assert isinstance(projector, Projector) and not projector.training
    assert projector.project(sources[:3]).shape == (3, 128)
    assert 1 <= report.best_epoch <= report.epochs <= FAST.max_epochs
    assert len(report.train_loss) == len(report.val_loss) == report.epochs
    assert report.train_loss[-1] < report.train_loss[0]
    assert report.val_items >= 1 and report.val_pairs > 0 and report.train_pairs > report.val_pairs
    assert report.val_spearman > 0.5, report


def test_training_is_reproducible_with_a_fixed_seed(bert_corpus) -> None:
    sources, maps = bert_corpus
    config = dataclasses.replace(FAST, max_epochs=2)
    first, _ = train_projector(sources, maps, config=config)
    second, _ = train_projector(sources, maps, config=config)
    np.testing.assert_array_equal(first.project(sources[:4]), second.project(sources[:4]))


def test_train_projector_on_tiny_llama_with_crop_pairs(llama_model) -> None:
    sources, maps = _capture(llama_model, _templated_corpus(seed=1))
    projector, report = train_projector(sources, maps, config=dataclasses.replace(FAST, causal=True))
    _, same_length_only = train_projector(sources, maps, config=FAST)
    assert projector.config.hidden == 32
    assert report.train_pairs > same_length_only.train_pairs  # crop pairs against longer inputs
    assert report.val_spearman > 0.5, report  # the length gap enters the ranking too


def test_too_small_corpus_names_the_minimum(bert_corpus) -> None:
    sources, maps = bert_corpus
    with pytest.raises(CorpusError, match=f"at least {MIN_CORPUS}"):
        train_projector(sources[: MIN_CORPUS - 1], maps[: MIN_CORPUS - 1], config=FAST)


def test_corpus_without_three_inputs_of_one_length_is_refused() -> None:
    sources = [torch.randn(length, 8) for length in range(1, 21)]
    maps = [torch.full((1, 1, length, length), 1.0 / length) for length in range(1, 21)]
    with pytest.raises(CorpusError, match="3 inputs of one token length"):
        train_projector(sources, maps, config=FAST)


def test_causal_corpus_of_all_distinct_lengths_trains_and_validates_on_crop_pairs() -> None:
    # Long prompts (5-shot MMLU) rarely share a length: a causal model still trains on crop pairs.
    torch.manual_seed(0)
    sources = [torch.randn(length, 8) for length in range(4, 28)]
    maps = [torch.tril(torch.rand(1, 2, length, length)) for length in range(4, 28)]
    maps = [m / m.sum(dim=-1, keepdim=True) for m in maps]
    projector, report = train_projector(sources, maps, config=dataclasses.replace(FAST, causal=True))
    assert report.train_pairs > 0 and report.val_pairs > 0 and report.val_items >= 1
    assert projector.config.hidden == 8


def test_maps_that_do_not_match_their_source_are_refused(bert_corpus) -> None:
    sources, maps = bert_corpus
    bad = list(maps)
    bad[5] = bad[5][..., :-1, :-1]
    with pytest.raises(MapShapeError, match="maps 5"):
        train_projector(sources, bad, config=FAST)
