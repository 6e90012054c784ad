"""LmdbMapStore on real LMDB files: persistence, format versions, locks, full map, hits, tiers."""

from __future__ import annotations

import json
import shutil
import sys
import threading

import lmdb
import numpy as np
import pytest

from attnstore.errors import (
    FormatVersionError,
    ReadOnlyStoreError,
    StoreFullError,
    StoreNotFoundError,
    StoreOpenError,
)
from attnstore.store import LmdbMapStore, MapStoreBase
from attnstore.store.dram.cache import DramCache
from attnstore.store.lmdb.env import list_generations, read_current
from tests.support.mapped import resident_bytes
from tests.support.stores import make_entry, small_layout


def _open(path, dram_bytes: int = 0, **kwargs) -> MapStoreBase:
    """The LMDB store at ``path``, behind a DRAM cache of ``dram_bytes`` (0: none)."""
    store = LmdbMapStore.open(path, create=True, **kwargs)
    return DramCache(store, dram_bytes=dram_bytes) if dram_bytes else store


def _with_namespace(store: LmdbMapStore, codec: str = "fp16") -> str:
    store.create_namespace("ns", model="tiny", fingerprint="fp", layout=small_layout(codec))
    return "ns"


def test_entries_persist_and_ids_continue_after_reopen(tmp_path):
    with _open(tmp_path / "s") as store:
        ns = _with_namespace(store)
        entry = make_entry(small_layout(), 7, seed=1)
        ids = store.ingest(ns, [entry, make_entry(small_layout(), 7, seed=2)]).entry_ids
        store.delete(ns, [ids[1]])
    with LmdbMapStore.open(tmp_path / "s") as store:
        assert np.array_equal(store.read_maps(ns, ids[0]), entry.maps.astype(np.float16))
        assert store.ingest(ns, [make_entry(small_layout(), 7, seed=3)]).entry_ids == [3]


def test_opening_a_missing_store_without_create_raises(tmp_path):
    with pytest.raises(StoreNotFoundError, match="create=True"):
        LmdbMapStore.open(tmp_path / "nothing")


