"""The chunk tier inside AttnCache: prompts in segments scored from stored chunks (tiny Llama, in-memory store)."""

from __future__ import annotations

import pytest
import torch

from attnstore.index import ExactIndex
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore
from attnstore_client.cache import AttnCache
from attnstore_client.call.settings import ChunkSettings
from attnstore_client.connection.local import LocalConnection
from tests.support.caches import fill_namespace, plain_hidden, tiny_loaded

INSTRUCTION = "w2 w3 w4 w5 w6"
CHUNKS = ["w20 w21 w22 w23 w24 w25", "w30 w31 w32", "w40 w41 w42 w43 w44 w45 w46", "w50 w51 w52 w53"]
PROMPTS = [
    [INSTRUCTION, CHUNKS[0], CHUNKS[1], "w7 w8"],
    [INSTRUCTION, CHUNKS[2], CHUNKS[0], CHUNKS[3], "w9"],
    [INSTRUCTION, CHUNKS[1], CHUNKS[3], CHUNKS[2], "w7 w9 w8"],
]
EXACT = ChunkSettings(method="a3", ratio=1.0, recent=0, dtype="float32")


@pytest.fixture(scope="module")
def llama():
    return tiny_loaded("llama")


@pytest.fixture
def cache(llama):
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, llama, ["w60 w61"])
    return AttnCache(llama, LocalConnection("local:memory", service), exact=False, chunks=EXACT)


def full_last(llama, prompts) -> torch.Tensor:
    # The word tokenizer splits on spaces: segments joined give the same tokens.
    return torch.stack([states[-1] for states in plain_hidden(llama, [" ".join(p) for p in prompts])])


def test_prompts_in_segments_are_fused_from_stored_chunks_and_all_recomputed_equal_full_prefill(llama, cache):
    first = cache.last_hidden_states(PROMPTS, batch_size=2)
    assert cache.last_row_kinds == ("chunk",) * 3 and cache.last_stats.chunks_captured == 1 + 4
    again = cache.last_hidden_states(PROMPTS, batch_size=2)
    stats = cache.last_stats
    assert stats.chunk_hits == 3 and stats.chunks_captured == 0 and stats.chunk_tokens == 3 * 5 + 9 + 17 + 14
    assert stats.chunk_recomputed == 9 + 17 + 14  # ratio 1: every chunk token
    want = full_last(llama, PROMPTS)
    assert torch.allclose(first, want, atol=1e-4) and torch.allclose(again, want, atol=1e-4)
    scores = cache.score_choices(PROMPTS, choices=("w10", "w11"))
    with torch.inference_mode():
        expected = torch.softmax(llama.lm_head(want)[:, [10, 11]], dim=-1)  # word "wN" has id N
    assert torch.allclose(torch.from_numpy(scores.probabilities), expected, atol=1e-4)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_prompts_fused_from_stored_chunks_and_all_recomputed_equal_full_prefill(kind):
    # Qwen3's chunk keys are stored after its per-head key norm, before RoPE, and rotated where a prompt puts them;
    # Qwen2's are Llama's, with its projections' biases.
    loaded = tiny_loaded(kind)
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, loaded, ["w60 w61"])
    cache = AttnCache(loaded, LocalConnection("local:memory", service), exact=False, chunks=EXACT)
    assert cache.tiers.has("chunks") and cache.tiers.has("prefix") and cache.tiers.has("maps")
    cache.last_hidden_states(PROMPTS, batch_size=2)  # stores every chunk
    again = cache.last_hidden_states(PROMPTS, batch_size=2)
    assert cache.last_row_kinds == ("chunk",) * 3 and cache.last_stats.chunk_hits == 3
    assert torch.allclose(again, full_last(loaded, PROMPTS), atol=1e-4)


def test_full_reuse_computes_the_question_alone_and_is_approximate(llama, cache):
    cache.last_hidden_states(PROMPTS)  # stores every chunk
    cache.chunks = ChunkSettings(method="full_reuse", recent=0, dtype="float32")
    got = cache.last_hidden_states(PROMPTS)
    assert cache.last_row_kinds == ("chunk",) * 3 and cache.last_stats.chunk_recomputed == 0
    assert cache.last_stats.forward_tokens == 2 + 1 + 3  # the questions, in full-forward tokens
    assert torch.isfinite(got).all() and not torch.allclose(got, full_last(llama, PROMPTS), atol=1e-3)


def test_calls_that_want_every_token_and_plain_prompts_are_not_fused(llama, cache):
    cache.hidden_states([[2, 3, 20, 21, 7]])
    assert cache.last_row_kinds == ("miss",)
    cache.last_hidden_states([" ".join(PROMPTS[0])])
    assert cache.last_row_kinds == ("miss",)
    cache.chunks = None
    got = cache.last_hidden_states(PROMPTS)
    assert cache.last_row_kinds == ("miss",) * 3 and torch.allclose(got, full_last(llama, PROMPTS), atol=1e-5)


def test_the_same_ids_cut_into_other_segments_or_given_plain_are_rows_of_their_own(llama, cache):
    # Deduplication by ids alone gave the plain text (computed exactly) the fused prompt's approximation.
    cache.last_hidden_states(PROMPTS)  # stores every chunk
    cache.chunks = ChunkSettings(method="full_reuse", recent=0, dtype="float32")
    fused, plain = PROMPTS[1], " ".join(PROMPTS[1])
    got = cache.last_hidden_states([fused, plain, fused])
    assert cache.last_row_kinds == ("chunk", "miss", "chunk")
    assert torch.allclose(got[1], full_last(llama, [fused])[0], atol=1e-5)
    assert torch.equal(got[2], got[0]) and not torch.allclose(got[0], got[1], atol=1e-3)
