"""Chunk layouts and the check of a chunk to store (``attnstore.protocol.chunks``)."""

from __future__ import annotations

import numpy as np
import pytest

from attnstore.errors import ConfigError, MapShapeError
from attnstore.protocol.chunks import CHUNK_KEY_BYTES, ChunkLayout, StoredChunk, check_chunk


def test_a_layout_gives_the_shape_and_bytes_of_a_chunk_of_any_length_and_round_trips_through_a_dict():
    layout = ChunkLayout(layers=30, kv_heads=3, head_dim=64, dtype="float16")
    assert layout.layer_shape(40) == (2, 3, 40, 64)
    assert layout.chunk_bytes(40) == 30 * 2 * 3 * 40 * 64 * 2
    assert ChunkLayout.from_dict(layout.to_dict()) == layout


@pytest.mark.parametrize(("field", "value"), [("layers", 0), ("kv_heads", True), ("head_dim", 2.0), ("dtype", "bf16")])
def test_a_bad_layout_field_is_refused_naming_it_and_its_value(field, value):
    fields = {"layers": 2, "kv_heads": 1, "head_dim": 4, "dtype": "float32", field: value}
    with pytest.raises(ConfigError, match=f"{field}.*{value!r}"):
        ChunkLayout(**fields)


def test_a_layout_record_without_a_field_is_refused_naming_it():
    with pytest.raises(ConfigError, match="head_dim"):
        ChunkLayout.from_dict({"layers": 2, "kv_heads": 1, "dtype": "float32"})


def test_check_chunk_returns_a_contiguous_chunk_and_names_what_does_not_fit():
    layout = ChunkLayout(layers=2, kv_heads=1, head_dim=4, dtype="float32")
    kv = np.zeros((2, 2, 1, 4, 7), dtype=np.float32).transpose(0, 1, 2, 4, 3)  # (2, 2, 1, 7, 4), not contiguous
    checked = check_chunk(layout, StoredChunk(bytes(CHUNK_KEY_BYTES), kv, "node"), 0)
    assert checked.kv.flags.c_contiguous and checked.length == 7 and checked.writer == "node"
    with pytest.raises(MapShapeError, match=r"chunk 4 \(0000.*\): kv must be .*float32.*\(2, 2, 1, 7, 5\)"):
        check_chunk(layout, StoredChunk(bytes(CHUNK_KEY_BYTES), np.zeros((2, 2, 1, 7, 5), np.float32)), 4)
    with pytest.raises(MapShapeError, match="chunk 2: key must be 32 bytes"):
        check_chunk(layout, StoredChunk(b"k", kv), 2)
