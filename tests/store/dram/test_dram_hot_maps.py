"""HotMaps: the DRAM cache in front of a backend, and its admission of served maps on the second serve."""

from __future__ import annotations

import numpy as np

from attnstore.store.dram.hot_maps import SERVED_HISTORY, HotMaps

LAYERS, HEADS, LENGTH = 2, 2, 4


def _load_maps(namespace: str, entry_id: int) -> np.ndarray:
    return np.full((LAYERS, HEADS, LENGTH, LENGTH), entry_id, dtype=np.float16)  # (layers, heads, L, L)


def _serve(hot: HotMaps, entry_id: int) -> np.ndarray:
    """Read every layer as the servicer does, then report the entry served."""
    layers = [
        hot.layer("ns", entry_id, layer, lambda layer=layer: _load_maps("ns", entry_id)[layer])
        for layer in range(LAYERS)
    ]
    hot.served("ns", [entry_id])
    assert hot.wait_prefetch(10)
    return np.stack(layers)


def test_a_served_entry_is_admitted_on_its_second_serve_and_read_from_dram_on_the_third() -> None:
    hot = HotMaps(_load_maps, capacity_bytes=1 << 20, prefetch_queue=16)
    try:
        _serve(hot, 7)
        assert hot.stats().entries == 0  # one serve: only remembered
        _serve(hot, 7)
        assert hot.stats().entries == 1
        hits = hot.stats().hits
        np.testing.assert_array_equal(_serve(hot, 7), _load_maps("ns", 7))
        assert hot.stats().hits == hits + LAYERS
    finally:
        hot.close()


def test_entries_served_once_each_are_never_admitted_and_the_history_is_bounded() -> None:
    hot = HotMaps(_load_maps, capacity_bytes=1 << 20, prefetch_queue=16)
    try:
        hot.served("ns", range(1, SERVED_HISTORY + 2))  # entry 1 falls out of the history
        hot.served("ns", [1])  # remembered again, pushing out entry 2
        assert hot.wait_prefetch(10)
        assert hot.stats().entries == 0
        hot.served("ns", [3])
        assert hot.wait_prefetch(10)
        assert hot.stats().entries == 1
    finally:
        hot.close()


def test_without_a_dram_tier_serves_admit_nothing() -> None:
    hot = HotMaps(_load_maps, capacity_bytes=0, prefetch_queue=16)
    try:
        for _ in range(3):
            _serve(hot, 7)
        assert hot.stats().entries == 0
    finally:
        hot.close()
