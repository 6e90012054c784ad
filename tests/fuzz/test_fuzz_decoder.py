"""Differential fuzz of a decoder's calls: ``hidden_states`` over token rows that share stored prefixes, and
``score_choices`` over prompts (plain or in segments fused from stored chunks), each row compared with the plain
transformers forward of that row alone.

A tiny random Llama with a word tokenizer (capitalised words are all ``[UNK]``, whitespace is not a token): case
and whitespace variants give one row, repeats and duplicates compose across windows of the stream. The store is
a real LMDB store holding the prefix blocks of prompts over two shared prefixes; the chunk tier recomputes every
chunk token (ratio 1), so it too must equal full prefill. Configurations: the exact tiers on and off, the prefix
tier on and off, the chunk tier on and off, packed and padded, side by side or not, batch sizes of 1 to 4.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from fuzz_harness import Tally, fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from attnstore.service import AttnStoreService
from attnstore_client.cache import AttnCache
from attnstore_client.call.settings import ChunkSettings
from attnstore_client.connection.local import LocalConnection
from attnstore_client.models import LoadedModel
from tests.support.caches import tiny_loaded
from tests.support.prefixes import SHARED_A, SHARED_B, fill_prefix_namespace, prefix_rows

TOLERANCE = 1e-4  # fp32 prefix keys and values, chunks recomputed in full
EXACT_COSINE = 0.9999  # exact hits: stored outputs are fp16
KINDS = {"exact", "prefix", "chunk", "miss", "fallback"}
EVERY_CHUNK_TOKEN = ChunkSettings(method="a3", ratio=1.0, recent=0, dtype="float32")

# Token rows: over the stored prefixes (their blocks are in the store), over none, some longer than a chunk.
ROWS = (prefix_rows([3, 9, 1], seed=5, prefix=SHARED_A) + prefix_rows([6, 30], seed=6, prefix=SHARED_B)
        + prefix_rows([4, 12, 2], seed=7))
INSTRUCTION = "w2 w3 w4 w5 w6"
SEGMENTS = ("w20 w21 w22 w23 w24 w25", "w30 w31 w32", "w40 w41 W42 w43", "w50  w51 w52 w53")
QUESTIONS = ("w7 w8", "w9", "W7 w9 w8", "w7  w8 ")


@pytest.fixture(scope="module")
def llama() -> LoadedModel:
    return tiny_loaded("llama")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory, llama: LoadedModel) -> Iterator[AttnCache]:
    with AttnStoreService.open(tmp_path_factory.mktemp("fuzz-decoder") / "store", create=True) as service:
        fill_prefix_namespace(service, llama, prefix_rows([5], seed=1, prefix=SHARED_A)
                              + prefix_rows([3], seed=2, prefix=SHARED_B))
        with AttnCache(llama, LocalConnection("local:fuzz", service), prefix_min_tokens=16,
                       chunks=EVERY_CHUNK_TOKEN) as opened:
            yield opened


def _plain(llama: LoadedModel, ids: list[int]) -> torch.Tensor:
    """The plain transformers forward of one row alone: its last hidden states ``(L, hidden)``."""
    with torch.inference_mode():
        return llama.model(input_ids=torch.tensor([ids])).last_hidden_state[0]


@dataclass(frozen=True)
class Switches:
    exact: bool
    prefix: bool
    chunks: bool
    packed: bool
    side_by_side: bool
    batch_size: int

    def apply(self, cache: AttnCache) -> None:
        cache.exact = self.exact
        cache.prefix, cache.packed, cache.side_by_side = self.prefix, self.packed, self.side_by_side
        cache.chunks = EVERY_CHUNK_TOKEN if self.chunks else None


switches = st.builds(Switches, exact=st.booleans(), prefix=st.booleans(), chunks=st.booleans(), packed=st.booleans(),
                     side_by_side=st.booleans(), batch_size=st.integers(1, 4))


@st.composite
def token_calls(draw: st.DrawFn) -> list[list[int]]:
    size = draw(st.sampled_from((1, 3, 10, 40)))  # batch_size 1 takes 16 rows a chunk: 40 rows cross chunks
    return [list(ROWS[k]) for k in draw(st.lists(st.integers(0, len(ROWS) - 1), min_size=size, max_size=size))]


prompt = st.one_of(
    st.builds(lambda s, q: [INSTRUCTION, *s, q], st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=3),
              st.sampled_from(QUESTIONS)),
    st.builds(lambda s, q: " ".join([INSTRUCTION, *s, q]), st.lists(st.sampled_from(SEGMENTS), max_size=2),
              st.sampled_from(QUESTIONS)),
)


@st.composite
def prompt_calls(draw: st.DrawFn) -> list[list[str] | str]:
    pool = draw(st.lists(prompt, min_size=1, max_size=6))
    size = draw(st.sampled_from((1, 3, 10, 40)))
    return [pool[k] for k in draw(st.lists(st.integers(0, len(pool) - 1), min_size=size, max_size=size))]


def _tokens(llama: LoadedModel, text: list[str] | str) -> list[int]:
    # The word tokenizer splits on whitespace and adds no special tokens: segments joined give the same ids.
    joined = text if isinstance(text, str) else " ".join(text)
    return list(llama.tokenizer(joined)["input_ids"])


def test_every_hidden_state_of_rows_over_stored_prefixes_equals_the_plain_forward(
    llama: LoadedModel, cache: AttnCache, tally: Tally
) -> None:
    @fuzz_settings(fast_examples=25)
    @given(rows=token_calls(), on=switches)
    def check(rows: list[list[int]], on: Switches) -> None:
        on.apply(cache)
        got = cache.hidden_states(rows, batch_size=on.batch_size)
        kinds = cache.last_row_kinds
        assert len(kinds) == len(rows) and set(kinds) <= KINDS, kinds
        tally.count("hidden_states", str(on), kinds)
        for row, (ids, states, kind) in enumerate(zip(rows, got, kinds, strict=True)):
            want = _plain(llama, ids)
            assert states.shape == want.shape, (row, kind)
            if kind == "exact":
                cosine = torch.nn.functional.cosine_similarity(states, want, dim=-1).min().item()
                assert cosine >= EXACT_COSINE, f"row {row} (exact, {len(ids)} tokens): cosine {cosine:.6f}"
            else:
                gap = (states - want).abs().max().item()
                assert gap <= TOLERANCE, f"row {row} ({kind}, {len(ids)} tokens): max gap {gap:.2e}"
            earlier = rows.index(ids)
            assert torch.equal(states, got[earlier]), f"row {row} differs from its repeat {earlier}"

    check()


def test_every_choice_score_of_colliding_prompts_equals_the_plain_forward(
    llama: LoadedModel, cache: AttnCache, tally: Tally
) -> None:
    @fuzz_settings(fast_examples=25)
    @given(prompts=prompt_calls(), on=switches)
    def check(prompts: list[list[str] | str], on: Switches) -> None:
        on.apply(cache)
        scores = cache.score_choices(prompts, choices=("w10", "w11"), batch_size=on.batch_size)
        kinds = cache.last_row_kinds
        assert len(kinds) == len(prompts) and set(kinds) <= KINDS, kinds
        tally.count("score_choices", str(on), kinds)
        last = torch.stack([_plain(llama, _tokens(llama, p))[-1] for p in prompts])
        with torch.inference_mode():
            want = torch.softmax(llama.lm_head(last)[:, [10, 11]], dim=-1).numpy()  # word "wN" has id N
        gaps = abs(scores.probabilities - want).max(axis=1)
        for row, (gap, kind) in enumerate(zip(gaps, kinds, strict=True)):
            allowed = 1e-3 if kind == "exact" else TOLERANCE  # fp16 stored outputs
            assert gap <= allowed, f"row {row} ({kind}, {prompts[row]!r}): probabilities off by {gap:.2e}"

    check()
