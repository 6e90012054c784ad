"""Prefix- and chunk-tier messages: layouts and arrays to and from the wire (light: the client uses it too).

Both tiers send keys and values as raw arrays with their dtype, shape and
crc32c (``PrefixFrame``, ``PrefixArray``, ``ChunkData``, ``ChunkPut``); one check reads them all.
"""

from __future__ import annotations

from collections.abc import Sequence

import crc32c
import numpy as np

from attnstore.errors import ChecksumError, WireFormatError
from attnstore.protocol.chunks import CHUNK_DTYPES, CHUNK_KEY_BYTES, ChunkLayout, StoredChunk
from attnstore.protocol.keys import BLOCK_HASH_BYTES, chunk_key
from attnstore.protocol.prefix import PREFIX_DTYPES, PrefixBlock, PrefixLayout, block_chain_hash
from attnstore.protocol.v1 import attnstore_pb2 as pb


def prefix_layout_to_pb(layout: PrefixLayout) -> pb.PrefixLayout:
    """A prefix layout as its wire message."""
    return pb.PrefixLayout(block_size=layout.block_size, layers=layout.layers, kv_heads=layout.kv_heads,
                           head_dim=layout.head_dim, hidden=layout.hidden, dtype=layout.dtype)


def prefix_layout_from_pb(message: pb.PrefixLayout) -> PrefixLayout:
    """The prefix layout of a wire message.

    Raises:
        WireFormatError: an unknown dtype or a zero size.
    """
    if message.dtype not in PREFIX_DTYPES:
        raise WireFormatError(f"prefix layout dtype {message.dtype!r} is not one of {list(PREFIX_DTYPES)}")
    try:
        return PrefixLayout(int(message.block_size), int(message.layers), int(message.kv_heads),
                            int(message.head_dim), int(message.hidden), message.dtype)
    except ValueError as exc:
        raise WireFormatError(f"bad prefix layout on the wire: {exc}") from None


def chains_to_pb(rows: Sequence[Sequence[bytes]]) -> list[pb.PrefixChain]:
    """Rows' chains of block hashes as wire messages."""
    return [pb.PrefixChain(chain_hashes=list(row)) for row in rows]


def prefix_frame(row: int, part: int, array: np.ndarray) -> pb.PrefixFrame:
    """One part of a row's prefix (a layer's keys and values, or its hidden states) as a wire message."""
    data = array.tobytes()
    return pb.PrefixFrame(row=row, part=part, dtype=str(array.dtype), shape=list(array.shape), data=data,
                          crc32c=crc32c.crc32c(data))


def array_of(message: pb.PrefixFrame) -> np.ndarray:
    """The array of a prefix frame, checked against its crc32c.

    Raises:
        ChecksumError: the bytes were damaged in transit.
        WireFormatError: an unknown dtype, or bytes that do not fill the shape.
    """
    return _checked_array(message, f"prefix part {message.part} of row {message.row}")


def prefix_block_put(block: PrefixBlock) -> pb.PrefixBlockPut:
    """A whole prefix block to store as a wire message, with its token ids (the daemon hashes them itself)."""
    ids = [] if block.token_ids is None else np.asarray(block.token_ids).tolist()
    return pb.PrefixBlockPut(chain_hash=block.chain_hash, parent=block.parent or b"", kv=_array_to_pb(block.kv),
                             hidden=_array_to_pb(block.hidden), token_ids=ids)


def prefix_block_of(message: pb.PrefixBlockPut, layout: PrefixLayout, writer: str | None = None) -> PrefixBlock:
    """The block a ``PrefixBlockPut`` carries (recorded as ``writer``'s), checked against ``layout``; an empty
    chain hash is the one its parent and token ids give (the service checks a sent one against them).

    Raises:
        ChecksumError: the bytes were damaged in transit.
        WireFormatError: a hash that is not 32 bytes, an unknown dtype, bytes that do not fill the shape, or a
            shape or dtype other than the layout's.
        MapShapeError: no hash and token ids that are not ``block_size`` of them.
    """
    chain_hash, parent = bytes(message.chain_hash), bytes(message.parent)
    token_ids = np.asarray(message.token_ids, dtype=np.int64) if len(message.token_ids) else None
    if not chain_hash and token_ids is not None:
        chain_hash = block_chain_hash(layout, parent or None, token_ids)
    if len(chain_hash) != BLOCK_HASH_BYTES or len(parent) not in (0, BLOCK_HASH_BYTES):
        raise WireFormatError(f"a prefix block's chain hash is {BLOCK_HASH_BYTES} bytes and its parent"
                              f" {BLOCK_HASH_BYTES} or none, got {len(chain_hash)} and {len(parent)}")
    what = f"prefix block {chain_hash.hex()[:16]}"
    kv = _checked_array(message.kv, f"{what} keys and values")
    hidden = _checked_array(message.hidden, f"{what} hidden states")
    for name, array, shape in (("keys and values", kv, (layout.layers, *layout.layer_shape)),
                               ("hidden states", hidden, (layout.block_size, layout.hidden))):
        if array.shape != shape or array.dtype != np.dtype(layout.dtype):
            raise WireFormatError(f"{what}: {name} are {array.dtype} {array.shape}; layout {layout} needs"
                                  f" {layout.dtype} {shape}")
    return PrefixBlock(chain_hash, parent or None, kv, hidden, token_ids, writer)