def _poke(store_path, db_name: bytes, key: bytes, value: bytes) -> None:
    env = lmdb.open(str(store_path / read_current(store_path)), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(key, value, db=env.open_db(db_name, txn=txn))
    env.close()


def test_a_store_of_unknown_format_version_is_refused(tmp_path):
    _open(tmp_path / "s").close()
    _poke(tmp_path / "s", b"meta", b"format_version", b"99")
    with pytest.raises(FormatVersionError, match="format version 99"):
        LmdbMapStore.open(tmp_path / "s")


def test_a_namespace_of_unknown_format_version_is_refused(tmp_path):
    with _open(tmp_path / "s") as store:
        _with_namespace(store)
    env = lmdb.open(str(tmp_path / "s" / read_current(tmp_path / "s")), max_dbs=16)
    with env.begin(write=True) as txn:
        catalog = env.open_db(b"catalog", txn=txn)
        record = json.loads(txn.get(b"ns", db=catalog))
        txn.put(b"ns", json.dumps({**record, "format_version": 7}).encode(), db=catalog)
    env.close()
    with LmdbMapStore.open(tmp_path / "s") as store, pytest.raises(FormatVersionError, match="version 7"):
        store.get_namespace("ns")


def test_a_second_writer_is_refused(tmp_path):
    with _open(tmp_path / "s"), pytest.raises(StoreOpenError, match="open for writing"):
        LmdbMapStore.open(tmp_path / "s")


def test_a_readonly_store_reads_and_refuses_writes(tmp_path):
    with _open(tmp_path / "s") as store:
        ns = _with_namespace(store)
        (entry_id,) = store.ingest(ns, [make_entry(small_layout(), 5, seed=1)]).entry_ids
    with LmdbMapStore.open(tmp_path / "s", readonly=True) as store:
        assert store.read_maps(ns, entry_id).shape == (3, 2, 5, 5)
        with pytest.raises(ReadOnlyStoreError):
            store.ingest(ns, [make_entry(small_layout(), 5, seed=2)])
        with pytest.raises(ReadOnlyStoreError):
            store.delete(ns, [entry_id])
        store.record_hits(ns, [entry_id])  # kept in memory, never written
        assert store.entry(ns, entry_id).hits == 1


def test_a_full_map_raises_store_full_and_leaves_nothing_of_the_batch(tmp_path):
    layout = small_layout()
    with _open(tmp_path / "s", map_size=1 << 20) as store:
        ns = _with_namespace(store)
        stored = []
        with pytest.raises(StoreFullError, match="full"):
            for seed in range(200):
                batch = [make_entry(layout, 64, seed=2 * seed), make_entry(layout, 64, seed=2 * seed + 1)]
                stored += store.ingest(ns, batch).entry_ids
        assert stored  # some batches fit before the map filled
        assert store.stats().entries == len(stored)
        assert store.find_by_hash(ns, batch[0].token_hash) is None
        assert store.verify().ok


def test_hits_are_buffered_flushed_by_count_and_on_close(tmp_path):
    with _open(tmp_path / "s", hit_flush_count=3, hit_flush_seconds=3600) as store:
        ns = _with_namespace(store)
        a, b, c = store.ingest(ns, [make_entry(small_layout(), 4, seed=s) for s in range(3)]).entry_ids
        store.record_hits(ns, [a, a])
        assert store.stats().pending_hits == 1
        store.record_hits(ns, [b, c])  # three distinct entries pending: flushed
        assert store.stats().pending_hits == 0
        store.record_hits(ns, [a])
        assert store.entry(ns, a).hits == 3
    with LmdbMapStore.open(tmp_path / "s") as store:
        assert [store.entry(ns, i).hits for i in (a, b, c)] == [3, 1, 1]


def test_dram_cache_serves_repeated_reads_and_forgets_deleted_entries(tmp_path):
    layout = small_layout()
    with _open(tmp_path / "s", dram_bytes=3 * layout.map_nbytes(16)) as store:
        ns = _with_namespace(store)
        ids = store.ingest(ns, [make_entry(layout, 16, seed=s) for s in range(4)]).entry_ids
        for entry_id in ids:
            store.read_maps(ns, entry_id)
        store.read_maps(ns, ids[-1])
        dram = store.stats().dram
        assert (dram.entries, dram.hits, dram.misses, dram.evictions) == (3, 1, 4, 1)
        assert dram.bytes == 3 * layout.map_nbytes(16)
        store.delete(ns, [ids[-1]])
        assert store.stats().dram.entries == 2


def test_prefetch_loads_entries_into_the_dram_cache_in_the_background(tmp_path):
    with _open(tmp_path / "s", dram_bytes=1 << 30) as store:
        ns = _with_namespace(store, "zstd")
        entries = [make_entry(small_layout("zstd"), 12, seed=s) for s in range(5)]
        ids = store.ingest(ns, entries).entry_ids
        store.prefetch(ns, ids + [999])  # an unknown id is logged, not raised
        assert store.wait_prefetch(timeout=10)
        assert store.stats().dram.entries == 5
        for entry_id, entry in zip(ids, entries, strict=True):
            assert np.array_equal(store.read_maps(ns, entry_id), entry.maps.astype(np.float16))
        assert store.stats().dram.hits == 5


def test_concurrent_readers_see_intact_entries_while_a_writer_ingests(tmp_path):
    layout = small_layout()
    with _open(tmp_path / "s") as store:
        ns = _with_namespace(store)
        entries = [make_entry(layout, 24, seed=s) for s in range(4)]
        ids = store.ingest(ns, entries).entry_ids
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                for i in range(60):
                    k = i % len(ids)
                    assert np.array_equal(store.read_maps(ns, ids[k]), entries[k].maps.astype(np.float16))
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        for seed in range(10, 30):
            store.ingest(ns, [make_entry(layout, 24, seed=seed)])
        for t in threads:
            t.join()
        assert not errors


def test_an_entrys_stored_objects_are_adjacent_in_key_order(tmp_path):
    layout = small_layout()
    with _open(tmp_path / "s") as store:
        ns = _with_namespace(store)
        store.ingest(ns, [make_entry(layout, 2, seed=s, outputs=False) for s in range(130)])
        with store._live.read() as (gen, txn):  # white-box: walk the zarr keys in LMDB order
            keys = [bytes(k).decode() for k in txn.cursor(db=gen.db.zarr).iternext(values=False)]
    slots = [int(k.split("/")[4]) for k in keys if k.startswith("ns/maps/L2/c/")]
    assert len(slots) == 130 * layout.layers
    runs = [s for i, s in enumerate(slots) if i == 0 or slots[i - 1] != s]
    assert len(runs) == len(set(runs)) == 130  # each slot's layers form one run


def test_an_old_generation_is_removed_at_open_when_nobody_holds_it(tmp_path):
    with _open(tmp_path / "s") as store:
        _with_namespace(store)
    (tmp_path / "s" / "gen-000009").mkdir()  # left behind by a crashed compaction
    with LmdbMapStore.open(tmp_path / "s") as store:
        assert list_generations(tmp_path / "s") == [store.generation]


def test_a_store_directory_removed_while_open_refuses_writes_and_is_never_recreated(tmp_path):
    with _open(tmp_path / "s") as store:
        ns = _with_namespace(store)
        entry_id = store.ingest(ns, [make_entry(small_layout(), 7, seed=1)]).entry_ids[0]
        assert store.storage_fault() is None
        shutil.rmtree(tmp_path / "s")
        assert "removed" in store.storage_fault()
        with pytest.raises(StoreNotFoundError, match="removed while it was open: writes are refused"):
            store.ingest(ns, [make_entry(small_layout(), 7, seed=2)])
        with pytest.raises(StoreNotFoundError, match="removed"):
            store.compact()
        assert store.read_maps(ns, entry_id).shape == (3, 2, 7, 7)  # reads serve what was open
    assert not (tmp_path / "s").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mapped pages are read from /proc/self/smaps")
def test_a_scan_of_a_read_only_store_leaves_none_of_its_pages_mapped_in_the_process(tmp_path):
    with _open(tmp_path / "s") as store:
        ns = _with_namespace(store)
        ids = store.ingest(ns, [make_entry(small_layout(), 40, seed=k) for k in range(600)]).entry_ids
    with LmdbMapStore.open(tmp_path / "s", readonly=True) as store:
        store.read_maps(ns, ids[0])  # a read maps pages, and nothing gives them back
        assert resident_bytes(tmp_path / "s", "data.mdb") > 0
        assert len(list(store.entries(ns))) == 600  # the scan drops what each page of records mapped
        assert resident_bytes(tmp_path / "s", "data.mdb") == 0
