"""A map store on a disk that really fills up (a small tmpfs): every write fails cleanly as StoreFullError.

LMDB reports a write cut short by a full disk as EIO on commit, and a page of a
sparse lock file first touched on a full disk as SIGBUS; neither may escape as
anything but "the disk is full", and committed data must stay readable.
"""

from __future__ import annotations

import numpy as np
import pytest

from attnstore.errors import StoreFullError
from attnstore.store import LmdbMapStore
from attnstore.store.lmdb.env import list_generations
from tests.support.stores import fill_disk, make_entry, small_layout


def _fill_with_entries(store: LmdbMapStore, *, length: int = 48) -> dict[int, int]:
    """Ingest one entry per call until the disk is full; returns seed -> id of those stored."""
    stored: dict[int, int] = {}
    with pytest.raises(StoreFullError, match="the disk is full") as caught:
        for seed in range(10_000):
            stored[seed] = store.ingest("ns", [make_entry(small_layout(), length, seed)]).entry_ids[0]
    assert "nothing of the failed write is visible" in str(caught.value)
    assert str(caught.value.args[0]).count("/") == 0  # never the store's path: messages may reach clients
    return stored


def test_ingest_on_a_full_disk_is_store_full_and_committed_entries_stay_readable(small_tmpfs) -> None:
    with LmdbMapStore.open(small_tmpfs / "s", create=True, map_size=1 << 30) as store:
        store.create_namespace("ns", model="tiny", fingerprint="fp", layout=small_layout())
        stored = _fill_with_entries(store)
        assert len(stored) >= 10
        assert store.stats().entries == len(stored)
        for seed, entry_id in list(stored.items())[-3:]:
            np.testing.assert_array_equal(
                store.read_maps("ns", entry_id), make_entry(small_layout(), 48, seed).maps.astype(np.float16)
            )
        assert store.verify().ok


def test_creating_a_namespace_on_a_full_disk_is_store_full(small_tmpfs) -> None:
    with LmdbMapStore.open(small_tmpfs / "s", create=True, map_size=1 << 30) as store:
        filler = fill_disk(small_tmpfs)
        with pytest.raises(StoreFullError, match="the disk is full"):
            for n in range(1000):  # one may still fit in pages LMDB has free
                store.create_namespace(f"ns{n}", model="tiny", fingerprint="fp", layout=small_layout())
        filler.unlink()
        store.create_namespace("after", model="tiny", fingerprint="fp", layout=small_layout())


def test_compaction_without_room_for_the_copy_is_refused_before_writing(small_tmpfs) -> None:
    with LmdbMapStore.open(small_tmpfs / "s", create=True, map_size=1 << 30) as store:
        store.create_namespace("ns", model="tiny", fingerprint="fp", layout=small_layout())
        ids = store.ingest("ns", [make_entry(small_layout(), 48, seed) for seed in range(100)]).entry_ids
        fill_disk(small_tmpfs, leave=1 << 20)
        live = store.generation
        with pytest.raises(StoreFullError, match="too full to compact"):
            store.compact()
        assert list_generations(small_tmpfs / "s") == [live] and store.generation == live
        np.testing.assert_array_equal(
            store.read_maps("ns", ids[-1]), make_entry(small_layout(), 48, 99).maps.astype(np.float16)
        )


def test_compaction_on_a_100_percent_full_disk_fails_cleanly_without_a_signal(small_tmpfs) -> None:
    # The space check passes (the store is small); the disk is then filled completely. Before the
    # lock file was allocated up front, LMDB's first touch of its reader table page was a SIGBUS.
    with LmdbMapStore.open(small_tmpfs / "s", create=True, map_size=1 << 30) as store:
        store.create_namespace("ns", model="tiny", fingerprint="fp", layout=small_layout())
        ids = store.ingest("ns", [make_entry(small_layout(), 16, seed) for seed in range(5)]).entry_ids
        fill_disk(small_tmpfs)
        live = store.generation
        with pytest.raises(StoreFullError, match="disk"):
            store.compact()
        assert list_generations(small_tmpfs / "s") == [live]  # the half-written copy is gone
        assert store.read_maps("ns", ids[0]).shape[-1] == 16