def _array_to_pb(array: np.ndarray) -> pb.PrefixArray:
    data = np.ascontiguousarray(array).tobytes()
    return pb.PrefixArray(dtype=str(array.dtype), shape=list(array.shape), data=data, crc32c=crc32c.crc32c(data))


def chunk_layout_to_pb(layout: ChunkLayout) -> pb.ChunkLayout:
    """A chunk layout as its wire message."""
    return pb.ChunkLayout(layers=layout.layers, kv_heads=layout.kv_heads, head_dim=layout.head_dim,
                          dtype=layout.dtype)


def chunk_layout_from_pb(message: pb.ChunkLayout) -> ChunkLayout:
    """The chunk layout of a wire message.

    Raises:
        WireFormatError: an unknown dtype or a zero size.
    """
    if message.dtype not in CHUNK_DTYPES:
        raise WireFormatError(f"chunk layout dtype {message.dtype!r} is not one of {list(CHUNK_DTYPES)}")
    if 0 in (message.layers, message.kv_heads, message.head_dim):
        raise WireFormatError(f"bad chunk layout on the wire: layers {message.layers}, kv_heads"
                              f" {message.kv_heads}, head_dim {message.head_dim} (each must be >= 1)")
    try:
        return ChunkLayout(int(message.layers), int(message.kv_heads), int(message.head_dim),
                           CHUNK_DTYPES[CHUNK_DTYPES.index(message.dtype)])
    except ValueError as exc:
        raise WireFormatError(f"bad chunk layout on the wire: {exc}") from None


def chunk_data(chunk: int, layer: int, array: np.ndarray) -> pb.ChunkData:
    """One chunk's layer (its keys and values ``(2, KVH, C, d)``) as a wire message."""
    data = array.tobytes()
    return pb.ChunkData(chunk=chunk, layer=layer, dtype=str(array.dtype), shape=list(array.shape), data=data,
                        crc32c=crc32c.crc32c(data))


def chunk_data_array(message: pb.ChunkData) -> np.ndarray:
    """The array of a ``ChunkData`` message, checked as :func:`array_of` checks a prefix frame."""
    return _checked_array(message, f"layer {message.layer} of chunk {message.chunk}")


def chunk_put(chunk: StoredChunk) -> pb.ChunkPut:
    """A whole chunk to store as a wire message, with its token ids and context (the daemon derives its key)."""
    data = np.ascontiguousarray(chunk.kv).tobytes()
    ids = [] if chunk.token_ids is None else np.asarray(chunk.token_ids).tolist()
    context = [] if chunk.context_ids is None else np.asarray(chunk.context_ids).tolist()
    return pb.ChunkPut(key=chunk.key, dtype=str(chunk.kv.dtype), shape=list(chunk.kv.shape), data=data,
                       crc32c=crc32c.crc32c(data), token_ids=ids, context_ids=context)


def stored_chunk_of(message: pb.ChunkPut, layout: ChunkLayout, writer: str | None = None) -> StoredChunk:
    """The chunk a ``ChunkPut`` carries, checked against ``layout``; an empty key is the one its ids give (the
    service checks a sent one against them).

    Raises:
        ChecksumError: the bytes were damaged in transit.
        WireFormatError: a key that is not 32 bytes, an unknown dtype, bytes that do not fill the shape, or a
            shape or dtype other than the layout's.
    """
    key = bytes(message.key)
    token_ids = np.asarray(message.token_ids, dtype=np.int64) if len(message.token_ids) else None
    context_ids = np.asarray(message.context_ids, dtype=np.int64) if len(message.context_ids) else None
    if not key and token_ids is not None:
        key = chunk_key(context_ids, token_ids)
    if len(key) != CHUNK_KEY_BYTES:
        raise WireFormatError(f"a chunk key is {CHUNK_KEY_BYTES} bytes, got {len(key)}")
    kv = _checked_array(message, f"chunk {key.hex()[:16]}")
    if kv.ndim != 5 or kv.shape[3] < 1 or kv.shape != (layout.layers, *layout.layer_shape(kv.shape[3])):
        raise WireFormatError(f"chunk {key.hex()[:16]}: shape {kv.shape} is not (layers, 2, kv_heads, C, head_dim)"
                              f" of layout {layout}")
    if kv.dtype != np.dtype(layout.dtype):
        raise WireFormatError(f"chunk {key.hex()[:16]}: dtype {kv.dtype}, the layout's is {layout.dtype}")
    return StoredChunk(key, kv, writer, token_ids, context_ids)


def _checked_array(message: pb.PrefixFrame | pb.PrefixArray | pb.ChunkData | pb.ChunkPut, what: str) -> np.ndarray:
    if crc32c.crc32c(message.data) != message.crc32c:
        raise ChecksumError(f"{what} fails its crc32c")
    if message.dtype not in PREFIX_DTYPES:
        raise WireFormatError(f"{what}: dtype {message.dtype!r} is not one of {list(PREFIX_DTYPES)}")
    shape = tuple(int(n) for n in message.shape)
    array = np.frombuffer(message.data, dtype=message.dtype)
    if array.size != int(np.prod(shape)):
        raise WireFormatError(f"{what}: {array.size} values for shape {shape}")
    return array.reshape(shape)
