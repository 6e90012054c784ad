"""Arrays on the wire: split into checksummed frames, and put back together.

Shared by the daemon and the client, so it imports only numpy, crc32c and the
generated stubs. Every frame carries at most ``FRAME_DATA_BYTES`` of data (the
design caps messages at 4 MiB) and a crc32c of its data; a layer bigger than
that travels in parts at byte offsets.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import crc32c
import numpy as np

from attnstore.errors import ChecksumError, WireFormatError, shown
from attnstore.protocol.v1 import attnstore_pb2 as pb

# Room for the frame's other fields under the 4 MiB message cap.
FRAME_DATA_BYTES = 4 * 1024 * 1024 - 4096

# Dtypes that may travel; anything else is refused on both ends.
WIRE_DTYPES: dict[str, np.dtype] = {"float16": np.dtype("<f2"), "float32": np.dtype("<f4")}


def _wire_dtype(array: np.ndarray) -> str:
    for name, dtype in WIRE_DTYPES.items():
        if array.dtype == dtype:
            return name
    raise WireFormatError(f"arrays on the wire must be one of {sorted(WIRE_DTYPES)}, got {array.dtype}")


def _parts(array: np.ndarray, max_bytes: int) -> Iterator[tuple[int, memoryview]]:
    data = np.ascontiguousarray(array).data.cast("B")
    for offset in range(0, max(len(data), 1), max_bytes):
        yield offset, data[offset : offset + max_bytes]


def map_frames(
    layer_maps: np.ndarray,
    *,
    query_index: int,
    entry_id: int,
    layer: int,
    max_bytes: int = FRAME_DATA_BYTES,
) -> Iterator[pb.MapFrame]:
    """Split one layer's maps ``(heads, L, L)`` into MapFrame messages."""
    dtype = _wire_dtype(layer_maps)
    for offset, data in _parts(layer_maps, max_bytes):
        yield pb.MapFrame(
            query_index=query_index, entry_id=entry_id, layer=layer, dtype=dtype,
            shape=list(layer_maps.shape), codec="raw", data=bytes(data),
            crc32c=crc32c.crc32c(data), offset=offset, total_bytes=layer_maps.nbytes,
        )


def output_frames(
    outputs: np.ndarray, *, query_index: int, entry_id: int, max_bytes: int = FRAME_DATA_BYTES
) -> Iterator[pb.OutputFrame]:
    """Split one entry's stored outputs ``(L, hidden)`` into OutputFrame messages."""
    dtype = _wire_dtype(outputs)
    for offset, data in _parts(outputs, max_bytes):
        yield pb.OutputFrame(
            query_index=query_index, entry_id=entry_id, dtype=dtype, shape=list(outputs.shape),
            data=bytes(data), crc32c=crc32c.crc32c(data), offset=offset, total_bytes=outputs.nbytes,
        )


@dataclass
class _Partial:
    """One array whose parts are arriving: its buffer and the byte ranges already written."""

    buffer: np.ndarray  # (total_bytes,) uint8; every byte is written by exactly one part before use
    shape: tuple[int, ...]
    dtype: str
    spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each part, sorted
    covered: int = 0  # bytes written; parts never overlap, so the array is complete at total_bytes

    def take(self, key: tuple[int, int | str], offset: int, data: bytes) -> None:
        """Write one part; refuse one that overlaps a part already written."""
        end = offset + len(data)
        if not data and self.buffer.size:
            raise WireFormatError(f"frame {key}: an empty part at offset {offset} of a {self.buffer.size}-byte array")
        at = bisect.bisect_left(self.spans, (offset, end))
        before = self.spans[at - 1] if at else None
        after = self.spans[at] if at < len(self.spans) else None
        clash = before if before is not None and before[1] > offset else after
        if clash is not None and (clash is before or clash[0] < end):
            raise WireFormatError(
                f"frame {key}: part [{offset}, {end}) overlaps the part [{clash[0]}, {clash[1]})"
                " already received; each byte of an array must arrive once"
            )
        self.spans.insert(at, (offset, end))
        self.buffer[offset:end] = np.frombuffer(data, dtype=np.uint8)
        self.covered += len(data)


class FrameAssembler:
    """Collects the parts of arrays and hands each one back once it is complete.

    Parts of one array share a key (``(query_index, layer)`` for maps,
    ``(query_index, "outputs")`` for outputs). Each part's checksum, offset and
    size are checked on arrival; a bad part raises and never reaches a caller.
    An array is complete when its parts cover every byte of it; parts may come
    in any order, but a part that overlaps another is refused, so a byte sent
    twice can never stand in for one that never came.
    """

    def __init__(self, max_array_bytes: int) -> None:
        self._max_array_bytes = max_array_bytes
        self._pending: dict[tuple[int, int | Literal["outputs"]], _Partial] = {}

    def add(
        self, frame: pb.MapFrame | pb.OutputFrame
    ) -> tuple[tuple[int, int | Literal["outputs"]], np.ndarray] | None:
        """Add one part; return ``(key, array)`` when its array is complete, else None.

        Raises:
            ChecksumError: the part's data does not match its crc32c.
            WireFormatError: unknown dtype or codec, inconsistent shape, size or offset, an empty
                part, or a part overlapping one already received.
        """
        key: tuple[int, int | Literal["outputs"]]
        if isinstance(frame, pb.MapFrame):
            key = (frame.query_index, frame.layer)
            if frame.codec not in ("raw", ""):
                raise WireFormatError(f"map frame codec must be 'raw', got {shown(frame.codec)}")
        else:
            key = (frame.query_index, "outputs")
        if crc32c.crc32c(frame.data) != frame.crc32c:
            raise ChecksumError(f"frame {key} of entry {frame.entry_id} failed its crc32c check")
        dtype = WIRE_DTYPES.get(frame.dtype)
        if dtype is None:
            raise WireFormatError(f"frame dtype must be one of {sorted(WIRE_DTYPES)}, got {shown(frame.dtype)}")
        shape = tuple(int(n) for n in frame.shape)
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize if shape else 0
        if expected != frame.total_bytes or expected > self._max_array_bytes:
            raise WireFormatError(
                f"frame {key}: shape {shown(shape)} of {frame.dtype} is {expected} bytes, total_bytes says "
                f"{frame.total_bytes} (limit {self._max_array_bytes})"
            )
        if frame.offset + len(frame.data) > expected:
            raise WireFormatError(f"frame {key}: part at offset {frame.offset} overruns {expected} bytes")
        partial = self._pending.get(key)
        if partial is None:
            partial = self._pending[key] = _Partial(np.empty(expected, dtype=np.uint8), shape, frame.dtype)
        if partial.shape != shape or partial.dtype != frame.dtype:
            raise WireFormatError(f"frame {key}: parts disagree on shape or dtype")
        partial.take(key, frame.offset, frame.data)
        if partial.covered < expected:
            return None
        del self._pending[key]
        return key, partial.buffer.view(dtype).reshape(shape)

    @property
    def incomplete(self) -> int:
        """Number of arrays with parts still missing."""
        return len(self._pending)
