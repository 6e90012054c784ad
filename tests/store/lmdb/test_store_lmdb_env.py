"""Store directory and generations: CURRENT swaps, holders, removal only when unheld."""

from __future__ import annotations

import pytest

from attnstore.errors import StoreNotFoundError, StoreOpenError
from attnstore.store.lmdb.env import (
    Generation,
    acquire_writer_lock,
    list_generations,
    next_generation_name,
    read_current,
    release_lock,
    remove_unused_generations,
    write_current,
)


def test_generations_are_numbered_and_current_is_swapped_atomically(tmp_path):
    assert next_generation_name(tmp_path) == "gen-000001"
    for name in ("gen-000001", "gen-000010", "gen-000002"):
        (tmp_path / name).mkdir()
    assert list_generations(tmp_path) == ["gen-000001", "gen-000002", "gen-000010"]
    assert next_generation_name(tmp_path) == "gen-000011"
    with pytest.raises(StoreNotFoundError):
        read_current(tmp_path)
    write_current(tmp_path, "gen-000002")
    assert read_current(tmp_path) == "gen-000002"
    assert not (tmp_path / "CURRENT.tmp").exists()


def test_a_generation_is_removed_only_when_no_one_holds_it(tmp_path):
    held = Generation(tmp_path, "gen-000001", map_size=1 << 20, readonly=False, create=True)
    current = Generation(tmp_path, "gen-000002", map_size=1 << 20, readonly=False, create=True)
    assert remove_unused_generations(tmp_path, keep="gen-000002") == []
    held.acquire()
    held.release()
    assert (tmp_path / "gen-000001").exists()  # one reference left
    held.release()
    assert remove_unused_generations(tmp_path, keep="gen-000002") == ["gen-000001"]
    current.release()


def test_a_released_generation_refuses_new_references(tmp_path):
    gen = Generation(tmp_path, "gen-000001", map_size=1 << 20, readonly=False, create=True)
    gen.release()
    with pytest.raises(StoreOpenError, match="closed"):
        gen.acquire()


def test_the_writer_lock_admits_one_holder(tmp_path):
    fd = acquire_writer_lock(tmp_path)
    with pytest.raises(StoreOpenError, match="open for writing elsewhere"):
        acquire_writer_lock(tmp_path)
    release_lock(fd)
    release_lock(acquire_writer_lock(tmp_path))
