"""Compaction keeps every live entry and id, drops the rest, and swaps generations safely."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import zarr

from attnstore.protocol.prefix import PrefixBlock, PrefixLayout, chain_hashes
from attnstore.store import LmdbMapStore
from attnstore.store.lmdb.env import list_generations, read_current
from tests.support.stores import make_entry, small_layout


@pytest.fixture
def store(tmp_path):
    with LmdbMapStore.open(tmp_path / "s", create=True) as store:
        yield store


def _fill(store: LmdbMapStore) -> dict[tuple[str, int], object]:
    live = {}
    for codec in ("fp16", "q8+zstd"):
        name = codec.replace("+", "-")
        store.create_namespace(name, model="tiny", fingerprint="fp", layout=small_layout(codec))
        batch = [make_entry(small_layout(codec), length, seed) for seed, length in enumerate([5, 9, 5, 17, 9, 5, 30])]
        ids = store.ingest(name, batch).entry_ids
        live.update({(name, i): e for i, e in zip(ids, batch, strict=True)})
    return live


def test_compaction_keeps_every_live_entry_and_id(store):
    live = _fill(store)
    before = {key: store.read_maps(*key) for key in live}
    doomed = [("fp16", 1), ("fp16", 4), ("q8-zstd", 9)]
    for name, entry_id in doomed:
        store.delete(name, [entry_id])
        del before[(name, entry_id)]
    store.record_hits("fp16", [2, 2, 3])
    infos = {key: store.entry(*key) for key in before}

    report = store.compact()

    assert report.entries == len(before) and report.new_generation != report.old_generation
    for key, maps in before.items():
        assert np.array_equal(store.read_maps(*key), maps)
        assert store.entry(*key) == infos[key]
        np.testing.assert_array_equal(store.entry(*key).token_ids, live[key].token_ids)
        assert store.find_by_hash(key[0], infos[key].token_hash) == key[1]
    for name, entry_id in doomed:
        with pytest.raises(KeyError):
            store.read_maps(name, entry_id)
    assert store.verify().ok
    assert {n.name: n.entries for n in store.stats().namespaces} == {"fp16": 5, "q8-zstd": 6}
    (new_id,) = store.ingest("fp16", [make_entry(small_layout(), 5, seed=99)]).entry_ids
    assert new_id == 15  # the id counter carries over: deleted ids are never handed out again


def test_compaction_swaps_current_and_removes_the_old_generation(store, tmp_path):
    _fill(store)
    report = store.compact()
    assert read_current(tmp_path / "s") == report.new_generation == store.generation
    assert list_generations(tmp_path / "s") == [report.new_generation]
    store.ingest("fp16", [make_entry(small_layout(), 5, seed=50)])  # the new generation is writable


def test_a_reader_holding_the_old_generation_keeps_working_until_it_closes(store, tmp_path):
    live = _fill(store)
    key, entry = next(iter(live.items()))
    zstore = store.zarr_store()  # holds the current generation open
    old = store.generation
    store.delete("fp16", [2, 3])
    store.compact()
    assert old in list_generations(tmp_path / "s")
    root = zarr.open_group(store=zstore, mode="r")  # still the old generation, deleted entries included
    assert root[f"fp16/maps/L{entry.maps.shape[-1]}"][0].shape == entry.maps.shape
    assert root["fp16/maps/L9"].shape[0] == 64
    zstore.close()
    assert list_generations(tmp_path / "s") == [store.generation]


def test_another_process_keeps_reading_across_a_compaction(store, tmp_path):
    live = _fill(store)
    key, entry = next(iter(live.items()))
    expected = store.read_maps(*key)
    store.close()
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: a read-only store opened before the compaction
        status = 1
        try:
            with LmdbMapStore.open(tmp_path / "s", readonly=True) as reader:
                ok = np.array_equal(reader.read_maps(*key), expected)
                os.write(to_parent_w, f"{reader.generation} {ok}\n".encode())
                os.read(to_child_r, 1)  # wait for the compaction
                ok = np.array_equal(reader.read_maps(*key), expected)
                os.write(to_parent_w, f"{reader.generation} {ok}\n".encode())
            status = 0
        finally:
            os._exit(status)
    try:
        first = os.read(to_parent_r, 100).decode().split()
        with LmdbMapStore.open(tmp_path / "s") as writer:
            report = writer.compact()
            assert first == [report.old_generation, "True"]
            assert report.old_generation in list_generations(tmp_path / "s")  # held by the child
            os.write(to_child_w, b"g")
            second = os.read(to_parent_r, 100).decode().split()
            assert second == [report.new_generation, "True"]
            assert os.waitpid(pid, 0)[1] == 0
            pid = 0
        with LmdbMapStore.open(tmp_path / "s") as again:
            assert list_generations(tmp_path / "s") == [again.generation]
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_a_generation_left_by_a_killed_compaction_is_counted_in_stats_and_removed_at_open(tmp_path):
    root = tmp_path / "s"
    with LmdbMapStore.open(root, create=True) as store:
        _fill(store)
        live = store.generation
    # What a SIGKILL mid-compaction leaves: a newer generation directory CURRENT never named.
    leftover = root / "gen-000099"
    leftover.mkdir()
    (leftover / "data.mdb").write_bytes((root / live / "data.mdb").read_bytes()[: 64 << 10])
    with LmdbMapStore.open(root, readonly=True) as reader:  # a reader removes nothing: it only reports
        stats = reader.stats()
        assert (stats.stale_generations, stats.stale_generation_bytes) == (1, 64 << 10)
    with LmdbMapStore.open(root) as store:  # the writer removes it as it opens
        assert list_generations(root) == [live]
        stats = store.stats()
        assert (stats.stale_generations, stats.stale_generation_bytes) == (0, 0)


def test_prefix_blocks_survive_compaction_and_are_read_by_a_read_only_opening(tmp_path):
    layout = PrefixLayout(block_size=4, layers=3, kv_heads=2, head_dim=5, hidden=6, dtype="float32")
    rng = np.random.default_rng(0)
    hashes = chain_hashes(list(range(8)), layout.block_size)
    blocks = [
        PrefixBlock(h, hashes[i - 1] if i else None,
                    rng.standard_normal((layout.layers, *layout.layer_shape)).astype(layout.dtype),
                    rng.standard_normal((layout.block_size, layout.hidden)).astype(layout.dtype))
        for i, h in enumerate(hashes)
    ]
    path = tmp_path / "store"
    with LmdbMapStore.open(path, create=True) as store:
        store.create_namespace("ns", model="tiny", fingerprint="f" * 64, layout=small_layout())
        store.prefixes.set_layout("ns", layout)
        store.prefixes.put("ns", blocks)
        store.compact()
        assert store.prefixes.match("ns", hashes) == 2
    with LmdbMapStore.open(path, readonly=True) as reader:
        assert reader.prefixes.layout("ns") == layout
        assert np.array_equal(reader.prefixes.read_hidden("ns", [hashes[0]]), blocks[0].hidden)
