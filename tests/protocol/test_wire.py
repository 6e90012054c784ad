"""Arrays split into frames and reassembled, with checksums and limits."""

from __future__ import annotations

import crc32c
import numpy as np
import pytest

from attnstore.errors import ChecksumError, WireFormatError
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.wire import FrameAssembler, map_frames, output_frames


def _maps(heads: int = 3, length: int = 20) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.random((heads, length, length)).astype(np.float16)


def test_layer_round_trips_through_small_parts() -> None:
    maps = _maps()
    frames = list(map_frames(maps, query_index=2, entry_id=7, layer=5, max_bytes=500))
    assert len(frames) == -(-maps.nbytes // 500)
    assembler = FrameAssembler(max_array_bytes=1 << 20)
    results = [assembler.add(c) for c in reversed(frames)]
    assert all(r is None for r in results[:-1])
    key, array = results[-1]
    assert key == (2, 5)
    np.testing.assert_array_equal(array, maps)
    assert assembler.incomplete == 0


def test_outputs_round_trip() -> None:
    outputs = np.arange(24, dtype=np.float16).reshape(4, 6)
    assembler = FrameAssembler(max_array_bytes=1 << 20)
    (frame,) = output_frames(outputs, query_index=0, entry_id=1)
    key, array = assembler.add(frame)
    assert key == (0, "outputs")
    np.testing.assert_array_equal(array, outputs)


def test_corrupted_part_raises_checksum_error() -> None:
    (frame,) = map_frames(_maps(), query_index=0, entry_id=1, layer=0)
    frame.data = bytes([frame.data[0] ^ 1]) + frame.data[1:]
    with pytest.raises(ChecksumError, match="crc32c"):
        FrameAssembler(max_array_bytes=1 << 20).add(frame)


def test_array_over_the_limit_is_refused() -> None:
    (frame,) = map_frames(_maps(), query_index=0, entry_id=1, layer=0)
    with pytest.raises(WireFormatError, match="limit"):
        FrameAssembler(max_array_bytes=100).add(frame)


def test_shape_that_disagrees_with_size_is_refused() -> None:
    (frame,) = map_frames(_maps(), query_index=0, entry_id=1, layer=0)
    frame.shape[:] = [3, 20, 21]
    with pytest.raises(WireFormatError, match="total_bytes"):
        FrameAssembler(max_array_bytes=1 << 20).add(frame)


def test_unsupported_dtype_is_refused_on_both_ends() -> None:
    with pytest.raises(WireFormatError, match="float16"):
        list(map_frames(np.zeros((1, 2, 2), dtype=np.int32), query_index=0, entry_id=1, layer=0))
    (frame,) = map_frames(_maps(), query_index=0, entry_id=1, layer=0)
    frame.dtype = "float64"
    with pytest.raises(WireFormatError, match="dtype"):
        FrameAssembler(max_array_bytes=1 << 20).add(frame)


def test_a_part_sent_twice_never_completes_an_array_whose_other_part_is_missing() -> None:
    # Two parts of 2 x 20 x 20 fp16 (1,600 bytes): the first twice makes 1,600 bytes received
    # but only [0, 800) covered. Counting bytes received would hand back 800 bytes never sent.
    first, second = map_frames(_maps(heads=2), query_index=0, entry_id=1, layer=0, max_bytes=800)
    assembler = FrameAssembler(max_array_bytes=1 << 20)
    assert assembler.add(first) is None
    with pytest.raises(WireFormatError, match=r"part \[0, 800\) overlaps the part \[0, 800\)"):
        assembler.add(first)
    assert assembler.incomplete == 1  # still waiting for [800, 1600)
    key, array = assembler.add(second)
    np.testing.assert_array_equal(array, _maps(heads=2))


def test_overlapping_parts_at_other_offsets_are_refused() -> None:
    maps = _maps(heads=2)
    whole = maps.tobytes()
    a, _ = map_frames(maps, query_index=0, entry_id=1, layer=0, max_bytes=800)
    shifted = pb.MapFrame.FromString(a.SerializeToString())
    shifted.offset, shifted.data = 400, whole[400:1200]
    shifted.crc32c = crc32c.crc32c(shifted.data)
    assembler = FrameAssembler(max_array_bytes=1 << 20)
    assembler.add(a)
    with pytest.raises(WireFormatError, match=r"\[400, 1200\) overlaps the part \[0, 800\)"):
        assembler.add(shifted)


def test_an_empty_part_of_a_non_empty_array_is_refused() -> None:
    (frame,) = map_frames(_maps(), query_index=0, entry_id=1, layer=0)
    frame.data, frame.crc32c = b"", crc32c.crc32c(b"")
    with pytest.raises(WireFormatError, match="empty part"):
        FrameAssembler(max_array_bytes=1 << 20).add(frame)


def test_an_echoed_dtype_is_clipped_in_the_message() -> None:
    (frame,) = map_frames(_maps(), query_index=0, entry_id=1, layer=0)
    frame.dtype = "x" * 10_000
    with pytest.raises(WireFormatError) as caught:
        FrameAssembler(max_array_bytes=1 << 20).add(frame)
    assert len(str(caught.value)) < 300 and "10002 characters" in str(caught.value)
