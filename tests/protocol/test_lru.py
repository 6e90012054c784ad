"""The shared byte-bounded LRU: what the store's DRAM cache and the node's local exact tier both keep."""

from __future__ import annotations

import threading

import numpy as np

from attnstore.protocol.lru import ByteLRU


def _array(nbytes: int) -> np.ndarray:
    return np.zeros(nbytes, dtype=np.uint8)


def test_least_recently_used_arrays_leave_first_once_the_bytes_would_pass_the_cap():
    lru: ByteLRU[str] = ByteLRU(300)
    for key in "abc":
        assert lru.put(key, _array(100))
    assert lru.get("a") is not None  # now the most recently used
    assert lru.put("d", _array(100))
    assert "b" not in lru and {"a", "c", "d"} <= {k for k in "abcd" if k in lru}
    counts = lru.counts()
    assert (counts.entries, counts.bytes, counts.evictions, counts.hits, counts.misses) == (3, 300, 1, 1, 0)


def test_an_array_larger_than_the_cap_is_rejected_and_counted_and_a_zero_cap_keeps_nothing():
    lru: ByteLRU[str] = ByteLRU(100)
    assert not lru.put("big", _array(101))
    assert lru.counts().rejected == 1 and lru.get("big") is None and lru.counts().misses == 1
    assert not ByteLRU(0).put("x", _array(1))


def test_replacing_a_key_counts_its_bytes_once_and_discard_and_clear_keep_the_counters():
    lru: ByteLRU[str] = ByteLRU(1000)
    lru.put("a", _array(100))
    lru.put("a", _array(300))
    assert lru.counts().bytes == 300 and len(lru) == 1
    lru.get("a")
    assert lru.discard(["a", "missing"]) == 1
    lru.put("b", _array(10))
    lru.clear()
    counts = lru.counts()
    assert (counts.bytes, counts.entries, counts.hits) == (0, 0, 1)


def test_concurrent_gets_and_puts_never_pass_the_cap():
    lru: ByteLRU[int] = ByteLRU(50 * 64)

    def work(seed: int) -> None:
        for i in range(500):
            key = (seed * 7 + i) % 120
            if lru.get(key) is None:
                lru.put(key, _array(64))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    counts = lru.counts()
    assert counts.bytes == 64 * counts.entries <= 50 * 64
    assert counts.hits + counts.misses == 2000
