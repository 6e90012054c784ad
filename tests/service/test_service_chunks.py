"""The service's chunk calls: an admin's (trusted) put may record a namespace's chunk layout, a writer's may not;
every chunk is filed under the key its token ids and context give, admitted by the rule, recorded with its writer
and removed with it; puts are all or nothing and count duplicates; requests of another model or chunk layout, or
an encoder namespace, are refused naming both (in-memory store)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from attnstore.errors import FingerprintMismatchError, MapShapeError
from attnstore.index import ExactIndex
from attnstore.protocol.chunks import ChunkLayout, StoredChunk
from attnstore.protocol.keys import chunk_key
from attnstore.service import AttnStoreService
from attnstore.service.admission import AdmissionConfig
from attnstore.service.put_rules import PutCaller
from attnstore.store import MemoryMapStore
from tests.support.stores import small_layout

FP = "f" * 64
LAYOUT = ChunkLayout(layers=3, kv_heads=1, head_dim=3, dtype="float32")
CONTEXT = np.array([1, 2, 3])
WRITER = PutCaller(writer="node-a", trusted=False)


def _chunk(seed: int, length: int) -> StoredChunk:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1000, size=length)
    return StoredChunk(chunk_key(CONTEXT, ids), rng.standard_normal((3, *LAYOUT.layer_shape(length))).astype(
        np.float32), token_ids=ids, context_ids=CONTEXT)


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
    bad = dataclasses.replace(_chunk(2, 2), kv=np.full((3, *LAYOUT.layer_shape(2)), np.inf, dtype=np.float32))
    with pytest.raises(MapShapeError, match="not finite"):
        service.chunks.put("ns", FP, LAYOUT, [_chunk(0, 3), bad])
    with pytest.raises(MapShapeError, match="does not fit"):
        service.chunks.put("ns", FP, LAYOUT, [StoredChunk(b"\2" * 32, np.zeros((3, 2, 1, 0, 3), np.float32))])
    assert service.chunks.layout("ns") is None  # nothing stored, not even the layout


def test_a_chunk_under_a_key_its_token_ids_do_not_give_or_without_ids_is_refused(service):
    chunk = _chunk(0, 3)
    with pytest.raises(MapShapeError, match=f"key {(b'9' * 32).hex()} is not the one its token ids give"):
        service.chunks.put("ns", FP, LAYOUT, [dataclasses.replace(chunk, key=b"9" * 32)])
    with pytest.raises(MapShapeError, match="not the one its token ids give"):  # the same ids after no context
        service.chunks.put("ns", FP, LAYOUT, [dataclasses.replace(chunk, context_ids=None)])
    with pytest.raises(MapShapeError, match="carries no token ids"):
        service.chunks.put("ns", FP, LAYOUT, [dataclasses.replace(chunk, token_ids=None)])
    with pytest.raises(MapShapeError, match="2 token ids for keys and values of 3 tokens"):
        service.chunks.put("ns", FP, LAYOUT, [dataclasses.replace(chunk, token_ids=chunk.token_ids[:2])])
    assert service.chunks.layout("ns") is None


def test_a_layout_is_the_models_a_writer_cannot_record_one_and_an_encoder_takes_none(service):
    made_up = ChunkLayout(layers=1, kv_heads=1, head_dim=1, dtype="float32")
    with pytest.raises(FingerprintMismatchError, match="records no chunk layout"):
        service.chunks.put("ns", FP, LAYOUT, [_chunk(0, 3)], WRITER)
    with pytest.raises(FingerprintMismatchError, match="3 layers.*layers=1"):
        service.chunks.set_layout("ns", made_up)
    service.create_namespace("enc", model="tiny", fingerprint=FP, layout=small_layout(causal=False))
    with pytest.raises(FingerprintMismatchError, match="bidirectional"):
        service.chunks.put("enc", FP, LAYOUT, [_chunk(0, 3)])
    assert (service.chunks.layout("ns"), service.chunks.layout("enc")) == (None, None)


def test_another_model_or_chunk_layout_is_refused_naming_both(service):
    service.chunks.put("ns", FP, LAYOUT, [_chunk(0, 3)])
    with pytest.raises(FingerprintMismatchError, match="fingerprint"):
        service.chunks.lengths("ns", "e" * 64, LAYOUT, [b"\0" * 32])
    other = ChunkLayout(layers=3, kv_heads=1, head_dim=3, dtype="float16")
    with pytest.raises(FingerprintMismatchError, match="dtype='float32'.*dtype='float16'"):
        service.chunks.check_request("ns", FP, other)
    with pytest.raises(FingerprintMismatchError):
        service.chunks.put("ns", FP, other, [])  # no chunks, still another layout: refused


def test_a_writers_chunks_are_stored_once_admitted_and_drop_writer_removes_them_alone(service):
    service.chunks.set_layout("ns", LAYOUT)
    service.use_admission(AdmissionConfig(admit_after=2))
    mine, theirs = _chunk(0, 3), _chunk(1, 2)
    service.chunks.put("ns", FP, LAYOUT, [theirs], PutCaller(writer="admin"))  # trusted: no asks needed
    service.chunks.lengths("ns", FP, LAYOUT, [mine.key], caller="node-a")
    assert service.chunks.put("ns", FP, LAYOUT, [mine], WRITER).not_admitted == 1
    service.chunks.lengths("ns", FP, LAYOUT, [mine.key], caller="node-b")
    result = service.chunks.put("ns", FP, LAYOUT, [mine, theirs], WRITER)
    assert (result.stored, result.duplicates, result.not_admitted) == (1, 1, 0)
    assert service.chunks.drop_writer("ns", "node-a", dry_run=True) == 1
    assert service.chunks.drop_writer("ns", "node-a") == 1
    assert service.chunks.lengths("ns", FP, LAYOUT, [mine.key, theirs.key]) == [None, 2]
