"""Written-back rows on the wire: the client encodes them, the daemon decodes and checks them.

Shared by both sides, so it imports only numpy, crc32c and the stubs. A row is
one message (no parts): write-back rows are outputs of one input, tens of KiB,
and a client batches them into calls well under the message size limit.
"""

from __future__ import annotations

from collections.abc import Sequence

import crc32c
import numpy as np

from attnstore.errors import ChecksumError, WireFormatError, shown
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.wire import WIRE_DTYPES


def row_to_pb(token_ids: Sequence[int] | np.ndarray, outputs: np.ndarray) -> pb.WrittenRow:
    """One computed row as its wire message; outputs are sent as fp16 (what the store keeps).

    Args:
        token_ids: the row's ``L`` token ids.
        outputs: its ``(L, hidden)`` last hidden states.
    """
    data = np.ascontiguousarray(outputs, dtype="<f2")  # (L, hidden)
    raw = data.tobytes()
    return pb.WrittenRow(
        token_ids=np.asarray(token_ids, dtype=np.int64).tolist(), dtype="float16", shape=list(data.shape),
        outputs=raw, crc32c=crc32c.crc32c(raw),
    )


def row_from_pb(row: pb.WrittenRow, index: int) -> tuple[np.ndarray, np.ndarray]:
    """A row's ``(L,)`` token ids and ``(rows, cols)`` outputs as its message states them.

    Whether the outputs fit the tokens and the namespace is the service's check
    (``service.write_back.check_rows``); this one checks the message itself.

    Raises:
        WireFormatError: an unknown dtype, a shape that is not 2-d, data of another size than the shape's.
        ChecksumError: the data does not match its crc32c.
    """
    dtype = WIRE_DTYPES.get(row.dtype)
    if dtype is None:
        raise WireFormatError(
            f"write-back row {index}: dtype must be one of {sorted(WIRE_DTYPES)}, got {shown(row.dtype)}"
        )
    shape = tuple(int(n) for n in row.shape)
    if len(shape) != 2:
        raise WireFormatError(f"write-back row {index}: outputs shape must be (L, hidden), got {shown(shape)}")
    expected = shape[0] * shape[1] * dtype.itemsize
    if len(row.outputs) != expected:
        raise WireFormatError(
            f"write-back row {index}: {len(row.outputs)} bytes of outputs for shape {shape} {row.dtype},"
            f" expected {expected}"
        )
    if crc32c.crc32c(row.outputs) != row.crc32c:
        raise ChecksumError(f"write-back row {index}: outputs fail their crc32c check")
    outputs = np.frombuffer(row.outputs, dtype=dtype).reshape(shape)  # (L, hidden)
    token_ids = np.fromiter(row.token_ids, dtype=np.int64, count=len(row.token_ids))  # (L,)
    return token_ids, outputs
