"""The prefix tier through the real daemon: a corrupt block is named by its place in the chain and cuts the
chain there for later matches; a chain is never served from a later block without its parents."""

from __future__ import annotations

import numpy as np
import pytest

from attnstore.protocol.prefix import PrefixBlock, PrefixLayout, chain_hashes
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.v1 import attnstore_pb2_grpc as pb_grpc
from attnstore.store import MapStore
from attnstore.store.lmdb.prefix_blocks import part_key
from attnstore_client.connection.channel import open_channel
from tests.support.daemon import READ_TOKEN, DaemonProcess
from tests.support.stores import small_layout

FP = "f" * 64
LAYOUT = PrefixLayout(block_size=4, layers=3, kv_heads=2, head_dim=5, hidden=6, dtype="float32")
HASHES = chain_hashes(list(range(16)), LAYOUT.block_size)  # four blocks


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("prefix")
    rng = np.random.default_rng(0)
    with MapStore.open(workdir / "store", create=True) as store:
        store.create_namespace("ns", model="tiny", fingerprint=FP, layout=small_layout())
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
    process = DaemonProcess(workdir / "store", workdir).start()
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
