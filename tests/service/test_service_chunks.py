"""The service's chunk calls: a put gives a namespace its chunk layout, is all or nothing and counts duplicates;
requests of another model or chunk layout are refused naming both (in-memory store)."""

from __future__ import annotations

import numpy as np
import pytest

from attnstore.errors import FingerprintMismatchError, MapShapeError
from attnstore.index import ExactIndex
from attnstore.protocol.chunks import ChunkLayout, StoredChunk
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore
from tests.support.stores import small_layout

FP = "f" * 64
LAYOUT = ChunkLayout(layers=2, kv_heads=1, head_dim=3, dtype="float32")


def _chunk(seed: int, length: int) -> StoredChunk:
    rng = np.random.default_rng(seed)
    return StoredChunk(rng.bytes(32), rng.standard_normal((2, *LAYOUT.layer_shape(length))).astype(np.float32))


@pytest.fixture
def service() -> AttnStoreService:
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    service.create_namespace("ns", model="tiny", fingerprint=FP, layout=small_layout())
    return service


def test_a_put_sets_the_layout_stores_new_chunks_and_counts_the_rest_as_duplicates(service):
    assert service.chunks.layout("ns") is None
    first, second = _chunk(0, 3), _chunk(1, 1)
    result = service.chunks.put("ns", FP, LAYOUT, [first, first])
    assert (result.stored, result.duplicates, result.bytes) == (1, 1, first.kv.nbytes)
    assert service.chunks.layout("ns") == LAYOUT
    result = service.chunks.put("ns", FP, LAYOUT, [first, second])
    assert (result.stored, result.duplicates, result.bytes) == (1, 1, second.kv.nbytes)
    assert service.chunks.lengths("ns", FP, LAYOUT, [first.key, second.key, b"\0" * 32]) == [3, 1, None]
    assert np.array_equal(service.chunks.read("ns", second.key), second.kv)


def test_a_chunk_not_finite_or_unlike_the_layout_refuses_the_whole_put(service):
    bad = StoredChunk(b"\1" * 32, np.full((2, *LAYOUT.layer_shape(2)), np.inf, dtype=np.float32))
    with pytest.raises(MapShapeError, match="not finite"):
        service.chunks.put("ns", FP, LAYOUT, [_chunk(0, 3), bad])
    with pytest.raises(MapShapeError, match="does not fit"):
        service.chunks.put("ns", FP, LAYOUT, [StoredChunk(b"\2" * 32, np.zeros((2, 2, 1, 0, 3), np.float32))])
    assert service.chunks.layout("ns") is None  # nothing stored, not even the layout


def test_another_model_or_chunk_layout_is_refused_naming_both(service):
    service.chunks.put("ns", FP, LAYOUT, [_chunk(0, 3)])
    with pytest.raises(FingerprintMismatchError, match="fingerprint"):
        service.chunks.lengths("ns", "e" * 64, LAYOUT, [b"\0" * 32])
    other = ChunkLayout(layers=2, kv_heads=1, head_dim=3, dtype="float16")
    with pytest.raises(FingerprintMismatchError, match="dtype='float32'.*dtype='float16'"):
        service.chunks.check_request("ns", FP, other)
    with pytest.raises(FingerprintMismatchError):
        service.chunks.put("ns", FP, other, [])  # no chunks, still another layout: refused
