"""One write token cannot poison what every node reads (issue 48), against the real daemon on a real LMDB store
with a tiny random Llama: prefix blocks and chunks are filed under the keys the daemon computes from their token
ids (a put under any other key is INVALID_ARGUMENT), admitted by ``--admit-after`` like rows, and recorded with
their writer; a namespace's layouts are its model's (a put of another layout is refused naming both, and the tier
goes on working), an encoder namespace takes no prefix or chunk put, and ``admin drop-writer`` removes a writer's
blocks (with the blocks chained after them) and chunks, saying how many, after which a row is the plain forward
again."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from attnstore.errors import EntryNotFoundError, FingerprintMismatchError
from attnstore.protocol.chunks import ChunkLayout, StoredChunk
from attnstore.protocol.keys import chunk_key
from attnstore.protocol.prefix import PrefixBlock, PrefixLayout, chain_hashes
from attnstore.protocol.prefix_wire import chunk_layout_to_pb, chunk_put, prefix_block_put, prefix_layout_to_pb
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.v1 import attnstore_pb2_grpc as pb_grpc
from attnstore.service import AttnStoreService
from attnstore_client.adapters import adapter_for
from attnstore_client.cache import AttnCache
from attnstore_client.call.settings import ChunkSettings
from attnstore_client.connection import connect
from attnstore_client.connection.channel import open_channel
from attnstore_client.keys import model_fingerprint
from attnstore_client.tiers.chunks.store_source import model_chunk_layout
from attnstore_client.tiers.prefix import prefix_layout_of
from attnstore_tools.admin.cold_start import create_exact_namespace
from attnstore_tools.build.namespace_layout import exact_tier_layout, token_limits
from attnstore_tools.cli import main as cli_main
from tests.support.caches import tiny_loaded
from tests.support.daemon import ADMIN_TOKEN, OTHER_WRITE_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess
from tests.support.nodes import save_tiny_llama
from tests.support.prefixes import BLOCK, SHARED_B, fill_prefix_namespace, plain_rows, prefix_rows

ROW = SHARED_B + prefix_rows([11], seed=30)[0]  # 31 tokens: two stored blocks, a third a writer may add
INSTRUCTION = np.array([5, 6, 7])


@pytest.fixture(scope="module")
def llama():
    return tiny_loaded("llama")


@pytest.fixture(scope="module")
def fingerprint(llama) -> str:
    return model_fingerprint(llama.model, llama.tokenizer)


@pytest.fixture(scope="module")
def layouts(llama) -> tuple[PrefixLayout, ChunkLayout]:
    adapter = adapter_for(llama)
    return prefix_layout_of(adapter, block_size=BLOCK), model_chunk_layout(adapter, "float32")


def _start(workdir: Path, llama, layouts, admit_after: int) -> DaemonProcess:
    """A daemon on a store whose namespace ``default`` holds SHARED_B's two blocks, with the model's layouts."""
    with AttnStoreService.open(workdir / "store", create=True) as service:
        fill_prefix_namespace(service, llama, [SHARED_B])
        service.chunks.set_layout("default", layouts[1])
    return DaemonProcess(workdir / "store", workdir, extra_args=("--admit-after", str(admit_after))).start()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, llama, layouts):
    process = _start(tmp_path_factory.mktemp("puts"), llama, layouts, admit_after=1)
    yield process
    assert process.stop() == 0, process.log()


def _random_block(layout: PrefixLayout, tokens: list[int], position: int, seed: int) -> PrefixBlock:
    """Block ``position`` of ``tokens`` with the right ids and hashes but made-up keys, values and hidden states."""
    rng = np.random.default_rng(seed)
    chain = chain_hashes(tokens, layout.block_size)
    size = layout.block_size
    return PrefixBlock(chain[position], chain[position - 1] if position else None,
                       rng.standard_normal((layout.layers, *layout.layer_shape)).astype(layout.dtype) * 3,
                       rng.standard_normal((size, layout.hidden)).astype(layout.dtype) * 3,
                       np.array(tokens[position * size : (position + 1) * size]))


def _random_chunk(layout: ChunkLayout, ids: np.ndarray, seed: int) -> StoredChunk:
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((layout.layers, *layout.layer_shape(len(ids)))).astype(layout.dtype)
    return StoredChunk(chunk_key(INSTRUCTION, ids), kv, token_ids=ids, context_ids=INSTRUCTION)


def _stub(daemon: DaemonProcess) -> pb_grpc.AttnStoreStub:
    return pb_grpc.AttnStoreStub(open_channel(daemon.target))


def _refused(call, request, token: str = WRITE_TOKEN) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as failed:
        call(request, metadata=[("authorization", f"Bearer {token}")])
    return failed.value


def _served(llama, daemon: DaemonProcess, rows: list[list[int]]) -> tuple[list[torch.Tensor], tuple[str, ...]]:
    """``rows`` as a fresh reading node serves them from the daemon's prefix blocks."""
    with AttnCache(llama, f"grpc://{daemon.target}", token=READ_TOKEN, exact=False, prefix_min_tokens=BLOCK) as node:
        return node.hidden_states(rows), node.last_row_kinds


