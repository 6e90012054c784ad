"""Faults a running daemon must survive: a full store, a corrupted map entry, a stalled server, a dead thread.

Real daemon subprocesses on real LMDB stores, except the dead-thread test,
which runs the real ``Daemon`` in this process so it can reach the thread.
"""

from __future__ import annotations

import ctypes
import json
import logging
import re
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from attnstore.errors import StoreFullError, UnavailableError
from attnstore.protocol.records import LookupBatch
from attnstore.protocol.requests import ingest_requests, lookup_request
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.server.config import DaemonConfig
from attnstore.server.daemon import Daemon
from attnstore.store import NewEntry
from attnstore_client.connection.daemon import DaemonClient
from attnstore_tools.admin.train_projector import fetch_maps
from tests.support.daemon import DaemonProcess
from tests.support.pause import paused
from tests.support.server_fixtures import FP, LAYOUT
from tests.support.stores import fill_disk, make_entry
from tests.support.wait import wait_until


def _lookup(
    entries: list[NewEntry], length: int, *, token_hashes: list[bytes] | None = None, want_maps: bool = True
) -> pb.LookupRequest:
    features = np.stack([e.feature for e in entries])
    batch = LookupBatch("ns", FP, features, [length] * len(entries), token_hashes=token_hashes, max_distance=0.01)
    return lookup_request(batch, want_maps=want_maps)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("faults")
    process = DaemonProcess(workdir / "store", workdir).start()
    with process.client() as remote:
        remote.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
    yield process
    assert process.stop() == 0, process.log()  # corruption and a stall behind it, it still drains cleanly


# ---- disk full --------------------------------------------------------------


