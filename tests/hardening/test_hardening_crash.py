"""The daemon SIGKILLed mid-ingest and mid-Lookup-stream: nothing committed is lost, nothing partial shows.

A real daemon subprocess on a real LMDB store is killed while client threads
ingest (fast commits, and one stream held open without its commit) or while a
Lookup stream is half sent. A daemon restarted on the same store must serve
every entry whose Ingest returned, serve each stream in flight at the kill
either whole or not at all, keep the open stream's entries invisible, and pass
verify.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from attnstore.errors import AttnStoreError, UnavailableError
from attnstore.protocol.records import LookupBatch
from attnstore.protocol.requests import ingest_requests, lookup_request
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.store import NamespaceLayout, NewEntry
from attnstore_client.connection.daemon import DaemonClient
from attnstore_tools.admin.train_projector import fetch_maps
from tests.support.daemon import DaemonProcess
from tests.support.server_fixtures import FP, LAYOUT
from tests.support.stores import make_entry
from tests.support.wait import wait_until

LENGTH = 96  # big enough that a commit takes a while, small enough to ingest many per second
ROUNDS = 2


def _entry(seed: int) -> NewEntry:
    return make_entry(LAYOUT, LENGTH, seed)


class _Writers:
    """Client threads ingesting 2-entry batches until the daemon goes away, and one stream held open."""

    def __init__(self, target: str, token: str, first_seed: int, threads: int = 3) -> None:
        self.committed: dict[int, int] = {}  # seed -> entry id, for every Ingest that returned
        self.in_flight: dict[int, list[int]] = {}  # thread -> seeds of the batch sent but not answered
        self.open_stream_seeds = [first_seed + 1_000_000, first_seed + 1_000_001]
        self._lock = threading.Lock()
        self._seeds = itertools.count(first_seed, 1)
        self._target, self._token = target, token
        self._open_sent = threading.Event()
        self._joined = threading.Event()  # the test is done with the writers: the held stream may end
        self._threads = [threading.Thread(target=self._write, args=(i,)) for i in range(threads)]
        self._threads.append(threading.Thread(target=self._hold_open))

    def start(self) -> _Writers:
        for thread in self._threads:
            thread.start()
        return self

    def wait_for_progress(self, batches: int, timeout: float = 30.0) -> None:
        wait_until(lambda: len(self.committed) >= 2 * batches and self._open_sent.is_set(), timeout,
                   lambda: f"{batches} batches committed and the open stream sent (committed: {len(self.committed)}"
                           f" entries, open stream sent: {self._open_sent.is_set()})")

    def join(self) -> None:
        self._joined.set()
        for thread in self._threads:
            thread.join(30)
            assert not thread.is_alive()

    def _write(self, index: int) -> None:
        with DaemonClient(self._target, token=self._token, timeout=20) as remote:
            while True:
                with self._lock:
                    seeds = [next(self._seeds), next(self._seeds)]
                    self.in_flight[index] = seeds
                try:
                    summary = remote.ingest("ns", FP, [_entry(s) for s in seeds])
                except AttnStoreError:
                    return  # the daemon is gone; the batch stays "in flight"
                with self._lock:
                    self.committed.update(zip(seeds, summary.entry_ids, strict=True))
                    del self.in_flight[index]

    def _hold_open(self) -> None:
        def messages() -> Iterator[pb.IngestRequest]:
            yield from ingest_requests("ns", FP, [_entry(s) for s in self.open_stream_seeds], commit=False)
            self._open_sent.set()
            self._joined.wait(60)  # never commits: the kill lands while the daemon stages this stream

        with DaemonClient(self._target, token=self._token, timeout=60) as remote:
            try:
                remote.stub.Ingest(messages(), metadata=remote.metadata, timeout=60)
            except Exception:
                pass


def _exact_ids(remote: DaemonClient, seeds: list[int]) -> dict[int, int]:
    """Seeds whose entry the exact tier finds, with its id."""
    entries = [_entry(s) for s in seeds]
    batch = LookupBatch("ns", FP, np.stack([e.feature for e in entries]), [LENGTH] * len(seeds),
                        token_hashes=[e.token_hash for e in entries], max_distance=0.0)
    request = lookup_request(batch, want_maps=False)
    result = remote.lookup(request)
    return {s: m.entry_id for s, m in zip(seeds, result.matches, strict=True) if m.kind == pb.MATCH_KIND_EXACT}


def _check_restarted(remote: DaemonClient, writers: _Writers) -> dict[int, int]:
    """Every committed entry served intact, in-flight batches all-or-nothing; returns every stored seed."""
    stored = _exact_ids(remote, list(writers.committed))
    assert stored == writers.committed, "a committed entry is gone or moved"
    for seeds in writers.in_flight.values():
        landed = _exact_ids(remote, seeds)
        assert len(landed) in (0, len(seeds)), f"batch {seeds} is only partly visible: {landed}"
        stored.update(landed)
    assert not _exact_ids(remote, writers.open_stream_seeds), "an uncommitted stream's entry is visible"
    assert remote.stats().entries == len(stored)
    ids = list(stored.values())
    maps = fetch_maps(remote, "ns", FP, ids)
    for seed, array in zip(stored, maps, strict=True):
        np.testing.assert_array_equal(array, _entry(seed).maps.astype(np.float16))
    report = remote.verify()
    assert report.entries_checked == len(stored) and not report.corrupt and report.orphan_chunks == 0
    return stored


def test_sigkill_mid_ingest_keeps_every_committed_entry_and_shows_no_partial_one(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path / "store", tmp_path).start()
    try:
        with daemon.client() as remote:
            remote.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
        stored: dict[int, int] = {}
        for round_ in range(ROUNDS):
            writers = _Writers(daemon.target, "admin-token-0123456789abcdef", first_seed=round_ * 10_000).start()
            writers.wait_for_progress(batches=3 + round_ * 5)
            daemon.kill()  # SIGKILL: no drain, no close
            writers.join()
            assert writers.in_flight, "the kill should land with batches in flight"
            writers.committed.update(stored)
            daemon.start()
            with daemon.client() as remote:
                stored = _check_restarted(remote, writers)
        assert len(stored) >= 16  # both rounds did real work
    finally:
        daemon.kill()


def test_sigkill_mid_lookup_stream_fails_the_client_fast_and_the_restart_serves_the_entry(tmp_path: Path) -> None:
    # 16 rows of one 8-layer entry of 4 heads x 256^2 fp16: 64 MiB, far more than is in flight at the kill.
    layout = NamespaceLayout(layers=8, heads=4, causal=True, hidden=8, feature_dim=16)
    source = make_entry(layout, 256, 1)
    entry = NewEntry(maps=source.maps.astype(np.float16), token_hash=source.token_hash, feature=source.feature)
    batch = LookupBatch("big", FP, np.repeat(entry.feature[None], 16, 0), [256] * 16, max_distance=0.01)
    request = lookup_request(batch)
    daemon = DaemonProcess(tmp_path / "store", tmp_path).start()
    try:
        with daemon.client() as remote:
            remote.create_namespace("big", model="tiny-synthetic", fingerprint=FP, layout=layout)
            remote.ingest("big", FP, [entry])
            stream = remote.iter_lookup(request, timeout=60)
            assert next(stream).WhichOneof("body") == "matches" and next(stream).WhichOneof("body") == "maps"
            daemon.kill()
            start = time.monotonic()
            with pytest.raises(UnavailableError):
                for _ in stream:
                    pass
            assert time.monotonic() - start < 10
        daemon.start()
        with daemon.client() as remote:
            result = remote.lookup(request)
            assert not result.row_errors and sorted(result.maps) == list(range(16))
            np.testing.assert_array_equal(result.maps[15], entry.maps)
            report = remote.verify()
            assert report.entries_checked == 1 and not report.corrupt
    finally:
        daemon.kill()