def test_prefix_and_chunk_puts_under_keys_the_daemon_did_not_compute_are_invalid_argument(
    daemon, fingerprint, layouts
):
    prefix, chunks = layouts
    third = _random_block(prefix, ROW, 2, seed=1)
    other = chain_hashes([9] * 3 * BLOCK, BLOCK)[2]
    stub = _stub(daemon)

    def put_prefix(message: pb.PrefixBlockPut) -> pb.PutPrefixRequest:
        return pb.PutPrefixRequest(namespace="default", fingerprint=fingerprint, layout=prefix_layout_to_pb(prefix),
                                   blocks=[message])

    error = _refused(stub.PutPrefix, put_prefix(prefix_block_put(dataclasses.replace(third, chain_hash=other))))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert other.hex() in error.details() and third.chain_hash.hex() in error.details()
    error = _refused(stub.PutPrefix, put_prefix(prefix_block_put(dataclasses.replace(third, token_ids=None))))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "carries no token ids" in error.details()
    # The right ids of block 2 under block 1's parent: their hash is not the one sent.
    error = _refused(stub.PutPrefix, put_prefix(prefix_block_put(dataclasses.replace(third, parent=None))))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "not the one its token ids give" in error.details()

    chunk = _random_chunk(chunks, np.array([11, 12, 13, 14]), seed=2)
    forged = pb.PutChunksRequest(namespace="default", fingerprint=fingerprint, layout=chunk_layout_to_pb(chunks),
                                 chunks=[chunk_put(dataclasses.replace(chunk, key=chunk_key(None, [1, 2])))])
    error = _refused(stub.PutChunks, forged)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "not the one its token ids give" in error.details()
    with connect(f"grpc://{daemon.target}", token=READ_TOKEN) as reader:
        assert reader.match_prefix("default", fingerprint, BLOCK, [chain_hashes(ROW, BLOCK)], timeout=10) == [2]
        assert reader.match_chunks("default", fingerprint, chunks, [chunk.key, chunk_key(None, [1, 2])],
                                   timeout=10) == [None, None]


def test_a_put_of_another_layout_is_refused_naming_both_and_the_prefix_tier_keeps_working(
    daemon, llama, fingerprint, layouts
):
    made_up = PrefixLayout(block_size=1, layers=1, kv_heads=1, head_dim=1, hidden=1, dtype="float32")
    tiny_chunks = ChunkLayout(layers=1, kv_heads=1, head_dim=1, dtype="float32")
    with connect(f"grpc://{daemon.target}", token=WRITE_TOKEN) as writer:
        with pytest.raises(FingerprintMismatchError, match=r"block_size=8.*block_size=1"):
            writer.put_prefix("default", fingerprint, made_up, [_random_block(made_up, ROW, 0, seed=3)], timeout=10)
        with pytest.raises(FingerprintMismatchError, match=r"layers=\d+.*layers=1"):
            writer.put_chunks("default", fingerprint, tiny_chunks,
                              [_random_chunk(tiny_chunks, np.array([3]), seed=4)], timeout=10)
        assert writer.namespace("default").prefix == layouts[0]
        assert writer.namespace("default").chunks == layouts[1]
    hidden, kinds = _served(llama, daemon, [ROW])
    assert kinds == ("prefix",)
    assert torch.allclose(hidden[0], plain_rows(llama, [ROW])[0], atol=2e-5)


