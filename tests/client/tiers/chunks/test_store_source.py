"""``StoreChunkSource`` inside AttnCache: chunks built into a real LMDB store (embedded) or put by write-back into a
real daemon are served to chunked calls; another chunk layout is refused; a damaged chunk sends its prompt to the
other tiers, computed in full and counted as a fallback; a chunk a write token poisoned changes chunked calls until
``admin drop-writer`` removes it (tiny local decoder)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from attnstore.errors import FingerprintMismatchError
from attnstore.protocol.chunks import StoredChunk
from attnstore.service import AttnStoreService
from attnstore_client.adapters import adapter_for
from attnstore_client.cache import AttnCache
from attnstore_client.call.settings import ChunkSettings
from attnstore_client.call.sources import segment_tokens
from attnstore_client.connection import connect
from attnstore_client.keys import model_fingerprint
from attnstore_client.models import load_model
from attnstore_client.tiers.chunks.source import MemoryChunkSource, chunk_key
from attnstore_client.tiers.chunks.store_source import StoreChunkSource, model_chunk_layout
from attnstore_tools.build.chunks import ChunkBuildConfig, build_chunks_into
from attnstore_tools.build.namespace_layout import exact_tier_layout, token_limits
from attnstore_tools.cli import main as cli_main
from tests.support.adapters import save_tiny_decoder
from tests.support.chunks import damage_chunk
from tests.support.daemon import READ_TOKEN, WRITE_TOKEN, DaemonProcess

INSTRUCTION = "classify the sentiment of each review"
CHUNKS = ["the river was cold and the stone was grey", "good light over the north field",
          "a bad cloud", "alpha beta gamma delta river stone light north"]
PROMPTS = [
    [INSTRUCTION, CHUNKS[0], CHUNKS[1], "is it good"],
    [INSTRUCTION, CHUNKS[2], CHUNKS[0], CHUNKS[3], "bad"],
    [INSTRUCTION, CHUNKS[1], CHUNKS[3], "is the field good or bad"],
]
EXACT = ChunkSettings(method="a3", ratio=1.0, recent=0, dtype="float32")


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    folder = save_tiny_decoder(tmp_path_factory.mktemp("tiny") / "model", full_vocab=True)
    return load_model(str(folder))


@pytest.fixture(scope="module")
def built(decoder, tmp_path_factory):
    store = tmp_path_factory.mktemp("built") / "store"
    build_chunks_into(decoder, CHUNKS, str(store), ChunkBuildConfig(instruction=INSTRUCTION, dtype="float32"),
                      progress=False)
    return store


@pytest.fixture(scope="module")
def full(decoder, built):
    """Each prompt's last state from the plain model (the same segment tokens, computed in full)."""
    with AttnCache(decoder, f"local:{built}", exact=False) as plain:
        states = plain.last_hidden_states(PROMPTS)
        assert plain.last_row_kinds == ("miss",) * 3
    return states


def _tokens(decoder) -> tuple[int, int]:
    """Tokens of the instruction (with the tokenizer's lead), and of every prompt's chunks together."""
    rows = segment_tokens(decoder.tokenizer, PROMPTS, max_length=512)
    return rows[0].segments[0], sum(sum(row.segments[1:-1]) for row in rows)


def test_chunks_built_into_the_store_serve_a_chunked_call_without_computing_them_and_equal_full_prefill(
    decoder, built, full,
):
    with AttnCache(decoder, f"local:{built}", exact=False, chunks=EXACT) as cache:
        assert isinstance(cache.chunk_source, StoreChunkSource) and cache.chunk_source.layout is not None
        got = cache.last_hidden_states(PROMPTS)
        stats = cache.last_stats
        instruction, chunk_tokens = _tokens(decoder)
        assert cache.last_row_kinds == ("chunk",) * 3 and stats.chunks_captured == 0
        assert stats.chunk_tokens == 3 * instruction + chunk_tokens and stats.bytes_fetched > 0
        assert torch.allclose(got, full, atol=1e-4)
        front = cache.chunk_source.front
        before = front.stats()
        cache.last_hidden_states(PROMPTS)  # from this process's own cache now: the store is not asked
        after = front.stats()
        assert (after.hits - before.hits, after.misses - before.misses, after.entries) == (5, 0, 5)


def test_a_namespace_of_another_chunk_dtype_is_refused_naming_both(decoder, built):
    with AttnCache(decoder, f"local:{built}", exact=False, chunks=ChunkSettings(dtype="float16")) as cache:
        with pytest.raises(FingerprintMismatchError, match="dtype='float32'.*dtype='float16'"):
            cache.last_hidden_states(PROMPTS)


def test_a_damaged_chunk_leaves_its_prompts_to_the_other_tiers_computed_in_full_and_counted_as_fallbacks(
    decoder, built, full, tmp_path,
):
    store = tmp_path / "store"
    shutil.copytree(built, store)
    rows = segment_tokens(decoder.tokenizer, PROMPTS, max_length=512)
    instruction = rows[0].ids[: rows[0].segments[0]]
    start = rows[0].segments[0]
    damaged = chunk_key(instruction, rows[2].ids[start + rows[2].segments[1] : start + sum(rows[2].segments[1:3])])
    damage_chunk(store, "default", damaged, layer=1)  # CHUNKS[3]: prompts 1 and 2
    with AttnCache(decoder, f"local:{store}", exact=False, chunks=EXACT) as cache:
        got = cache.last_hidden_states(PROMPTS)
        assert cache.last_row_kinds == ("chunk", "fallback", "fallback")
        assert dict(cache.last_stats.fallbacks) == {"checksum": 2} and cache.last_stats.chunks_captured == 0
        assert torch.allclose(got, full, atol=1e-4)
    with AttnStoreService.open(store) as service:
        report = service.store.verify()
    assert [(c.namespace, c.key) for c in report.chunks.corrupt] == [("default", damaged.hex())]


