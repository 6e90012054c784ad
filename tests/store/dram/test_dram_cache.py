"""DramCache: a wrapper store serving maps from DRAM in front of any store, and open_store putting one in front."""

from __future__ import annotations

import numpy as np
import pytest

from attnstore.errors import ConfigError, EntryNotFoundError, MapShapeError
from attnstore.store import MapStoreBase, MemoryMapStore
from attnstore.store.dram.cache import DramCache
from attnstore.store.opening import MEMORY_LOCATION, open_store
from tests.support.stores import make_entry, small_layout


def test_the_core_interface_has_at_most_fifteen_abstract_methods():
    assert len(MapStoreBase.__abstractmethods__) <= 15


def test_reads_come_from_dram_after_the_first_and_deleted_entries_leave_it():
    layout = small_layout()
    with DramCache(MemoryMapStore(), dram_bytes=1 << 20) as store:
        store.create_namespace("ns", model="tiny", fingerprint="fp", layout=layout)
        entries = [make_entry(layout, 8, seed=s) for s in range(2)]
        ids = store.ingest("ns", entries).entry_ids
        for _ in range(2):
            assert np.array_equal(store.read_maps("ns", ids[0]), entries[0].maps.astype(np.float16))
        assert np.array_equal(store.read_layer("ns", ids[0], 1), entries[0].maps[1].astype(np.float16))
        dram = store.stats().dram
        assert (dram.entries, dram.hits, dram.misses) == (1, 2, 1)
        with pytest.raises(MapShapeError, match="out of range"):
            store.read_layer("ns", ids[0], layout.layers)
        store.delete("ns", [ids[0]])  # the inner store tells the cache (on_removed)
        assert store.stats().dram.entries == 0
        with pytest.raises(EntryNotFoundError):
            store.read_maps("ns", ids[0])


def test_a_namespace_dropped_in_the_inner_store_leaves_dram():
    layout = small_layout()
    inner = MemoryMapStore()
    with DramCache(inner, dram_bytes=1 << 20) as store:
        store.create_namespace("ns", model="tiny", fingerprint="fp", layout=layout)
        (entry_id,) = store.ingest("ns", [make_entry(layout, 8, seed=1)]).entry_ids
        store.read_maps("ns", entry_id)
        inner.drop_namespace("ns")  # behind the cache's back
        assert store.stats().dram.entries == 0


def test_prefetch_queues_live_entries_and_counts_unknown_ones():
    layout = small_layout()
    with DramCache(MemoryMapStore(), dram_bytes=1 << 20) as store:
        store.create_namespace("ns", model="tiny", fingerprint="fp", layout=layout)
        ids = store.ingest("ns", [make_entry(layout, 8, seed=s) for s in range(3)]).entry_ids
        report = store.prefetch("ns", [*ids, 999, ids[0]])
        assert (report.queued, report.unknown) == (3, 1)
        assert store.wait_prefetch(timeout=10)
        assert store.stats().dram.entries == 3


def test_the_cache_offers_the_inner_stores_parts_and_capabilities():
    inner = MemoryMapStore()
    store = DramCache(inner, dram_bytes=1 << 20)
    assert store.inner is inner and store.prefixes is inner.prefixes and store.chunks is inner.chunks
    assert store.supports_compaction == inner.supports_compaction
    assert store.supports_change_feed == inner.supports_change_feed
    with pytest.raises(ConfigError, match="dram_bytes"):
        DramCache(inner, dram_bytes=0)


def test_open_store_puts_a_dram_cache_in_front_unless_told_not_to(tmp_path):
    with open_store(tmp_path / "a", create=True).store as cached:
        assert isinstance(cached, DramCache) and cached.stats().dram.capacity_bytes == 1 << 30
    with open_store(tmp_path / "b", create=True, dram_bytes=0).store as plain:
        assert not isinstance(plain, DramCache) and plain.stats().dram.capacity_bytes == 0
    with pytest.raises(ConfigError, match="dram_bytes"):
        open_store(tmp_path / "c", create=True, dram_bytes=-1)
    assert isinstance(open_store(MEMORY_LOCATION).store, MemoryMapStore)