def test_an_encoder_namespace_refuses_prefix_and_chunk_puts(daemon, fingerprint, layouts):
    bert = tiny_loaded("bert")
    bert_fp = model_fingerprint(bert.model, bert.tokenizer)
    adapter = adapter_for(bert)
    prefix = PrefixLayout(BLOCK, adapter.num_layers, adapter.num_heads, adapter.head_dim, adapter.hidden_size,
                          "float32")
    chunks = ChunkLayout(adapter.num_layers, adapter.num_heads, adapter.head_dim, "float32")
    with daemon.client(ADMIN_TOKEN) as admin:
        info = create_exact_namespace(admin, bert, "encoder")
        assert not info.HasField("prefix") and not info.HasField("chunks")  # the model's: none
    for token in (WRITE_TOKEN, ADMIN_TOKEN):
        with connect(f"grpc://{daemon.target}", token=token) as writer:
            with pytest.raises(FingerprintMismatchError, match="bidirectional"):
                writer.put_prefix("encoder", bert_fp, prefix, [_random_block(prefix, ROW, 0, seed=5)], timeout=10)
            with pytest.raises(FingerprintMismatchError, match="bidirectional"):
                writer.put_chunks("encoder", bert_fp, chunks, [_random_chunk(chunks, np.array([3, 4]), seed=6)],
                                  timeout=10)
            assert writer.namespace("encoder").prefix is None and writer.namespace("encoder").chunks is None


def test_drop_writer_removes_a_writers_prefix_blocks_and_chunks_and_the_next_lookup_is_the_plain_forward(
    daemon, llama, fingerprint, layouts, capsys
):
    prefix, chunks = layouts
    chain = chain_hashes(ROW, BLOCK)
    poison = _random_chunk(chunks, np.array([20, 21, 22]), seed=7)
    with connect(f"grpc://{daemon.target}", token=WRITE_TOKEN) as writer:  # node-a, compromised
        assert writer.match_prefix("default", fingerprint, BLOCK, [chain], timeout=10) == [2]  # asks: admitted
        counts = writer.put_prefix("default", fingerprint, prefix, [_random_block(prefix, ROW, 2, seed=8)],
                                   timeout=10)
        assert (counts.stored, counts.not_admitted) == (1, 0)
        assert writer.match_chunks("default", fingerprint, chunks, [poison.key], timeout=10) == [None]
        assert writer.put_chunks("default", fingerprint, chunks, [poison], timeout=10).stored == 1
    with connect(f"grpc://{daemon.target}", token=OTHER_WRITE_TOKEN) as other:  # node-b builds on the bad block
        longer = ROW + prefix_rows([9], seed=31)[0]
        assert other.match_prefix("default", fingerprint, BLOCK, [chain_hashes(longer, BLOCK)], timeout=10) == [3]
        assert other.put_prefix("default", fingerprint, prefix, [_random_block(prefix, longer, 3, seed=9)],
                                timeout=10).stored == 1
    plain = plain_rows(llama, [ROW])[0]
    hidden, kinds = _served(llama, daemon, [ROW])
    assert kinds == ("prefix",) and not torch.allclose(hidden[0], plain, atol=1e-3)  # poisoned
    base = ["admin", "drop-writer", "--target", daemon.target, "--token-file", str(daemon.token_file),
            "--namespace", "default", "--writer", "node-a", "--json", "-"]
    assert cli_main([*base, "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out) | {} == {"namespace": "default", "writer": "node-a", "found": 0,
                                                          "deleted": 0, "prefix_blocks": 2, "chunks": 1,
                                                          "dry_run": True}
    assert cli_main(base) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["prefix_blocks"], report["chunks"]) == (2, 1)  # its block, node-b's after it; its chunk
    hidden, kinds = _served(llama, daemon, [ROW])
    assert torch.allclose(hidden[0], plain, atol=2e-5)  # the honest blocks only: the plain forward again
    with connect(f"grpc://{daemon.target}", token=READ_TOKEN) as reader:
        assert reader.match_prefix("default", fingerprint, BLOCK, [chain], timeout=10) == [2]
        (gone,) = reader.fetch_chunks("default", fingerprint, chunks, [poison.key], timeout=10)
        assert isinstance(gone, EntryNotFoundError)
    assert "event=writer_dropped namespace=default writer=node-a prefix_blocks=2 chunks=1" in daemon.log()


