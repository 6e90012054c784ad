"""Prefix-tier messages: layouts and chunks to and from the wire (light: the client uses it too)."""

from __future__ import annotations

from collections.abc import Sequence

import crc32c
import numpy as np

from attnstore.errors import ChecksumError, WireFormatError
from attnstore.protocol.prefix import PREFIX_DTYPES, PrefixLayout
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


def prefix_chunk(row: int, chunk: int, array: np.ndarray) -> pb.PrefixChunk:
    """One row's chunk (a layer's keys and values, or its hidden states) as a wire message."""
    data = array.tobytes()
    return pb.PrefixChunk(row=row, chunk=chunk, dtype=str(array.dtype), shape=list(array.shape), data=data,
                          crc32c=crc32c.crc32c(data))


def array_of(message: pb.PrefixChunk) -> np.ndarray:
    """The array of a chunk message, checked against its crc32c.

    Raises:
        ChecksumError: the bytes were damaged in transit.
        WireFormatError: an unknown dtype, or bytes that do not fill the shape.
    """
    if crc32c.crc32c(message.data) != message.crc32c:
        raise ChecksumError(f"prefix chunk {message.chunk} of row {message.row} fails its crc32c")
    if message.dtype not in PREFIX_DTYPES:
        raise WireFormatError(f"prefix chunk dtype {message.dtype!r} is not one of {list(PREFIX_DTYPES)}")
    shape = tuple(int(n) for n in message.shape)
    array = np.frombuffer(message.data, dtype=message.dtype)
    if array.size != int(np.prod(shape)):
        raise WireFormatError(f"prefix chunk of row {message.row}: {array.size} values for shape {shape}")
    return array.reshape(shape)
