"""The prefix tier through the real daemon: a corrupt block is named by its place in the chain and cuts the
chain there for later matches; a chain is never served from a later block without its parents; PutPrefix needs a
write token, lets only an admin record a namespace's missing layout (the model's), refuses another one naming both
and a block damaged on the way (DATA_LOSS), storing nothing, and counts duplicates (tests/server/test_server_puts.py
has the hashes, admission, encoders and drop-writer)."""

from __future__ import annotations

import urllib.request

import grpc
import numpy as np
import pytest

from attnstore.errors import AuthError, FingerprintMismatchError
from attnstore.protocol.prefix import PrefixBlock, PrefixLayout, chain_hashes
from attnstore.protocol.prefix_wire import prefix_block_put, prefix_layout_to_pb
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.v1 import attnstore_pb2_grpc as pb_grpc
from attnstore.store import LmdbMapStore
from attnstore.store.lmdb.prefix_blocks import part_key
from attnstore_client.connection import connect
from attnstore_client.connection.channel import open_channel
from tests.support.daemon import ADMIN_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess
from tests.support.stores import small_layout

FP = "f" * 64
LAYOUT = PrefixLayout(block_size=4, layers=3, kv_heads=2, head_dim=5, hidden=8, dtype="float32")  # small_layout's
HASHES = chain_hashes(list(range(16)), LAYOUT.block_size)  # four blocks
NEW_TOKENS = list(range(100, 112))
NEW = chain_hashes(NEW_TOKENS, LAYOUT.block_size)  # three blocks no store holds


def _blocks(tokens: list[int], layout: PrefixLayout = LAYOUT) -> list[PrefixBlock]:
    chain = chain_hashes(tokens, layout.block_size)
    rng = np.random.default_rng(len(chain))
    size = layout.block_size
    return [PrefixBlock(h, chain[i - 1] if i else None,
                        rng.standard_normal((layout.layers, *layout.layer_shape)).astype(layout.dtype),
                        rng.standard_normal((layout.block_size, layout.hidden)).astype(layout.dtype),
                        np.array(tokens[i * size : (i + 1) * size]))
            for i, h in enumerate(chain)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("prefix")
    rng = np.random.default_rng(0)
    with LmdbMapStore.open(workdir / "store", create=True) as store:
        store.create_namespace("ns", model="tiny", fingerprint=FP, layout=small_layout())
        store.create_namespace("blank", model="tiny", fingerprint=FP, layout=small_layout())
        store.prefixes.set_layout("ns", LAYOUT)
        store.prefixes.put("ns", [
            PrefixBlock(h, HASHES[i - 1] if i else None,
                        rng.standard_normal((LAYOUT.layers, *LAYOUT.layer_shape)).astype(np.float32),
                        rng.standard_normal((LAYOUT.block_size, LAYOUT.hidden)).astype(np.float32))
            for i, h in enumerate(HASHES)
        ])
        with store._live.write() as (gen, txn):  # bit rot in the third block's layer 2
            key = part_key("ns", HASHES[2], 2)
            raw = bytearray(txn.get(key, db=gen.db.prefix))
            raw[0] ^= 0xFF
            txn.put(key, bytes(raw), db=gen.db.prefix)
    process = DaemonProcess(workdir / "store", workdir, extra_args=("--admit-after", "1")).start()
    yield process
    assert process.stop() == 0, process.log()


def _stub(daemon: DaemonProcess) -> pb_grpc.AttnStoreStub:
    return pb_grpc.AttnStoreStub(open_channel(daemon.target))


def _match(daemon: DaemonProcess, chain: list[bytes]) -> int:
    request = pb.PrefixMatchRequest(namespace="ns", fingerprint=FP, block_size=4,
                                    rows=[pb.PrefixChain(chain_hashes=chain)])
    (blocks,) = _stub(daemon).PrefixMatch(request, metadata=[("authorization", f"Bearer {READ_TOKEN}")]).blocks
    return int(blocks)


def _fetch(daemon: DaemonProcess, chain: list[bytes]) -> list[pb.PrefixFrame]:
    request = pb.FetchPrefixRequest(namespace="ns", fingerprint=FP, block_size=4,
                                    rows=[pb.PrefixChain(chain_hashes=chain)])
    return list(_stub(daemon).FetchPrefix(request, metadata=[("authorization", f"Bearer {READ_TOKEN}")]))


def test_a_corrupt_block_is_named_by_its_place_in_the_chain_and_later_matches_end_before_it(
    daemon: DaemonProcess,
) -> None:
    assert _match(daemon, HASHES) == 4  # records only: the damage is not known yet
    frames = _fetch(daemon, HASHES)
    errors = [c for c in frames if c.HasField("error")]
    assert [(c.row, c.part) for c in frames if not c.HasField("error")] == [(0, 0), (0, 1)]
    (failed,) = errors
    assert (failed.part, failed.error.code, failed.error.block) == (2, "DATA_LOSS", 2)
    assert f"prefix block 2 of 4 in the chain ({HASHES[2].hex()})" in failed.error.message
    assert "part 2 (layer 2) fails its crc32c" in failed.error.message
    assert _match(daemon, HASHES) == 2  # cut before the corrupt block: clients stop fetching it
    assert _match(daemon, HASHES[:2]) == 2
    assert "event=prefix_row_dropped namespace=ns row=0 part=2 block=2" in daemon.log()


def test_a_chain_missing_its_first_blocks_is_not_served_and_cuts_nothing(daemon: DaemonProcess) -> None:
    frames = _fetch(daemon, HASHES[1:2])
    (failed,) = frames
    assert (failed.error.code, failed.error.block) == ("NOT_FOUND", 0)
    assert "is not the child of the block before it" in failed.error.message
    assert _match(daemon, HASHES[:2]) == 2  # the block itself is sound: the request skipped its parent


def test_put_prefix_needs_a_write_token_and_counts_new_blocks_and_duplicates(daemon: DaemonProcess) -> None:
    blocks = _blocks(NEW_TOKENS)
    with connect(f"grpc://{daemon.target}", token=READ_TOKEN) as reader, pytest.raises(AuthError):
        reader.put_prefix("ns", FP, LAYOUT, blocks, timeout=10)
    with connect(f"grpc://{daemon.target}", token=WRITE_TOKEN) as writer:
        assert writer.match_prefix("ns", FP, LAYOUT.block_size, [NEW], timeout=10) == [0]  # asks: admits them
        counts = writer.put_prefix("ns", FP, LAYOUT, blocks[:2], timeout=10)
        assert (counts.stored, counts.duplicates) == (2, 0)
        counts = writer.put_prefix("ns", FP, LAYOUT, blocks, timeout=10)
        assert (counts.stored, counts.duplicates) == (1, 2)
        assert writer.match_prefix("ns", FP, LAYOUT.block_size, [NEW], timeout=10) == [3]
        stream = writer.fetch_prefix("ns", FP, LAYOUT.block_size, [NEW], timeout=10)
        try:
            np.testing.assert_array_equal(stream.hidden(0), np.concatenate([b.hidden for b in blocks]))
        finally:
            stream.close()
    assert "event=prefix_put namespace=ns blocks=3 stored=1 duplicates=2" in daemon.log()
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10).read().decode()
    assert 'attnstore_prefix_blocks_put_total{namespace="ns"} 3.0' in metrics
    assert f'attnstore_prefix_blocks_put_bytes_total{{namespace="ns"}} {3 * LAYOUT.block_bytes}.0' in metrics


