"""Written-back rows on the wire: the client encodes them, the daemon decodes and checks them.

Shared by both sides, so it imports only numpy, crc32c and the stubs. A row is
one message (no parts): a row's outputs are tens of KiB and its maps, when sent,
at most a few MiB (the client sends maps only for rows under its per-row cap),
and a client batches rows into calls well under the message size limit.
"""

from __future__ import annotations

from collections.abc import Sequence

import crc32c
import numpy as np

from attnstore.errors import ChecksumError, WireFormatError, shown
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.wire import WIRE_DTYPES

# A decoded row: (L,) token ids, (L, hidden) outputs, (layers, heads, L, L) maps or None,
# (feature_dim,) float32 feature or None, and the projector version the feature came from (0: none).
DecodedRow = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None, int]


def row_to_pb(
    token_ids: Sequence[int] | np.ndarray,
    outputs: np.ndarray,
    maps: np.ndarray | None = None,
    feature: np.ndarray | None = None,
    projector_version: int = 0,
) -> pb.WrittenRow:
    """One computed row as its wire message; outputs and maps are sent as fp16 (what the store keeps).

    Args:
        token_ids: the row's ``L`` token ids.
        outputs: its ``(L, hidden)`` last hidden states.
        maps: its ``(layers, heads, L, L)`` attention probabilities; None sends outputs only.
        feature: its ``(feature_dim,)`` projector output (only with maps); None sends none.
        projector_version: the namespace's projector version ``feature`` was projected with.
    """
    data = np.ascontiguousarray(outputs, dtype="<f2")  # (L, hidden)
    raw = data.tobytes()
    row = pb.WrittenRow(
        token_ids=np.asarray(token_ids, dtype=np.int64).tolist(), dtype="float16", shape=list(data.shape),
        outputs=raw, crc32c=crc32c.crc32c(raw),
    )
    if maps is not None:
        map_data = np.ascontiguousarray(maps, dtype="<f2")  # (layers, heads, L, L)
        map_raw = map_data.tobytes()
        row.maps_dtype, row.maps, row.maps_crc32c = "float16", map_raw, crc32c.crc32c(map_raw)
        row.maps_shape.extend(map_data.shape)
    if feature is not None:
        row.feature.extend(np.asarray(feature, dtype=np.float32).tolist())
        row.projector_version = projector_version
    return row


def row_from_pb(row: pb.WrittenRow, index: int) -> DecodedRow:
    """A row's token ids, outputs, maps, feature and projector version as its message states them.

    Whether the arrays fit the tokens and the namespace is the service's check
    (``service.write_back.check_rows``); this one checks the message itself.

    Raises:
        WireFormatError: an unknown dtype, outputs not 2-d or maps not 4-d, data of another size than its shape's.
        ChecksumError: the outputs or the maps do not match their crc32c.
    """
    outputs = _array(index, "outputs", row.dtype, row.shape, row.outputs, row.crc32c, ndim=2)  # (L, hidden)
    maps = None
    if row.maps or row.maps_dtype or len(row.maps_shape):
        maps = _array(index, "maps", row.maps_dtype, row.maps_shape, row.maps, row.maps_crc32c, ndim=4)
    feature = np.asarray(row.feature, dtype=np.float32) if len(row.feature) else None  # (feature_dim,)
    token_ids = np.fromiter(row.token_ids, dtype=np.int64, count=len(row.token_ids))  # (L,)
    return token_ids, outputs, maps, feature, int(row.projector_version)


def _array(
    index: int, what: str, dtype_name: str, shape_field: Sequence[int], data: bytes, crc: int, *, ndim: int
) -> np.ndarray:
    """One array of a row, checked against its stated dtype, shape and crc32c."""
    dtype = WIRE_DTYPES.get(dtype_name)
    if dtype is None:
        raise WireFormatError(
            f"write-back row {index}: {what} dtype must be one of {sorted(WIRE_DTYPES)}, got {shown(dtype_name)}"
        )
    shape = tuple(int(n) for n in shape_field)
    if len(shape) != ndim:
        expected_shape = "(L, hidden)" if ndim == 2 else "(layers, heads, L, L)"
        raise WireFormatError(f"write-back row {index}: {what} shape must be {expected_shape}, got {shown(shape)}")
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(data) != expected:
        raise WireFormatError(
            f"write-back row {index}: {len(data)} bytes of {what} for shape {shape} {dtype_name}, expected {expected}"
        )
    if crc32c.crc32c(data) != crc:
        raise ChecksumError(f"write-back row {index}: {what} fail their crc32c check")
    return np.frombuffer(data, dtype=dtype).reshape(shape)