def test_full_store_refuses_ingest_with_resource_exhausted_and_stays_readable(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path / "store", tmp_path, extra_args=("--map-size", "1MiB")).start()
    try:
        with daemon.client() as remote:
            remote.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
            # One stream bigger than the whole map: refused as a whole, nothing written.
            with pytest.raises(StoreFullError, match="RESOURCE_EXHAUSTED"):
                remote.ingest("ns", FP, [make_entry(LAYOUT, 128, seed) for seed in range(1000, 1040)])
            assert remote.stats().entries == 0
            stored: dict[int, int] = {}
            with pytest.raises(grpc.RpcError) as caught:
                for seed in range(200):
                    messages = ingest_requests("ns", FP, [make_entry(LAYOUT, 32, seed)])
                    stored[seed] = remote.stub.Ingest(messages, metadata=remote.metadata, timeout=20).entry_ids[0]
            assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            details = caught.value.details()
            assert "is full" in details and "nothing of the failed write is visible" in details
            assert len(stored) >= 10
            assert remote.health() == "SERVING"
            assert remote.stats().entries == len(stored)
            maps = fetch_maps(remote, "ns", FP, list(stored.values()))
            for seed, array in zip(stored, maps, strict=True):
                np.testing.assert_array_equal(array, make_entry(LAYOUT, 32, seed).maps.astype(np.float16))
            report = remote.verify()
            assert report.entries_checked == len(stored) and not report.corrupt
            # The remedy the message names works: compact, delete, compact, ingest again.
            assert "compact first" in details
            remote.compact()
            assert remote.delete("ns", list(stored.values())[: len(stored) // 2]) == len(stored) // 2
            remote.compact()
            assert remote.ingest("ns", FP, [make_entry(LAYOUT, 32, 999)]).entries == 1
        assert "event=rpc_refused method=Ingest code=RESOURCE_EXHAUSTED" in daemon.log()
    finally:
        daemon.kill()


def test_full_disk_refuses_ingest_and_compaction_with_resource_exhausted_and_the_daemon_lives(
    small_tmpfs: Path, tmp_path: Path
) -> None:
    daemon = DaemonProcess(small_tmpfs / "store", tmp_path).start()
    try:
        with daemon.client() as remote:
            remote.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
            stored: dict[int, int] = {}
            with pytest.raises(grpc.RpcError) as caught:
                for seed in range(2000):
                    messages = ingest_requests("ns", FP, [make_entry(LAYOUT, 64, seed)])
                    stored[seed] = remote.stub.Ingest(messages, metadata=remote.metadata, timeout=20).entry_ids[0]
            assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, caught.value.details()
            details = caught.value.details()
            assert "the disk is full" in details and str(small_tmpfs) not in details
            assert len(stored) >= 10 and remote.health() == "SERVING"
            assert remote.stats().entries == len(stored)
            fill_disk(small_tmpfs)
            with pytest.raises(StoreFullError, match="RESOURCE_EXHAUSTED"):
                remote.compact()  # before: SIGBUS (exit 135) on a 100% full disk, INTERNAL with 2 MB free
            assert remote.health() == "SERVING" and remote.verify().entries_checked == len(stored)
            np.testing.assert_array_equal(
                fetch_maps(remote, "ns", FP, [stored[0]])[0], make_entry(LAYOUT, 64, 0).maps.astype(np.float16)
            )
        assert daemon.stop() == 0, daemon.log()
        assert "Traceback" not in daemon.log()
    finally:
        daemon.kill()


# ---- corruption ---------------------------------------------------------------


def _flip_byte_of(store: Path, needle: bytes) -> None:
    """Flip one byte in the middle of ``needle`` wherever it lies in the store's LMDB file (bit rot).

    Small values live in leaf pages that LMDB copies on write, so stale copies may
    sit in free pages too: every copy is flipped, the live one among them.
    """
    (data_file,) = store.glob("*/data.mdb")
    content = data_file.read_bytes()
    offsets = [m.start() for m in re.finditer(re.escape(needle), content)]
    assert offsets, "the stored object is not in the file"
    with data_file.open("r+b") as f:
        for offset in offsets:
            f.seek(offset + len(needle) // 2)
            f.write(bytes([content[offset + len(needle) // 2] ^ 0x40]))


def test_corrupted_map_entry_is_never_streamed_and_verify_reports_it(daemon: DaemonProcess) -> None:
    good, bad = make_entry(LAYOUT, 16, 500), make_entry(LAYOUT, 16, 501)
    with daemon.client() as remote:
        good_id, bad_id = remote.ingest("ns", FP, [good, bad]).entry_ids
        # Bit rot in layer 1 of the bad entry, under the live daemon (its map is the file's pages).
        _flip_byte_of(daemon.store, bad.maps[1].astype(np.float16).tobytes())
        messages = list(remote.iter_lookup(_lookup([good, bad], 16)))
        result = remote.lookup(_lookup([good, bad], 16))
        with pytest.raises(grpc.RpcError) as caught:
            list(remote.stub.Fetch(pb.FetchRequest(namespace="ns", fingerprint=FP, entry_ids=[bad_id]),
                                   metadata=remote.metadata, timeout=10))
        report = remote.verify()
    errors = [m.error for m in messages if m.WhichOneof("body") == "error"]
    assert [(e.query_index, e.entry_id, e.code) for e in errors] == [(1, bad_id, "DATA_LOSS")]
    bad_layers = [m.maps.layer for m in messages if m.WhichOneof("body") == "maps" and m.maps.query_index == 1]
    assert bad_layers == [0]  # layer 0 went out before the bad layer; the error tells the client to drop the row
    assert sorted(result.maps) == [0] and sorted(result.row_errors) == [1]
    np.testing.assert_array_equal(result.maps[0], good.maps.astype(np.float16))
    assert caught.value.code() is grpc.StatusCode.DATA_LOSS and "crc32c" in caught.value.details()
    # The module's daemon is shared: entries other tests corrupted may be reported too, this test's are exact.
    assert [c.entry_id for c in report.corrupt if c.entry_id in (good_id, bad_id)] == [bad_id]
    assert good_id not in report.corrupt_entry_ids
    assert "event=row_dropped" in daemon.log()


def test_corrupted_outputs_demote_an_exact_hit_to_a_miss(daemon: DaemonProcess) -> None:
    entry = make_entry(LAYOUT, 20, 510)
    with daemon.client() as remote:
        (entry_id,) = remote.ingest("ns", FP, [entry]).entry_ids
        _flip_byte_of(daemon.store, entry.outputs.astype(np.float16).tobytes())
        result = remote.lookup(_lookup([entry], 20, token_hashes=[entry.token_hash], want_maps=False))
        report = remote.verify()
    assert result.matches[0].kind == pb.MATCH_KIND_MISS and not result.outputs
    assert entry_id in report.corrupt_entry_ids
    assert "event=exact_hit_unreadable" in daemon.log()


# ---- stalled server -----------------------------------------------------------


def test_stalled_daemon_ends_calls_at_the_client_deadline(daemon: DaemonProcess) -> None:
    entry = make_entry(LAYOUT, 12, 520)
    with daemon.client() as remote:
        remote.ingest("ns", FP, [entry])
        with paused(daemon.process.pid):
            start = time.monotonic()
            with pytest.raises(UnavailableError, match="DEADLINE_EXCEEDED"):
                remote.lookup(_lookup([entry], 12), timeout=1.0)
            assert time.monotonic() - start < 3.0
        assert remote.health() == "SERVING"
        np.testing.assert_array_equal(remote.lookup(_lookup([entry], 12)).maps[0], entry.maps.astype(np.float16))


# ---- background thread dying ------------------------------------------------------


def _raise_in_thread(thread: threading.Thread, exc: type[BaseException]) -> None:
    """Raise ``exc`` inside ``thread`` at its next bytecode: an unexpected death, as an escaped BaseException."""
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc))
    assert done == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_dead_prefetch_thread_turns_health_not_serving_and_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ready = tmp_path / "ready.json"
    config = DaemonConfig(store=tmp_path / "store", listen="127.0.0.1:0", create=True, ready_file=ready,
                          metrics_port=0, grace_seconds=1.0)
    daemon = Daemon(config)
    runner = threading.Thread(target=daemon.run, kwargs={"handle_signals": False})
    caplog.set_level(logging.INFO, logger="attnstore.server.daemon")
    runner.start()
    try:

        def serving() -> bool:
            assert runner.is_alive(), "the daemon's thread ended before it served"
            return ready.exists()

        wait_until(serving, 30, "the daemon's ready file")
        info = json.loads(ready.read_text())
        entry = make_entry(LAYOUT, 8, 530)
        with DaemonClient(info["address"], timeout=10) as remote:
            remote.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
            (entry_id,) = remote.ingest("ns", FP, [entry]).entry_ids
            # This daemon's worker: a store another test of this process left open may have its own running.
            others = {t for t in threading.enumerate() if t.name == "attnstore-prefetch"}
            remote.prefetch("ns", [entry_id])  # starts the worker (before the call returns)
            (worker,) = (t for t in threading.enumerate() if t.name == "attnstore-prefetch" and t not in others)
            assert remote.health() == "SERVING"
            _raise_in_thread(worker, SystemExit)
            remote.stub.Prefetch(pb.PrefetchRequest(namespace="ns", entry_ids=[entry_id + 1]),
                                 metadata=remote.metadata, timeout=10)  # wakes it into the exception
            worker.join(10)
            assert not worker.is_alive()
            # Within the watchdog's period, with room for a loaded machine.
            wait_until(lambda: remote.health() == "NOT_SERVING", 15, "health NOT_SERVING", poll=0.05)
            assert remote.health("attnstore.v1.AttnStore") == "NOT_SERVING"
            # Degraded, not down: calls are still answered while the orchestrator restarts it.
            np.testing.assert_array_equal(remote.lookup(_lookup([entry], 8)).maps[0], entry.maps.astype(np.float16))
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{info['metrics_port']}/metrics", timeout=10).read().decode()
        assert re.search(r"^attnstore_serving 0\.0$", scrape, re.MULTILINE)
        assert any("event=background_thread_died threads=attnstore-prefetch" in r.getMessage()
                   for r in caplog.records if r.levelno == logging.ERROR)
    finally:
        daemon.request_stop()
        runner.join(30)
    assert not runner.is_alive()
