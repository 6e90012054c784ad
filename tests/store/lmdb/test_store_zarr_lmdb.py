"""zarr opens the map store through LMDBZarrStore and reads exactly what the store wrote."""

from __future__ import annotations

import asyncio

import lmdb
import numpy as np
import pytest
import zarr
from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype

from attnstore.errors import StoreNotFoundError
from attnstore.store import LmdbMapStore, LMDBZarrStore, open_zarr
from tests.support.stores import make_entry, small_layout


@pytest.fixture
def filled(tmp_path):
    store = LmdbMapStore.open(tmp_path / "s", create=True)
    entries = {}
    for codec in ("fp16", "zstd", "q8", "q8+zstd"):
        name = codec.replace("+", "-")
        store.create_namespace(name, model="tiny", fingerprint="fp", layout=small_layout(codec))
        batch = [make_entry(small_layout(codec), length, seed) for seed, length in enumerate([6, 11, 6])]
        entries[name] = list(zip(store.ingest(name, batch).entry_ids, batch, strict=True))
    yield store, entries
    store.close()


def _slot_of(store: LmdbMapStore, name: str, entry_id: int, length: int) -> int:
    ids = [e.id for e in store.entries(name, length=length)]
    return ids.index(entry_id)  # slots are handed out in id order within a bucket


def test_zarr_reads_the_maps_and_outputs_the_store_wrote(filled):
    store, entries = filled
    with store.zarr_store() as zstore:
        root = zarr.open_group(store=zstore, mode="r")
        for name in ("fp16", "zstd"):
            for entry_id, entry in entries[name]:
                length = entry.maps.shape[-1]
                slot = _slot_of(store, name, entry_id, length)
                maps = root[f"{name}/maps/L{length}"][slot]
                assert maps.dtype == np.float16
                assert np.array_equal(maps, store.read_maps(name, entry_id))
                outputs = root[f"{name}/outputs/L{length}"][slot]
                assert np.array_equal(outputs, store.read_outputs(name, entry_id))


def test_zarr_reads_q8_codes_and_scales_that_dequantise_to_the_stored_maps(filled):
    store, entries = filled
    with store.zarr_store() as zstore:
        root = zarr.open_group(store=zstore, mode="r")
        for name in ("q8", "q8-zstd"):
            for entry_id, entry in entries[name]:
                length = entry.maps.shape[-1]
                slot = _slot_of(store, name, entry_id, length)
                codes = root[f"{name}/maps/L{length}"][slot]  # (layers, heads, L, L) uint8
                scales = root[f"{name}/scales/L{length}"][slot]  # (layers, heads, L) fp16
                assert codes.dtype == np.uint8 and scales.dtype == np.float16
                values = (codes * scales.astype(np.float32)[..., None]).astype(np.float16)
                assert np.array_equal(values, store.read_maps(name, entry_id))


def test_zarr_sees_the_hierarchy_metadata_and_grown_capacity(filled):
    store, _ = filled
    store.ingest("fp16", [make_entry(small_layout(), 3, seed=100 + s, outputs=False) for s in range(70)])
    with store.zarr_store() as zstore:
        root = zarr.open_group(store=zstore, mode="r")
        assert root.attrs["attnstore_format_version"] == 1
        assert root["fp16"].attrs["attnstore_namespace"]["layout"]["codec"] == "fp16"
        grown = root["fp16/maps/L3"]
        assert grown.shape == (128, 3, 2, 3, 3) and grown.chunks == (1, 1, 2, 3, 3)
        last = [e.id for e in store.entries("fp16", length=3)][-1]
        assert np.array_equal(grown[69], store.read_maps("fp16", last))


def test_open_path_reads_a_closed_store_from_its_directory(filled, tmp_path):
    store, entries = filled
    entry_id, entry = entries["fp16"][1]
    expected = store.read_maps("fp16", entry_id)
    store.close()
    zstore = LMDBZarrStore.open_path(tmp_path / "s")
    try:
        root = zarr.open_group(store=zstore, mode="r")
        assert np.array_equal(root["fp16/maps/L11"][0], expected)
    finally:
        zstore.close()


@pytest.fixture
def scratch(tmp_path):
    env = lmdb.open(str(tmp_path / "env"), max_dbs=2, map_size=1 << 24)
    db = env.open_db(b"zarr")
    yield LMDBZarrStore(env, db, read_only=False)
    env.close()


def _run(coro):
    return asyncio.run(coro)


def test_store_api_get_set_delete_list_and_byte_ranges(scratch):
    proto = default_buffer_prototype()
    buf = proto.buffer.from_bytes
    for key in ("a/zarr.json", "a/b/c/0", "a/b/c/1", "a/bc", "d"):
        _run(scratch.set(key, buf(key.encode())))
    assert _run(scratch.get("a/b/c/0", proto)).to_bytes() == b"a/b/c/0"
    assert _run(scratch.get("a/b/c/0", proto, RangeByteRequest(2, 4))).to_bytes() == b"b/"
    assert _run(scratch.get("a/b/c/0", proto, OffsetByteRequest(4))).to_bytes() == b"c/0"
    assert _run(scratch.get("a/b/c/0", proto, SuffixByteRequest(1))).to_bytes() == b"0"
    assert _run(scratch.get("missing", proto)) is None
    assert _run(scratch.exists("d")) and not _run(scratch.exists("e"))
    assert _run(scratch.getsize("a/bc")) == 4

    async def collect(gen):
        return sorted([k async for k in gen])

    assert _run(collect(scratch.list_dir("a"))) == ["b", "bc", "zarr.json"]
    assert _run(collect(scratch.list_dir(""))) == ["a", "d"]
    assert _run(collect(scratch.list_prefix("a/b/"))) == ["a/b/c/0", "a/b/c/1"]
    _run(scratch.delete("d"))
    assert _run(collect(scratch.list())) == ["a/b/c/0", "a/b/c/1", "a/bc", "a/zarr.json"]
    with pytest.raises(ValueError, match="read-only"):
        _run(scratch.with_read_only(True).set("x", buf(b"1")))


def test_open_zarr_finds_entry_n_by_id_with_zarr_alone(filled, tmp_path):
    store, entries = filled
    store.delete("fp16", [entries["fp16"][0][0]])  # its slot now reads as zeros: id 0 marks it unused
    wanted_id, wanted = entries["fp16"][2]
    expected = store.read_maps("fp16", wanted_id)
    store.close()
    group = open_zarr(tmp_path / "s")  # the README's one-liner
    try:
        found = []
        for name, slots in group["fp16/entry_ids"].arrays():
            ids = slots[:]
            assert ids.dtype == np.uint64 and ids.shape == (group[f"fp16/maps/{name}"].shape[0],)
            found += [(name, int(slot)) for slot in np.flatnonzero(ids == wanted_id)]
        assert found == [("L6", 1)]
        assert np.array_equal(group["fp16/maps/L6"][1], expected)
        assert group["fp16/entry_ids/L6"][0] == 0  # the deleted entry's slot
        assert sorted(group["fp16/entry_ids/L11"][:].tolist())[-1] == entries["fp16"][1][0]
    finally:
        group.store.close()


def test_open_zarr_of_a_missing_store_names_the_path(tmp_path):
    with pytest.raises(StoreNotFoundError, match="nowhere"):
        open_zarr(tmp_path / "nowhere")
