"""Prefetcher: one background worker loads queued entries, errors are counted, never raised."""

from __future__ import annotations

import threading

from attnstore.errors import EntryNotFoundError
from attnstore.store.dram.prefetch import Prefetcher


def test_queued_entries_are_loaded_on_a_background_thread():
    loaded, threads = [], set()

    def load(namespace: str, entry_id: int) -> None:
        threads.add(threading.current_thread().name)
        loaded.append((namespace, entry_id))

    prefetcher = Prefetcher(load)
    assert prefetcher.submit("ns", [1, 2, 3]) == 3
    assert prefetcher.wait(timeout=5)
    prefetcher.close()
    assert loaded == [("ns", 1), ("ns", 2), ("ns", 3)]
    assert threads == {"attnstore-prefetch"} and prefetcher.loaded == 3


def test_failed_loads_are_counted_and_the_worker_keeps_going():
    def load(namespace: str, entry_id: int) -> None:
        if entry_id == 2:
            raise EntryNotFoundError("gone")
        if entry_id == 3:
            raise RuntimeError("a bug")

    prefetcher = Prefetcher(load)
    prefetcher.submit("ns", [1, 2, 3, 4])
    assert prefetcher.wait(timeout=5)
    prefetcher.close()
    assert (prefetcher.loaded, prefetcher.failed) == (2, 2)


def test_submissions_beyond_the_queue_limit_are_dropped():
    gate = threading.Event()
    prefetcher = Prefetcher(lambda ns, i: gate.wait(5), max_queue=2)
    queued = prefetcher.submit("ns", range(10))
    gate.set()
    assert prefetcher.wait(timeout=5)
    prefetcher.close()
    assert queued + prefetcher.dropped == 10 and prefetcher.dropped >= 7


def test_close_stops_the_worker_and_later_submissions_are_ignored():
    prefetcher = Prefetcher(lambda ns, i: None)
    prefetcher.submit("ns", [1])
    prefetcher.close()
    assert prefetcher.submit("ns", [2]) == 0
    assert prefetcher.wait(timeout=1)