def test_chunks_a_node_computed_are_written_back_and_a_fresh_cache_finds_them(decoder, full, tmp_path):
    fingerprint = model_fingerprint(decoder.model, decoder.tokenizer)
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        service.create_namespace("default", model=decoder.name, fingerprint=fingerprint,
                                 layout=exact_tier_layout(decoder), limits=token_limits(decoder))
        service.chunks.set_layout("default", model_chunk_layout(adapter_for(decoder), "float32"))  # the model's
    # One writer's asks (its FetchChunks of chunks not stored) admit its chunks.
    daemon = DaemonProcess(tmp_path / "store", tmp_path, extra_args=("--admit-after", "1")).start()
    try:
        url = f"grpc://{daemon.target}"
        with AttnCache(decoder, url, token=WRITE_TOKEN, write_back=True, exact=False, chunks=EXACT) as node:
            first = node.last_hidden_states(PROMPTS)
            assert node.last_stats.chunks_captured == 1 + len(CHUNKS)
            source = node.chunk_source
            assert isinstance(source, StoreChunkSource) and source.flush(10)
            written = source.writer_stats()
            assert written is not None and (written.stored, written.refused, written.dropped_failed) == (5, 0, 0)
        with AttnCache(decoder, url, token=READ_TOKEN, exact=False, chunks=EXACT) as other:
            again = other.last_hidden_states(PROMPTS)
            assert other.last_row_kinds == ("chunk",) * 3 and other.last_stats.chunks_captured == 0
            assert other.chunk_source.writer_stats() is None  # no write-back asked: nothing is sent
        assert torch.allclose(first, full, atol=1e-4) and torch.allclose(again, full, atol=1e-4)
        with AttnCache(decoder, url, token=READ_TOKEN, exact=False, chunks=EXACT,
                       chunk_source=MemoryChunkSource()) as local_only:
            local_only.last_hidden_states(PROMPTS)
            assert local_only.last_stats.chunks_captured == 1 + len(CHUNKS)  # a source of its own: the store unused
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_a_store_holding_no_chunks_is_a_miss_for_every_chunk_and_computes_them_in_place(decoder, full, tmp_path):
    fingerprint = model_fingerprint(decoder.model, decoder.tokenizer)
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        service.create_namespace("default", model=decoder.name, fingerprint=fingerprint,
                                 layout=exact_tier_layout(decoder), limits=token_limits(decoder))
    with AttnCache(decoder, f"local:{tmp_path / 'store'}", exact=False, chunks=EXACT) as cache:
        got = cache.last_hidden_states(PROMPTS)
        assert cache.chunk_source.layout is None and cache.last_stats.chunks_captured == 1 + len(CHUNKS)
        assert torch.allclose(got, full, atol=1e-4)
    assert np.isfinite(got.numpy()).all()


def test_a_chunk_a_writer_poisoned_changes_chunked_calls_until_drop_writer_removes_it(decoder, tmp_path, capsys):
    reuse = ChunkSettings(method="full_reuse", recent=0, dtype="float32")  # stored keys and values used as they are
    fingerprint = model_fingerprint(decoder.model, decoder.tokenizer)
    layout = model_chunk_layout(adapter_for(decoder), "float32")
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        service.create_namespace("default", model=decoder.name, fingerprint=fingerprint,
                                 layout=exact_tier_layout(decoder), limits=token_limits(decoder))
        service.chunks.set_layout("default", layout)
    daemon = DaemonProcess(tmp_path / "store", tmp_path, extra_args=("--admit-after", "1")).start()
    try:
        url = f"grpc://{daemon.target}"
        with AttnCache(decoder, url, token=READ_TOKEN, exact=False, chunks=reuse,
                       chunk_source=MemoryChunkSource()) as local_only:
            honest = local_only.last_hidden_states(PROMPTS)  # every chunk computed here
        row = segment_tokens(decoder.tokenizer, PROMPTS, max_length=512)[0]
        first, second = row.segments[0], row.segments[1]
        instruction, ids = list(row.ids[:first]), list(row.ids[first : first + second])  # PROMPTS[0]'s first chunk
        key = chunk_key(instruction, ids)
        kv = np.random.default_rng(0).standard_normal((layout.layers, *layout.layer_shape(len(ids)))) * 3
        with connect(url, token=WRITE_TOKEN) as writer:  # node-a asks (admitted: --admit-after 1), then poisons
            assert writer.match_chunks("default", fingerprint, layout, [key], timeout=10) == [None]
            poison = StoredChunk(key, kv.astype(np.float32), token_ids=np.array(ids), context_ids=np.array(instruction))
            assert writer.put_chunks("default", fingerprint, layout, [poison], timeout=10).stored == 1
        with AttnCache(decoder, url, token=READ_TOKEN, exact=False, chunks=reuse) as reader:
            poisoned = reader.last_hidden_states(PROMPTS)
        assert not torch.allclose(poisoned[0], honest[0], atol=1e-3)
        assert cli_main(["admin", "drop-writer", "--target", daemon.target, "--token-file", str(daemon.token_file),
                         "--namespace", "default", "--writer", "node-a", "--json", "-"]) == 0
        assert json.loads(capsys.readouterr().out)["chunks"] == 1
        with AttnCache(decoder, url, token=READ_TOKEN, exact=False, chunks=reuse) as reader:
            again = reader.last_hidden_states(PROMPTS)
        assert torch.allclose(again, honest, atol=1e-5)
    finally:
        assert daemon.stop() == 0, daemon.log()
