"""The fused forward of prompts in segments on a tiny random Llama: position recovery, selection, the source; the
exactness tests on a tiny Qwen3 too (its keys stored after the per-head key norm, before RoPE)."""

from __future__ import annotations

import pytest
import torch

from attnstore.errors import ConfigError
from attnstore_client.adapters import adapter_for
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.call.settings import ChunkSettings
from attnstore_client.tiers.chunks.plan import FusionCounts, fuse_prompts
from attnstore_client.tiers.chunks.selection import chosen_count, select_tokens
from attnstore_client.tiers.chunks.source import ChunkKV, MemoryChunkSource, chunk_key
from tests.support.adapters import random_rows, tiny_model

INSTRUCTION, C1, C2, C3, C4, Q1, Q2 = random_rows([6, 7, 9, 5, 8, 4, 3], seed=3)
REUSE = ChunkSettings(method="full_reuse", recent=0, dtype="float32")  # stored chunks only, none computed again


@pytest.fixture(scope="module")
def adapter():
    return adapter_for(tiny_model("llama"))


@pytest.fixture(params=["llama", "qwen3"], scope="module")
def decoder(request):
    """Each Llama-like layout the fused forward runs in steps: Qwen3's query and key norms come before RoPE."""
    return adapter_for(tiny_model(request.param))


def prompt(*segments: list[int]) -> tuple[list[int], tuple[int, ...]]:
    return [token for segment in segments for token in segment], tuple(len(segment) for segment in segments)


def full(adapter, ids: list[int]) -> torch.Tensor:
    return adapter.forward(batch_from_ids([ids], 0))[0]  # (L, hidden)


def filled(adapter, *prompts) -> MemoryChunkSource:
    """A source holding every instruction and chunk of ``prompts``, each computed on its own."""
    source = MemoryChunkSource()
    fuse_prompts(adapter, source, list(prompts), REUSE)
    return source


@pytest.mark.parametrize("method", ["a3", "cacheblend"])
def test_every_chunk_stored_and_all_computed_again_equals_full_prefill(decoder, method):
    adapter = decoder
    # Chunks stored after the instruction alone, reused elsewhere and in another order: position recovery.
    source = filled(adapter, prompt(INSTRUCTION, C1, Q1), prompt(INSTRUCTION, C2, Q1), prompt(INSTRUCTION, C3, Q1))
    prompts = [prompt(INSTRUCTION, C3, C1, C2, Q2), prompt(INSTRUCTION, C2, C3, Q1)]
    counts = FusionCounts()
    out = fuse_prompts(adapter, source, prompts, ChunkSettings(method=method, ratio=1.0, recent=0, dtype="float32"),
                       counts=counts)
    for (ids, segments), states in zip(prompts, out, strict=True):
        want = full(adapter, ids)[-segments[-1] :]
        assert states.shape == want.shape and torch.allclose(states, want, atol=1e-4)
    assert counts.captured == 0 and counts.stored_tokens == 6 + 21 + 6 + 14


def test_a_chunk_reused_where_it_was_computed_equals_full_prefill_without_any_recompute(decoder):
    adapter = decoder
    # Right after the instruction, a stored chunk's keys and values are the full forward's at every layer.
    source = filled(adapter, prompt(INSTRUCTION, C1, C2, Q1))
    ids, segments = prompt(INSTRUCTION, C1, Q2)
    states = fuse_prompts(adapter, source, [(ids, segments)], REUSE)[0]
    assert torch.allclose(states, full(adapter, ids)[-3:], atol=1e-4)


def test_full_reuse_runs_and_differs_from_full_prefill_where_chunks_moved(adapter):
    source = filled(adapter, prompt(INSTRUCTION, C1, C2, C3, Q1))
    ids, segments = prompt(INSTRUCTION, C3, C2, C1, Q1)
    counts = FusionCounts()
    states = fuse_prompts(adapter, source, [(ids, segments)], REUSE,
                          counts=counts)[0]
    assert torch.isfinite(states).all()
    assert (states - full(adapter, ids)[-4:]).abs().max() > 1e-3
    layers = adapter.num_layers
    assert counts.chosen_tokens == 0 and counts.token_layers == 4 * layers  # the question alone, every layer