def test_with_admit_after_2_one_writer_cannot_store_a_block_or_chunk_nobody_else_asked_for(
    tmp_path, llama, fingerprint, layouts
):
    prefix, chunks = layouts
    process = _start(tmp_path, llama, layouts, admit_after=2)
    try:
        chain = chain_hashes(ROW, BLOCK)
        block = _random_block(prefix, ROW, 2, seed=10)
        chunk = _random_chunk(chunks, np.array([30, 31]), seed=11)
        for token in (WRITE_TOKEN, WRITE_TOKEN, READ_TOKEN):  # itself twice, and a read token: one writer
            with connect(f"grpc://{process.target}", token=token) as asking:
                asking.match_prefix("default", fingerprint, BLOCK, [chain], timeout=10)
                asking.match_chunks("default", fingerprint, chunks, [chunk.key], timeout=10)
        with connect(f"grpc://{process.target}", token=WRITE_TOKEN) as writer:
            counts = writer.put_prefix("default", fingerprint, prefix, [block], timeout=10)
            assert (counts.stored, counts.not_admitted) == (0, 1)
            assert writer.put_chunks("default", fingerprint, chunks, [chunk], timeout=10).not_admitted == 1
            assert writer.match_prefix("default", fingerprint, BLOCK, [chain], timeout=10) == [2]
        with connect(f"grpc://{process.target}", token=OTHER_WRITE_TOKEN) as other:  # a second writer asks
            other.match_prefix("default", fingerprint, BLOCK, [chain], timeout=10)
            other.match_chunks("default", fingerprint, chunks, [chunk.key], timeout=10)
        with connect(f"grpc://{process.target}", token=WRITE_TOKEN) as writer:
            assert writer.put_prefix("default", fingerprint, prefix, [block], timeout=10).stored == 1
            assert writer.put_chunks("default", fingerprint, chunks, [chunk], timeout=10).stored == 1
    finally:
        assert process.stop() == 0, process.log()


def test_admin_create_namespace_records_the_models_layouts_as_asked_and_keeps_recorded_ones(daemon, tmp_path, capsys):
    folder = tmp_path / "model"
    save_tiny_llama(folder)
    base = ["admin", "create-namespace", "--target", daemon.target, "--token-file", str(daemon.token_file),
            "--model", str(folder), "--namespace", "made"]
    assert cli_main([*base, "--prefix-block-size", "16", "--chunk-dtype", "float32"]) == 0
    with daemon.client(ADMIN_TOKEN) as admin:
        made = admin.get_namespace("made", projector=False)
    assert (made.prefix.block_size, made.prefix.layers, made.chunks.dtype) == (16, made.layout.layers, "float32")
    assert cli_main(base) == 0  # the defaults (32, float16) again: what the namespace records is kept
    with daemon.client(ADMIN_TOKEN) as admin:
        again = admin.get_namespace("made", projector=False)
    assert (again.prefix, again.chunks) == (made.prefix, made.chunks)
    capsys.readouterr()


def test_a_writer_node_sends_no_prefix_block_or_chunk_to_a_namespace_that_records_no_layout(daemon, llama):
    seen = len(daemon.log())  # the other tests' refusals come before
    with daemon.client(ADMIN_TOKEN) as admin:  # created without the model's layouts (as before they were recorded)
        admin.create_namespace("bare", model=llama.name, fingerprint=model_fingerprint(llama.model, llama.tokenizer),
                               layout=exact_tier_layout(llama), limits=token_limits(llama))
    chunked = ChunkSettings(method="a3", ratio=1.0, recent=0, dtype="float32")
    with AttnCache(llama, f"grpc://{daemon.target}", "bare", token=WRITE_TOKEN, write_back=True, exact=False,
                   prefix_min_tokens=BLOCK, chunks=chunked) as node:
        hidden = node.hidden_states(prefix_rows([3, 5], seed=40, prefix=ROW))  # a shared prefix, computed once
        node.score_choices([["w2 w3 w4", "w20 w21 w22", "w7 w8"]], choices=("w10", "w11"))
        assert node.last_stats.chunks_captured == 2  # the instruction and the chunk, computed here
        stats = node.chunk_source.writer_stats()
        assert stats is not None and (stats.queued, stats.refused) == (0, 0)
    for got, want in zip(hidden, plain_rows(llama, prefix_rows([3, 5], seed=40, prefix=ROW)), strict=True):
        assert torch.allclose(got, want, atol=2e-5)
    log = daemon.log()[seen:]
    assert "namespace=bare" in log  # the namespace was made ...
    assert "method=PutPrefix" not in log and "method=PutChunks" not in log  # ... and no put was refused
    assert "event=prefix_put namespace=bare" not in log and "event=chunks_put namespace=bare" not in log
