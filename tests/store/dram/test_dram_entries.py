"""DRAM cache: byte-bounded LRU with stats, read-only entries and a discard epoch."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from attnstore.store.dram.entries import DramEntries


def _array(nbytes: int, fill: int = 0) -> np.ndarray:
    return np.full(nbytes, fill, dtype=np.uint8)


def test_least_recently_used_entries_are_evicted_to_stay_under_capacity():
    tier = DramEntries(300)
    for key in "abc":
        assert tier.put(key, _array(100))
    assert tier.get("a") is not None  # a is now the most recently used
    assert tier.put("d", _array(100))
    assert "b" not in tier and "a" in tier and "d" in tier
    stats = tier.stats()
    assert (stats.entries, stats.bytes, stats.evictions, stats.hits, stats.misses) == (3, 300, 1, 1, 0)


def test_an_entry_larger_than_the_capacity_is_rejected_and_counted():
    tier = DramEntries(100)
    assert not tier.put("big", _array(101))
    assert tier.stats().rejected == 1 and tier.get("big") is None and tier.stats().misses == 1


def test_cached_arrays_are_read_only():
    tier = DramEntries(100)
    tier.put("a", _array(10))
    with pytest.raises(ValueError):
        tier.get("a")[0] = 1


def test_a_put_loaded_before_a_discard_is_refused():
    tier = DramEntries(1000)
    epoch = tier.epoch
    tier.discard(["x"])  # e.g. the entry was deleted while being loaded
    assert not tier.put("x", _array(10), epoch)
    assert tier.put("x", _array(10), tier.epoch)


def test_replacing_a_key_keeps_the_byte_count_right():
    tier = DramEntries(1000)
    tier.put("a", _array(100))
    tier.put("a", _array(300))
    assert tier.stats().bytes == 300
    tier.clear()
    assert tier.stats().bytes == 0 and tier.stats().entries == 0


def test_concurrent_puts_and_gets_keep_the_accounting_consistent():
    tier = DramEntries(50 * 64)

    def work(offset: int) -> None:
        for i in range(500):
            key = (offset + i) % 120
            if tier.get(key) is None:
                tier.put(key, _array(64, key % 256))

    threads = [threading.Thread(target=work, args=(n * 7,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = tier.stats()
    assert stats.bytes == 64 * stats.entries <= 50 * 64
    assert stats.hits + stats.misses == 2000