def test_missing_chunks_are_computed_in_place_and_put_in_the_source(adapter):
    source = MemoryChunkSource()
    ids, segments = prompt(INSTRUCTION, C2, C4, Q1)
    counts = FusionCounts()
    states = fuse_prompts(adapter, source, [(ids, segments)], REUSE,
                          counts=counts)[0]
    assert torch.allclose(states, full(adapter, ids)[-4:], atol=1e-4)  # nothing was stored: all computed
    assert counts.captured == 3 and counts.stored_tokens == 6  # the instruction is exact wherever it comes from
    assert source.contains(chunk_key(None, INSTRUCTION)) and source.contains(chunk_key(INSTRUCTION, C4))
    assert not source.contains(chunk_key(None, C4))  # a chunk is stored under the instruction it followed
    again = FusionCounts()
    fuse_prompts(adapter, source, [(ids, segments)], REUSE,
                 counts=again)
    assert again.captured == 0 and again.stored_tokens == 6 + 9 + 8


def test_the_last_chunks_asked_for_are_computed_in_full_and_the_ones_before_them_stay_stored(adapter):
    prompts = [prompt(INSTRUCTION, C1, C2, C3, Q1)]
    source = filled(adapter, *prompts)
    counts = FusionCounts()
    recent = ChunkSettings(method="full_reuse", recent=2, dtype="float32")
    states = fuse_prompts(adapter, source, prompts, recent, counts=counts)[0]
    assert counts.candidate_tokens == 7 and counts.stored_tokens == 6 + 7  # C1 only; C2 and C3 computed
    # Every chunk but the first computed in full, the first right after the instruction: full prefill's states.
    assert torch.allclose(states, full(adapter, prompts[0][0])[-4:], atol=1e-4)
    with pytest.raises(ConfigError, match="recent"):
        ChunkSettings(recent=-1)


@pytest.mark.parametrize("method", ["a3", "cacheblend"])
@pytest.mark.parametrize("ratio", [0.0, 0.15, 0.5, 0.9])
def test_the_ratio_of_chunk_tokens_computed_again_is_respected(adapter, method, ratio):
    prompts = [prompt(INSTRUCTION, C1, C2, C3, Q1), prompt(INSTRUCTION, C4, C1, Q2)]
    source = filled(adapter, *prompts)
    counts = FusionCounts()
    fuse_prompts(adapter, source, prompts, ChunkSettings(method=method, ratio=ratio, recent=0), counts=counts)
    assert counts.candidate_tokens == 21 + 15
    assert counts.chosen_tokens == chosen_count(ratio, 21) + chosen_count(ratio, 15)
    # select_layer 1: every token after the instruction at layer 0, then the chosen ones and the question.
    chosen = counts.chosen_tokens
    assert counts.token_layers == (21 + 4 + 15 + 3) + (adapter.num_layers - 1) * (chosen + 4 + 3)


@pytest.mark.parametrize("method", ["a3", "cacheblend"])
def test_selection_never_skips_the_question_and_picks_the_top_scores(adapter, method):
    torch.manual_seed(0)
    steps = adapter.decoder_steps()  # the model's attention scores the question's (a3)
    heads, kv_heads, n, d = steps.heads, steps.kv_heads, 12, steps.head_dim
    index = torch.arange(5, 5 + n)  # after an instruction of 5
    always = torch.zeros(n, dtype=torch.bool)
    always[-3:] = True  # the question
    always[2] = True  # a missing chunk's token
    query, keys = torch.randn(heads, n, d), torch.randn(kv_heads, 5 + n, d)
    fresh, stored = torch.randn(kv_heads, n, d), torch.randn(kv_heads, n, d)
    keep = select_tokens(ChunkSettings(method=method, ratio=0.25), steps, always, 3, index, query, keys, fresh, stored)
    assert keep[always].all() and int(keep.sum()) == int(always.sum()) + chosen_count(0.25, 8)
    if method == "cacheblend":
        deviation = (fresh - stored).pow(2).sum(dim=(0, 2))
        deviation[always] = -1
        assert set(keep.logical_and(~always).nonzero().flatten().tolist()) == set(deviation.topk(2).indices.tolist())


def test_the_memory_source_evicts_the_least_recently_used_past_its_bytes():
    def chunk(length: int) -> ChunkKV:
        return ChunkKV(torch.zeros(2, 1, length, 4), torch.zeros(2, 1, length, 4))

    size = chunk(3).nbytes
    source = MemoryChunkSource(capacity_bytes=2 * size)
    source.put(b"a", chunk(3))
    source.put(b"b", chunk(3))
    assert source.get(b"a") is not None  # a is now the most recent
    source.put(b"c", chunk(3))
    assert source.contains(b"a") and source.contains(b"c") and not source.contains(b"b")
    source.put(b"big", chunk(7))  # over the cap: not kept
    stats = source.stats()
    assert not source.contains(b"big") and stats.entries == 2 and stats.bytes == 2 * size and stats.evictions == 1


def test_bad_settings_name_the_valid_choices():
    with pytest.raises(ConfigError, match="a3"):
        ChunkSettings(method="blend")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ratio"):
        ChunkSettings(ratio=1.5)