def test_only_an_admin_put_records_a_namespaces_missing_prefix_layout_and_another_one_is_refused(
    daemon: DaemonProcess,
) -> None:
    with connect(f"grpc://{daemon.target}", token=WRITE_TOKEN) as writer, \
            connect(f"grpc://{daemon.target}", token=ADMIN_TOKEN) as admin:
        assert writer.prefix_layout("blank") is None
        with pytest.raises(FingerprintMismatchError, match="records no prefix layout"):
            writer.put_prefix("blank", FP, LAYOUT, _blocks(NEW_TOKENS[:4]), timeout=10)
        admin.put_prefix("blank", FP, LAYOUT, _blocks(NEW_TOKENS[:4]), timeout=10)
        assert writer.prefix_layout("blank") == LAYOUT
        other = PrefixLayout(block_size=4, layers=3, kv_heads=2, head_dim=5, hidden=8, dtype="float16")
        with pytest.raises(FingerprintMismatchError, match="dtype='float32'.*dtype='float16'"):
            writer.put_prefix("blank", FP, other, _blocks(NEW_TOKENS[:4], other), timeout=10)


def test_a_block_damaged_on_the_way_is_data_loss_and_nothing_of_the_call_is_stored(daemon: DaemonProcess) -> None:
    chain = chain_hashes(list(range(200, 208)), LAYOUT.block_size)
    messages = [prefix_block_put(block) for block in _blocks(list(range(200, 208)))]
    messages[1].kv.data = bytes([messages[1].kv.data[0] ^ 0xFF]) + messages[1].kv.data[1:]
    request = pb.PutPrefixRequest(namespace="ns", fingerprint=FP, layout=prefix_layout_to_pb(LAYOUT), blocks=messages)
    with pytest.raises(grpc.RpcError) as failed:
        _stub(daemon).PutPrefix(request, metadata=[("authorization", f"Bearer {WRITE_TOKEN}")])
    assert failed.value.code() == grpc.StatusCode.DATA_LOSS and "fails its crc32c" in failed.value.details()
    assert _match(daemon, chain) == 0
