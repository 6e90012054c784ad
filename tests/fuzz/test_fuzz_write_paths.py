"""Differential fuzz of what nodes write for each other: prefix blocks and chunks one node computed and wrote back,
read by another.

Two writer nodes (each its own write token, write-back on) and a reader node (a read token) share a real daemon on a
real LMDB store with ``--admit-after 2``: a prefix block or a chunk is stored once both writers computed it, keyed by
the daemon from its tokens. Calls drawn at random (hypothesis) go to any of the three, ``hidden_states`` over token
rows that share prefixes and ``score_choices`` over prompts in segments (the chunk tier, every chunk token
recomputed), with the exact tiers, the prefix tier and the chunk tier on or off; every row equals the plain
transformers forward of that row alone, whichever node computed or wrote what it was served. One writer audits
everything it is served (``audit_rate=1.0``): nothing honest nodes wrote is ever reported or quarantined.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from fuzz_harness import Tally, fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from attnstore.protocol.prefix import DEFAULT_BLOCK_SIZE, chain_hashes
from attnstore_client.cache import AttnCache
from attnstore_client.call.settings import ChunkSettings
from attnstore_client.connection import connect
from attnstore_client.keys import model_fingerprint
from attnstore_client.models import LoadedModel
from attnstore_tools.build.namespace_layout import exact_tier_layout, kv_layouts, token_limits
from tests.support.caches import tiny_loaded
from tests.support.daemon import ADMIN_TOKEN, OTHER_WRITE_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess
from tests.support.prefixes import prefix_rows
from tests.support.wait import wait_until

TOLERANCE = 1e-4  # fp32 prefix keys and values, chunks recomputed in full
EXACT_COSINE = 0.9999  # exact hits: stored outputs are fp16
KINDS = {"exact", "prefix", "chunk", "miss", "fallback"}
EVERY_CHUNK_TOKEN = ChunkSettings(method="a3", ratio=1.0, recent=0, dtype="float32")
NODES = ("writer a", "writer b", "reader")
# Prefixes of two whole default blocks and more: rows of a call that share one compute it once and write it back.
PREFIXES = [prefix_rows([2 * DEFAULT_BLOCK_SIZE + 3], seed=40 + k)[0] for k in range(3)]
INSTRUCTION = "w2 w3 w4 w5 w6"
SEGMENTS = ("w20 w21 w22 w23 w24 w25", "w30 w31 w32", "w40 w41 W42 w43", "w50  w51 w52 w53")
QUESTIONS = ("w7 w8", "w9", "W7 w9 w8")


@pytest.fixture(scope="module")
def llama() -> LoadedModel:
    return tiny_loaded("llama")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, llama: LoadedModel) -> Iterator[DaemonProcess]:
    workdir = tmp_path_factory.mktemp("fuzz-write-paths")
    process = DaemonProcess(workdir / "store", workdir, extra_args=("--admit-after", "2")).start()
    prefix, chunks = kv_layouts(llama, chunk_dtype="float32")  # the model's layouts, chunks kept in fp32
    with process.client(ADMIN_TOKEN) as admin:  # no stored prefix or chunk yet
        admin.create_namespace("default", model=llama.name, fingerprint=model_fingerprint(llama.model, llama.tokenizer),
                               layout=exact_tier_layout(llama), limits=token_limits(llama), prefix=prefix,
                               chunks=chunks)
    yield process
    assert process.stop() == 0, process.log()


@pytest.fixture(scope="module")
def nodes(daemon: DaemonProcess, llama: LoadedModel) -> Iterator[dict[str, AttnCache]]:
    """The three nodes, once both writers have computed, and so stored, every shared prefix and every chunk: the
    calls drawn then read what the other nodes wrote (and write more)."""
    url, options = f"grpc://{daemon.target}", {"prefix_min_tokens": 16}
    opened = {
        "writer a": AttnCache(llama, url, token=WRITE_TOKEN, write_back=True, **options),
        # It audits every stored row, prefix block and chunk it is served: none of what honest nodes wrote is wrong.
        "writer b": AttnCache(llama, url, token=OTHER_WRITE_TOKEN, write_back=True, audit_rate=1.0, **options),
        "reader": AttnCache(llama, url, token=READ_TOKEN, **options),
    }
    every_chunk = [[INSTRUCTION, segment, QUESTIONS[0]] for segment in SEGMENTS]
    for name in ("writer a", "writer b"):
        writer = opened[name]
        writer.exact, writer.chunks = False, EVERY_CHUNK_TOKEN
        for prefix in PREFIXES:
            writer.hidden_states(prefix_rows([2, 3], seed=1, prefix=prefix))
        writer.score_choices(every_chunk, choices=("w10", "w11"))
    fingerprint = model_fingerprint(llama.model, llama.tokenizer)
    chains = [chain_hashes(prefix, DEFAULT_BLOCK_SIZE) for prefix in PREFIXES]
    with connect(url, token=READ_TOKEN) as connection:  # they land off the calls' path
        wait_until(lambda: connection.match_prefix("default", fingerprint, DEFAULT_BLOCK_SIZE, chains,
                                                   timeout=10) == [2] * 3,
                   60, "the prefixes both writers computed stored", poll=0.1)

    def every_chunk_stored() -> bool:  # a new reader computes no chunk
        with AttnCache(llama, url, token=READ_TOKEN, exact=False, chunks=EVERY_CHUNK_TOKEN) as fresh:
            fresh.score_choices(every_chunk, choices=("w10", "w11"))
            return fresh.last_stats.chunks_captured == 0

    wait_until(every_chunk_stored, 60, "the chunks both writers computed stored", poll=0.1)
    yield opened
    for cache in opened.values():
        cache.close()


def _plain(llama: LoadedModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return llama.model(input_ids=torch.tensor([ids])).last_hidden_state[0]


def _tokens(llama: LoadedModel, text: list[str] | str) -> list[int]:
    # The word tokenizer splits on whitespace and adds no special tokens: segments joined give the same ids.
    return list(llama.tokenizer(text if isinstance(text, str) else " ".join(text))["input_ids"])


@dataclass(frozen=True)
class Switches:
    node: str
    exact: bool
    prefix: bool
    chunks: bool
    packed: bool
    batch_size: int

    def apply(self, cache: AttnCache) -> None:
        cache.exact, cache.prefix, cache.packed = self.exact, self.prefix, self.packed
        cache.chunks = EVERY_CHUNK_TOKEN if self.chunks else None


switches = st.builds(Switches, node=st.sampled_from(NODES), exact=st.booleans(), prefix=st.booleans(),
                     chunks=st.booleans(), packed=st.booleans(), batch_size=st.sampled_from((1, 4, 32)))


@st.composite
def token_calls(draw: st.DrawFn) -> list[list[int]]:
    """Rows over the shared prefixes (several per prefix, so a call shares them), some over none."""
    rows = []
    for _ in range(draw(st.integers(1, 8))):
        prefix = draw(st.sampled_from([*PREFIXES, []]))
        rows += prefix_rows([draw(st.integers(1, 6))], seed=draw(st.integers(0, 3)), prefix=prefix)
    return rows


prompts = st.lists(st.builds(lambda s, q: [INSTRUCTION, *s, q],
                             st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=3),
                             st.sampled_from(QUESTIONS)), min_size=1, max_size=6)


def test_every_row_served_from_what_another_node_wrote_equals_the_plain_forward(
    llama: LoadedModel, daemon: DaemonProcess, nodes: dict[str, AttnCache], tally: Tally
) -> None:
    @fuzz_settings(fast_examples=12)
    @given(rows=token_calls(), texts=prompts, on=switches)
    def check(rows: list[list[int]], texts: list[list[str]], on: Switches) -> None:
        cache = nodes[on.node]
        on.apply(cache)
        got = cache.hidden_states(rows, batch_size=on.batch_size)
        kinds = cache.last_row_kinds
        assert len(kinds) == len(rows) and set(kinds) <= KINDS, kinds
        for row, (ids, states, kind) in enumerate(zip(rows, got, kinds, strict=True)):
            want = _plain(llama, ids)
            if kind == "exact":
                cosine = torch.nn.functional.cosine_similarity(states, want, dim=-1).min().item()
                assert cosine >= EXACT_COSINE, f"{on}: row {row} (exact): cosine {cosine:.6f}"
            else:
                gap = (states - want).abs().max().item()
                assert gap <= TOLERANCE, f"{on}: row {row} ({kind}, {len(ids)} tokens): max gap {gap:.2e}"
        tally.count("write paths, hidden_states", str(on), kinds)
        scores = cache.score_choices(texts, choices=("w10", "w11"), batch_size=on.batch_size)
        kinds = cache.last_row_kinds
        last = torch.stack([_plain(llama, _tokens(llama, text))[-1] for text in texts])
        with torch.inference_mode():
            want = torch.softmax(llama.lm_head(last)[:, [10, 11]], dim=-1).numpy()  # word "wN" has id N
        for row, (gap, kind) in enumerate(zip(abs(scores.probabilities - want).max(axis=1), kinds, strict=True)):
            allowed = 1e-3 if kind == "exact" else TOLERANCE  # fp16 stored outputs
            assert gap <= allowed, f"{on}: row {row} ({kind}, {texts[row]!r}): probabilities off by {gap:.2e}"
        tally.count("write paths, score_choices", str(on), kinds)

    check()
    assert nodes["writer b"].audit_findings == ()
    with daemon.client(ADMIN_TOKEN) as admin:
        assert admin.list_quarantine() == []


def test_a_prefix_both_writers_computed_is_stored_once_and_serves_the_reader_exactly(
    llama: LoadedModel, daemon: DaemonProcess, nodes: dict[str, AttnCache]
) -> None:
    shared = prefix_rows([2 * DEFAULT_BLOCK_SIZE + 1], seed=77)[0]  # no other test's prefix
    for name in ("writer a", "writer b"):
        nodes[name].exact, nodes[name].prefix = False, True
        nodes[name].hidden_states(prefix_rows([3, 5], seed=3, prefix=shared))
    fingerprint = model_fingerprint(llama.model, llama.tokenizer)
    with connect(f"grpc://{daemon.target}", token=READ_TOKEN) as connection:  # it lands off the calls' path
        wait_until(lambda: connection.match_prefix("default", fingerprint, DEFAULT_BLOCK_SIZE,
                                                   [chain_hashes(shared, DEFAULT_BLOCK_SIZE)], timeout=10) == [2],
                   30, "the prefix both writers computed stored", poll=0.1)
    reader = nodes["reader"]
    reader.exact, reader.prefix = False, True
    rows = prefix_rows([2, 4], seed=9, prefix=shared)
    got = reader.hidden_states(rows)
    assert reader.last_row_kinds == ("prefix", "prefix")
    for states, ids in zip(got, rows, strict=True):
        assert (states - _plain(llama, ids)).abs().max().item() <= TOLERANCE
