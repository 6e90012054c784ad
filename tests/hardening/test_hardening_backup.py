"""Backup while serving: ``attnstore backup`` copies a store under a daemon that keeps ingesting."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from attnstore.errors import AttnStoreError, ConfigError
from attnstore.store import LmdbMapStore
from attnstore.store.lmdb.compaction import backup_store
from attnstore_tools.cli import main as cli_main
from tests.support.daemon import DaemonProcess
from tests.support.server_fixtures import FP, LAYOUT
from tests.support.stores import make_entry
from tests.support.wait import wait_until

LENGTH = 24


def test_backup_under_live_ingest_is_a_consistent_store_that_verifies(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path / "store", tmp_path).start()
    committed: dict[int, int] = {}  # seed -> id, as the Ingest calls returned
    stop = threading.Event()

    def ingest_until_stopped() -> None:
        with daemon.client() as remote:
            seed = 0
            while not stop.is_set():
                (entry_id,) = remote.ingest("ns", FP, [make_entry(LAYOUT, LENGTH, seed)]).entry_ids
                committed[seed] = entry_id
                seed += 1

    try:
        with daemon.client() as remote:
            remote.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
            remote.ingest("ns", FP, [make_entry(LAYOUT, LENGTH, 10_000)])
        writer = threading.Thread(target=ingest_until_stopped)
        writer.start()
        try:

            def five_committed() -> bool:
                assert writer.is_alive(), "the writer stopped"
                return len(committed) >= 5

            wait_until(five_committed, 30, "five ingests committed", poll=0.01)
            before = dict(committed)
            assert cli_main(["backup", "--store", str(daemon.store), "--to", str(tmp_path / "copy")]) == 0
            after = dict(committed)
        finally:
            stop.set()
            writer.join(30)
    finally:
        daemon.stop()
    with LmdbMapStore.open(tmp_path / "copy", readonly=True) as copy:
        report = copy.verify()
        assert report.ok and report.orphan_objects == 0
        copied = {e.id: e for e in copy.entries("ns")}
        by_hash = {make_entry(LAYOUT, LENGTH, s).token_hash: s for s in after}
        assert set(before.values()) <= set(copied)  # everything committed before the copy began
        assert set(copied) <= set(after.values()) | {1}  # and nothing nobody committed
        for entry_id, info in copied.items():
            if entry_id != 1:
                seed = by_hash[info.token_hash]
                np.testing.assert_array_equal(copy.read_maps("ns", entry_id),
                                              make_entry(LAYOUT, LENGTH, seed).maps.astype(np.float16))


def test_backup_refuses_a_destination_that_is_not_empty(tmp_path: Path) -> None:
    with LmdbMapStore.open(tmp_path / "store", create=True):
        pass
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        backup_store(tmp_path / "store", tmp_path / "busy")
    with pytest.raises(AttnStoreError, match="no map store"):
        backup_store(tmp_path / "missing", tmp_path / "new")
