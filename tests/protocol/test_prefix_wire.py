"""Chunk- and prefix-tier wire messages: layouts, chunks and prefix blocks to and from the wire, checked against
their crc32c and layout."""

from __future__ import annotations

import numpy as np
import pytest

from attnstore.errors import ChecksumError, WireFormatError
from attnstore.protocol.chunks import ChunkLayout, StoredChunk
from attnstore.protocol.prefix import PrefixBlock, PrefixLayout
from attnstore.protocol.prefix_wire import (
    chunk_data,
    chunk_data_array,
    chunk_layout_from_pb,
    chunk_layout_to_pb,
    chunk_put,
    prefix_block_of,
    prefix_block_put,
    stored_chunk_of,
)
from attnstore.protocol.v1 import attnstore_pb2 as pb

LAYOUT = ChunkLayout(layers=2, kv_heads=3, head_dim=4, dtype="float16")


def _chunk(length: int = 5) -> StoredChunk:
    kv = np.random.default_rng(0).standard_normal((2, *LAYOUT.layer_shape(length))).astype(np.float16)
    return StoredChunk(bytes(range(32)), kv, "node-a")


def test_a_chunk_layout_and_a_chunk_round_trip_through_their_messages():
    assert chunk_layout_from_pb(chunk_layout_to_pb(LAYOUT)) == LAYOUT
    chunk = _chunk()
    back = stored_chunk_of(pb.ChunkPut.FromString(chunk_put(chunk).SerializeToString()), LAYOUT, "node-b")
    assert back.key == chunk.key and back.writer == "node-b" and np.array_equal(back.kv, chunk.kv)
    layer = chunk.kv[1]
    assert np.array_equal(chunk_data_array(chunk_data(3, 1, layer)), layer)


@pytest.mark.parametrize(("layout", "match"), [
    (pb.ChunkLayout(layers=2, kv_heads=3, head_dim=4, dtype="bfloat16"), "dtype 'bfloat16'"),
    (pb.ChunkLayout(layers=0, kv_heads=3, head_dim=4, dtype="float16"), "layers 0"),
])
def test_a_bad_chunk_layout_on_the_wire_is_a_wire_format_error(layout, match):
    with pytest.raises(WireFormatError, match=match):
        chunk_layout_from_pb(layout)


def test_a_chunk_damaged_in_transit_or_unlike_the_layout_is_refused_naming_it():
    message = chunk_put(_chunk())
    damaged = pb.ChunkPut()
    damaged.CopyFrom(message)
    damaged.data = bytes([message.data[0] ^ 0xFF]) + message.data[1:]
    with pytest.raises(ChecksumError, match=f"chunk {bytes(range(32)).hex()[:16]} fails its crc32c"):
        stored_chunk_of(damaged, LAYOUT)
    with pytest.raises(WireFormatError, match="dtype float16, the layout's is float32"):
        stored_chunk_of(message, ChunkLayout(2, 3, 4, "float32"))
    with pytest.raises(WireFormatError, match="is not \\(layers, 2, kv_heads, C, head_dim\\)"):
        stored_chunk_of(message, ChunkLayout(2, 4, 3, "float16"))
    short = pb.ChunkPut()
    short.CopyFrom(message)
    short.key = b"x" * 31
    with pytest.raises(WireFormatError, match="32 bytes, got 31"):
        stored_chunk_of(short, LAYOUT)


PREFIX = PrefixLayout(block_size=4, layers=2, kv_heads=1, head_dim=3, hidden=5, dtype="float32")


def _block(parent: bytes | None = b"\1" * 32) -> PrefixBlock:
    rng = np.random.default_rng(1)
    return PrefixBlock(b"\2" * 32, parent, rng.standard_normal((2, *PREFIX.layer_shape)).astype(np.float32),
                       rng.standard_normal((4, 5)).astype(np.float32))


@pytest.mark.parametrize("parent", [b"\1" * 32, None])
def test_a_prefix_block_round_trips_through_its_message(parent):
    block = _block(parent)
    back = prefix_block_of(pb.PrefixBlockPut.FromString(prefix_block_put(block).SerializeToString()), PREFIX)
    assert (back.chain_hash, back.parent) == (block.chain_hash, parent)
    assert np.array_equal(back.kv, block.kv) and np.array_equal(back.hidden, block.hidden)


def test_a_prefix_block_damaged_in_transit_or_unlike_the_layout_is_refused_naming_it():
    message = prefix_block_put(_block())
    damaged = pb.PrefixBlockPut()
    damaged.CopyFrom(message)
    damaged.hidden.data = bytes([message.hidden.data[0] ^ 0xFF]) + message.hidden.data[1:]
    with pytest.raises(ChecksumError, match="prefix block 0202020202020202 hidden states fails its crc32c"):
        prefix_block_of(damaged, PREFIX)
    with pytest.raises(WireFormatError, match="keys and values are float32 .* needs float16"):
        prefix_block_of(message, PrefixLayout(4, 2, 1, 3, 5, "float16"))
    with pytest.raises(WireFormatError, match=r"keys and values are float32 \(2, 2, 1, 4, 3\)"):
        prefix_block_of(message, PrefixLayout(8, 2, 1, 3, 5, "float32"))
    short = pb.PrefixBlockPut()
    short.CopyFrom(message)
    short.parent = b"x" * 31
    with pytest.raises(WireFormatError, match="got 32 and 31"):
        prefix_block_of(short, PREFIX)
