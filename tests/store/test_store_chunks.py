"""Chunk entries in every store backend that keeps them (``store.chunks``): one suite for all."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

from attnstore.errors import (
    ChecksumError,
    ConfigError,
    EntryNotFoundError,
    FingerprintMismatchError,
    MapShapeError,
    NamespaceNotFoundError,
    StoreFullError,
)
from attnstore.protocol.chunks import ChunkLayout, StoredChunk
from attnstore.store import MapStoreBase
from tests.support.stores import make_entry, small_layout
from tests.support.wait import wait_until

LAYOUT = ChunkLayout(layers=3, kv_heads=2, head_dim=4, dtype="float32")
CHUNK_BYTES = LAYOUT.chunk_bytes(5)  # 960: a chunk of 5 tokens


def _key(i: int) -> bytes:
    return hashlib.sha256(f"chunk {i}".encode()).digest()


def _chunk(i: int, length: int = 5, layout: ChunkLayout = LAYOUT, writer: str | None = "node-a") -> StoredChunk:
    rng = np.random.default_rng(i)
    kv = rng.standard_normal((layout.layers, *layout.layer_shape(length))).astype(layout.dtype)
    return StoredChunk(_key(i), kv, writer)


def _tick() -> None:
    """Return once the clock the stores stamp a chunk's last use with (``time.time``) has moved on: the next put
    or read is stamped later than the last, so the least recently used order is the order of the calls."""
    stamp = time.time()
    wait_until(lambda: time.time() > stamp, 1, "the wall clock past the last stamp", poll=0.0001)


def _open(make_store, max_bytes: int | None = None) -> MapStoreBase:
    store = make_store(max_bytes)
    if store.chunks is None:
        backend = type(getattr(store, "inner", store)).__name__
        pytest.skip(f"{backend} keeps no chunk entries (store.chunks is None)")
    store.create_namespace("ns", model="tiny", fingerprint="f" * 64, layout=small_layout())
    store.chunks.set_layout("ns", LAYOUT)
    return store


@pytest.fixture
def store(make_store) -> MapStoreBase:
    """Every backend that stores chunks (``make_store``, tests/store/conftest.py), namespace ``ns`` laid out."""
    return _open(make_store)


def test_chunks_round_trip_every_layer_and_the_whole_chunk(store):
    chunks = [_chunk(0), _chunk(1, length=9), _chunk(2, length=1)]
    assert store.chunks.put("ns", chunks) == 3
    for chunk in chunks:
        whole = store.chunks.read("ns", chunk.key)
        assert whole.dtype == np.float32 and np.array_equal(whole, chunk.kv)  # (layers, 2, KVH, C, d)
        for layer in range(LAYOUT.layers):
            assert np.array_equal(store.chunks.read_layer("ns", chunk.key, layer), chunk.kv[layer])
    assert store.chunks.lengths("ns", [_key(1), _key(7), _key(2)]) == [9, None, 1]
    assert store.chunks.layout("ns") == LAYOUT


def test_fp16_chunks_round_trip_in_fp16(make_store):
    store = make_store()
    if store.chunks is None:
        backend = type(getattr(store, "inner", store)).__name__
        pytest.skip(f"{backend} keeps no chunk entries (store.chunks is None)")
    store.create_namespace("half", model="tiny", fingerprint="f" * 64, layout=small_layout())
    half = ChunkLayout(layers=2, kv_heads=1, head_dim=8, dtype="float16")
    store.chunks.set_layout("half", half)
    chunk = _chunk(3, length=4, layout=half)
    store.chunks.put("half", [chunk])
    read = store.chunks.read_layer("half", chunk.key, 1)
    assert read.dtype == np.float16 and np.array_equal(read, chunk.kv[1])


def test_a_stored_key_is_kept_as_it_is_and_a_key_given_twice_is_stored_once(store):
    first = _chunk(0)
    assert store.chunks.put("ns", [first, StoredChunk(first.key, _chunk(9).kv)]) == 1
    assert store.chunks.put("ns", [StoredChunk(first.key, _chunk(8).kv), _chunk(1)]) == 1
    assert np.array_equal(store.chunks.read("ns", first.key), first.kv)
    assert store.stats().chunk_entries == 2


def test_another_layout_is_refused_and_its_own_again_changes_nothing(store):
    assert store.chunks.set_layout("ns", LAYOUT) == LAYOUT
    for other in (ChunkLayout(4, 2, 4, "float32"), ChunkLayout(3, 2, 4, "float16")):
        with pytest.raises(FingerprintMismatchError):
            store.chunks.set_layout("ns", other)
    assert store.chunks.layout("ns") == LAYOUT
    with pytest.raises(ConfigError, match="ChunkLayout"):
        store.chunks.set_layout("ns", LAYOUT.to_dict())


def test_a_namespace_without_a_chunk_layout_stores_none_and_refuses_chunks(store):
    store.create_namespace("bare", model="tiny", fingerprint="f" * 64, layout=small_layout())
    assert store.chunks.layout("bare") is None
    assert store.chunks.lengths("bare", [_key(0)]) == [None]
    assert store.chunks.delete("bare", [_key(0)]) == 0
    with pytest.raises(FingerprintMismatchError, match="bare"):
        store.chunks.put("bare", [_chunk(0)])
    with pytest.raises(FingerprintMismatchError, match="bare"):
        store.chunks.read("bare", _key(0))
    with pytest.raises(NamespaceNotFoundError):
        store.chunks.set_layout("nowhere", LAYOUT)
    with pytest.raises(NamespaceNotFoundError):
        store.chunks.lengths("nowhere", [_key(0)])


def test_a_chunk_of_another_shape_dtype_or_key_is_refused_by_position_and_nothing_is_written(store):
    good = _chunk(0)
    bad = {
        "kv must be": StoredChunk(_key(1), good.kv[:2]),  # a layer short
        "float32": StoredChunk(_key(2), good.kv.astype(np.float16)),
        "'C >= 1'": StoredChunk(_key(3), good.kv[:, :, :, :0]),
        "key must be 32 bytes": StoredChunk(b"short", good.kv),
        "writer": StoredChunk(_key(4), good.kv, writer=7),  # type: ignore[arg-type]
        "must be a StoredChunk": good.kv,
    }
    for match, chunk in bad.items():
        with pytest.raises(MapShapeError, match=f"chunk 1.*{match}|chunk 1 must be"):
            store.chunks.put("ns", [good, chunk])
    assert store.chunks.lengths("ns", [good.key]) == [None]
    with pytest.raises(MapShapeError, match="chunk key 0"):
        store.chunks.lengths("ns", [b"x" * 31])
    with pytest.raises(MapShapeError, match="layer must be in 0..2"):
        store.chunks.read_layer("ns", good.key, 3)


def test_a_missing_chunk_is_entry_not_found(store):
    with pytest.raises(EntryNotFoundError, match=_key(5).hex()):
        store.chunks.read_layer("ns", _key(5), 0)


def test_a_damaged_chunk_fails_its_read_naming_it_and_verify_names_it(store, make_store):
    chunks = [_chunk(0), _chunk(1)]
    store.chunks.put("ns", chunks)
    assert store.verify().ok
    make_store.corrupt_chunk_layer(store, "ns", chunks[1].key, 2)
    with pytest.raises(ChecksumError, match=f"chunk {chunks[1].key.hex()} of namespace 'ns': layer 2"):
        store.chunks.read_layer("ns", chunks[1].key, 2)
    with pytest.raises(ChecksumError, match=chunks[1].key.hex()):
        store.chunks.read("ns", chunks[1].key)
    assert np.array_equal(store.chunks.read_layer("ns", chunks[1].key, 1), chunks[1].kv[1])  # other layers sound
    report = store.verify()
    assert not report.ok and report.chunks.checked == 2
    assert [(c.namespace, c.key) for c in report.chunks.corrupt] == [("ns", chunks[1].key.hex())]
    assert "layer 2" in report.chunks.corrupt[0].reason and report.to_dict()["chunks"]["corrupt"]


def test_a_damaged_chunk_record_fails_reads_is_not_matched_is_named_by_verify_and_deletes(store, make_store):
    if make_store.cut_chunk_record is None:
        pytest.skip("this backend keeps records as objects, not bytes")
    chunks = [_chunk(0), _chunk(1)]
    store.chunks.put("ns", chunks)
    make_store.cut_chunk_record(store, "ns", chunks[1].key)
    with pytest.raises(ChecksumError, match=f"chunk {chunks[1].key.hex()} of namespace 'ns': its record is damaged"):
        store.chunks.read("ns", chunks[1].key)
    assert store.chunks.lengths("ns", [c.key for c in chunks]) == [5, None]  # computed where a prompt needs it
    assert store.chunks.writer_of("ns", chunks[1].key) == (True, None)  # stored, its writer unknown
    report = store.verify()
    assert not report.ok and report.chunks.checked == 2
    assert [(c.namespace, c.key) for c in report.chunks.corrupt] == [("ns", chunks[1].key.hex())]
    assert "record is damaged" in report.chunks.corrupt[0].reason
    assert store.chunks.delete("ns", [chunks[1].key]) == 1
    assert store.verify().ok and store.stats().chunk_bytes == CHUNK_BYTES  # its layers went with it
    assert np.array_equal(store.chunks.read("ns", chunks[0].key), chunks[0].kv)


def test_a_damaged_chunk_record_is_evicted_first_however_recent(make_store):
    store = _open(make_store, max_bytes=3 * CHUNK_BYTES + 120)
    if make_store.cut_chunk_record is None:
        pytest.skip("this backend keeps records as objects, not bytes")
    for i in range(3):
        store.chunks.put("ns", [_chunk(i)])
        _tick()
    make_store.cut_chunk_record(store, "ns", _key(2))  # the most recent chunk
    assert store.chunks.put("ns", [_chunk(3)]) == 1  # over the cap: the damaged one goes, then the oldest
    assert store.chunks.lengths("ns", [_key(i) for i in range(4)]) == [None, 5, None, 5]
    assert store.stats().chunk_bytes == 2 * CHUNK_BYTES
    assert store.verify().ok


def test_delete_removes_chunks_and_counts_those_stored(store):
    store.chunks.put("ns", [_chunk(0), _chunk(1)])
    assert store.chunks.delete("ns", [_key(0), _key(0), _key(7)]) == 1
    assert store.chunks.lengths("ns", [_key(0), _key(1)]) == [None, 5]
    with pytest.raises(EntryNotFoundError):
        store.chunks.read("ns", _key(0))


def test_stats_count_chunks_and_their_bytes_per_namespace(store):
    store.create_namespace("other", model="tiny", fingerprint="f" * 64, layout=small_layout())
    store.chunks.set_layout("other", LAYOUT)
    store.chunks.put("ns", [_chunk(0), _chunk(1, length=9)])
    store.chunks.put("other", [_chunk(2)])
    stats = store.stats()
    by_name = {ns.name: (ns.chunk_entries, ns.chunk_bytes) for ns in stats.namespaces}
    assert by_name == {"ns": (2, CHUNK_BYTES + LAYOUT.chunk_bytes(9)), "other": (1, CHUNK_BYTES)}
    assert (stats.chunk_entries, stats.chunk_bytes) == (3, 2 * CHUNK_BYTES + LAYOUT.chunk_bytes(9))
    assert stats.to_dict()["namespaces"][0]["chunk_entries"] == 2


def test_dropping_the_namespace_removes_its_chunks_and_layout(store):
    store.chunks.put("ns", [_chunk(0)])
    store.drop_namespace("ns")
    assert store.stats().chunk_entries == 0
    store.create_namespace("ns", model="tiny", fingerprint="f" * 64, layout=small_layout())
    assert store.chunks.layout("ns") is None
    store.chunks.set_layout("ns", LAYOUT)
    assert store.chunks.lengths("ns", [_key(0)]) == [None]


def test_compaction_keeps_chunks(store):
    if not store.supports_compaction:
        pytest.skip("the store cannot compact")
    store.chunks.put("ns", [_chunk(0), _chunk(1)])
    store.chunks.delete("ns", [_key(1)])
    store.compact()
    assert np.array_equal(store.chunks.read("ns", _key(0)), _chunk(0).kv)
    assert store.chunks.lengths("ns", [_key(0), _key(1)]) == [5, None]
    assert store.chunks.layout("ns") == LAYOUT and store.verify().ok


def test_the_byte_cap_evicts_the_least_recently_read_chunks_first(make_store):
    store = _open(make_store, max_bytes=3 * CHUNK_BYTES + 120)
    for i in range(3):
        store.chunks.put("ns", [_chunk(i)])
        _tick()
    store.chunks.read_layer("ns", _key(0), 0)  # chunk 0 is now the most recently used
    _tick()
    assert store.chunks.put("ns", [_chunk(3)]) == 1  # over the cap: evicts down to 90% of it
    assert store.chunks.lengths("ns", [_key(i) for i in range(4)]) == [5, None, None, 5]
    assert store.stats().chunk_entries == 2


def test_chunks_larger_than_the_cap_are_refused_and_nothing_is_written(make_store):
    store = _open(make_store, max_bytes=2 * CHUNK_BYTES)
    store.chunks.put("ns", [_chunk(0)])
    with pytest.raises(StoreFullError, match="chunks"):
        store.chunks.put("ns", [_chunk(1), _chunk(2), _chunk(3)])
    assert store.chunks.lengths("ns", [_key(i) for i in range(4)]) == [5, None, None, None]


def test_an_ingest_over_the_cap_evicts_the_least_recently_used_chunks_and_keeps_the_entry(make_store):
    store = _open(make_store, max_bytes=3 * CHUNK_BYTES + 120)
    for i in range(3):
        store.chunks.put("ns", [_chunk(i)])
        _tick()
    store.chunks.read("ns", _key(0))
    _tick()
    report = store.ingest("ns", [make_entry(small_layout(), 8, seed=1)])  # 896 bytes of maps and outputs
    assert report.evicted == {}
    assert store.chunks.lengths("ns", [_key(i) for i in range(3)]) == [5, None, None]
    assert store.entry("ns", report.entry_ids[0]).length == 8


def test_writer_keys_names_the_chunks_a_writer_put_and_no_other(store):
    store.chunks.put("ns", [_chunk(0), _chunk(1, writer="node-b"), _chunk(2, writer=None), _chunk(3)])
    assert sorted(store.chunks.writer_keys("ns", "node-a")) == sorted([_key(0), _key(3)])
    assert store.chunks.writer_keys("ns", "node-c") == []
    with pytest.raises(ConfigError, match="non-empty"):
        store.chunks.writer_keys("ns", "")
    # What the quarantine reports of one chunk: stored, and its writer (None: an admin's build).
    assert [store.chunks.writer_of("ns", _key(i)) for i in range(3)] == [(True, "node-a"), (True, "node-b"),
                                                                          (True, None)]
    assert store.chunks.delete("ns", store.chunks.writer_keys("ns", "node-a")) == 2
    assert store.chunks.lengths("ns", [_key(0), _key(1), _key(2)]) == [None, 5, 5]
    assert store.chunks.writer_of("ns", _key(0)) == (False, None)
