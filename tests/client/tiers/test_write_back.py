"""The write-back worker: batches rows to a real (in-process) daemon, never blocks, drops and counts on trouble."""

from __future__ import annotations

import logging
import socket
import threading
import time

import numpy as np
import pytest
import torch

from attnstore.errors import ConfigError
from attnstore.protocol.keys import token_hash
from attnstore.server.auth import TokenTable
from attnstore.server.server import create_server
from attnstore.service.admission import Admission, AdmissionConfig
from attnstore_client.connection import connect
from attnstore_client.connection.local import LocalConnection
from attnstore_client.tiers.write_back import WriteBackSettings, WriteBackWorker, start_write_back
from tests.support.server_fixtures import FP, LAYOUT, memory_service

READ, WRITE = "r" * 20, "w" * 20


def _rows(count: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 1000, size=6), rng.normal(size=(6, LAYOUT.hidden)).astype(np.float32))
            for _ in range(count)]


@pytest.fixture
def daemon():
    service = memory_service()
    service.admission = Admission(AdmissionConfig(admit_after=1))
    server, port = create_server(service, "127.0.0.1:0", tokens=TokenTable((("read", READ), ("write", WRITE))))
    server.start()
    yield service, f"grpc://127.0.0.1:{port}"
    server.stop(0)


def _admit(connection, rows) -> None:
    _, admitted = connection.exact_admitting("ns", FP, [token_hash(i) for i, _ in rows], [6] * len(rows),
                                             timeout=10.0)
    assert admitted == frozenset(range(len(rows)))


def test_queued_rows_reach_the_store_in_batches_and_are_counted(daemon) -> None:
    service, url = daemon
    rows = _rows(10)
    with connect(url, token=WRITE) as connection:
        _admit(connection, rows)
        worker = WriteBackWorker(connection, "ns", FP, WriteBackSettings(batch_rows=4))
        assert all(worker.put(ids, out) for ids, out in rows)
        assert worker.flush(10.0)
        stats = worker.stats()
        worker.close()
    assert (stats.queued, stats.stored, stats.pending, stats.disabled) == (10, 10, 0, None)
    assert 3 <= stats.calls <= 10
    assert service.write_backs.stats().entries == 10


def test_a_full_queue_drops_new_rows_without_blocking_and_counts_them() -> None:
    with socket.socket() as sock:  # a port nobody listens on: every call fails after its deadline
        sock.bind(("127.0.0.1", 0))
        url = f"grpc://127.0.0.1:{sock.getsockname()[1]}"
    with connect(url, token=WRITE) as connection:
        worker = WriteBackWorker(connection, "ns", FP, WriteBackSettings(max_queued=2, timeout=0.5))
        started = time.perf_counter()
        accepted = sum(worker.put(ids, out) for ids, out in _rows(50))
        assert time.perf_counter() - started < 0.5  # never waits for the store
        assert worker.flush(30.0)
        stats = worker.stats()
        worker.close()
    assert accepted <= 3 and stats.dropped_full == 50 - accepted
    assert stats.dropped_failed == accepted and stats.stored == 0


def test_a_read_token_turns_the_worker_off_with_one_warning(daemon, caplog: pytest.LogCaptureFixture) -> None:
    _, url = daemon
    with connect(url, token=READ) as connection, caplog.at_level(logging.WARNING):
        worker = WriteBackWorker(connection, "ns", FP, WriteBackSettings())
        for ids, out in _rows(3):
            worker.put(ids, out)
            worker.flush(10.0)
        stats = worker.stats()
        worker.close()
    assert stats.stored == 0 and stats.dropped_failed == 3
    assert stats.disabled is not None and "needs a write or admin token" in stats.disabled
    assert sum("write-back turned off" in r.message for r in caplog.records) == 1


def test_embedded_mode_refuses_write_back_with_a_clear_error() -> None:
    connection = LocalConnection("local:/nowhere", memory_service())
    assert start_write_back(connection, "ns", FP, False) is None
    with pytest.raises(ConfigError, match="write_back needs a daemon"):
        start_write_back(connection, "ns", FP, True)


def test_rows_with_maps_are_stored_with_them_and_maps_over_the_queue_budget_go_without(daemon) -> None:
    service, url = daemon
    rows = _rows(4, seed=5)
    causal = torch.tril(torch.ones(LAYOUT.layers, LAYOUT.heads, 6, 6))
    maps = (causal / causal.sum(-1, keepdim=True)).to(torch.float16)  # (layers, heads, 6, 6)
    with connect(url, token=WRITE) as connection:
        _admit(connection, rows)
        roomy = WriteBackWorker(connection, "ns", FP, WriteBackSettings())
        assert all(roomy.put(ids, out, maps) for ids, out in rows[:2])
        tight = WriteBackWorker(connection, "ns", FP, WriteBackSettings(max_queued_bytes=2 * maps.numel() - 1))
        assert all(tight.put(ids, out, maps) for ids, out in rows[2:])
        for worker in (roomy, tight):
            assert worker.flush(10.0)
            worker.close()
    assert (roomy.stats().queued_maps, roomy.stats().maps_stored, roomy.stats().stored) == (2, 2, 2)
    assert (tight.stats().maps_over_budget, tight.stats().maps_stored, tight.stats().stored) == (2, 0, 2)
    assert service.write_backs.stats().map_entries == 2


class _Broken:
    """A connection whose first write-back call fails with an error no handler foresaw, then works."""

    url = "broken://"
    supports_write_back = True

    def __init__(self, inner) -> None:
        self._inner = inner
        self.calls = 0

    def write_back(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("a bug in the connection")
        return self._inner.write_back(*args, **kwargs)


def test_an_unexpected_error_drops_its_batch_and_the_thread_goes_on(daemon, caplog: pytest.LogCaptureFixture) -> None:
    service, url = daemon
    first, second = _rows(3, seed=1), _rows(2, seed=2)
    with connect(url, token=WRITE) as connection:
        _admit(connection, first + second)
        broken = _Broken(connection)
        worker = WriteBackWorker(broken, "ns", FP, WriteBackSettings())  # type: ignore[arg-type]
        with caplog.at_level(logging.ERROR):
            assert all(worker.put(ids, out) for ids, out in first)
            assert worker.flush(10.0)  # returns: the thread did not die
        assert all(worker.put(ids, out) for ids, out in second)
        assert worker.flush(10.0)
        stats = worker.stats()
        worker.close()
    assert (stats.errors, stats.dropped_failed, stats.stored, stats.pending) == (1, 3, 2, 0)
    assert "failed unexpectedly" in caplog.text and "a bug in the connection" in caplog.text


def test_a_row_whose_outputs_overflow_fp16_is_dropped_alone_and_the_rest_of_its_batch_stored(daemon) -> None:
    service, url = daemon
    rows = _rows(4, seed=3)
    rows[1][1][0, 0] = 1e6  # past fp16's range: inf once stored as fp16
    with connect(url, token=WRITE) as connection:
        _admit(connection, rows)
        worker = WriteBackWorker(connection, "ns", FP, WriteBackSettings())
        assert all(worker.put(ids, out) for ids, out in rows)
        assert worker.flush(10.0)
        stats = worker.stats()
        worker.close()
    assert (stats.dropped_invalid, stats.stored, stats.dropped_failed) == (1, 3, 0)
    assert service.write_backs.stats().entries == 3


def test_a_row_the_store_refuses_alone_is_counted_and_logged_once_and_the_others_are_stored(
    daemon, caplog: pytest.LogCaptureFixture
) -> None:
    service, url = daemon
    rows = _rows(5, seed=4)
    for bad in (1, 3):
        rows[bad][1][:] = 0.5  # outputs constant across the hidden size: the store refuses such a row
    with connect(url, token=WRITE) as connection:
        _admit(connection, rows)
        worker = WriteBackWorker(connection, "ns", FP, WriteBackSettings())
        with caplog.at_level(logging.WARNING):
            assert all(worker.put(ids, out) for ids, out in rows)
            assert worker.flush(10.0)
        stats = worker.stats()
        worker.close()
    assert (stats.refused, stats.stored, stats.dropped_failed, stats.calls) == (2, 3, 0, 1)
    assert caplog.text.count("the store refused a written-back row (INVALID_ARGUMENT)") == 1
    assert service.write_backs.stats().entries == 3


class _Gated:
    """A connection whose write-back calls wait until ``open`` is set (the row stays with the worker meanwhile)."""

    url = "gated://"
    supports_write_back = True

    def __init__(self, inner) -> None:
        self._inner = inner
        self.open = threading.Event()

    def write_back(self, *args, **kwargs):
        assert self.open.wait(10.0)
        return self._inner.write_back(*args, **kwargs)


def test_token_ids_the_caller_changes_after_put_are_not_what_is_written_back(daemon) -> None:
    # hidden_states(ids) hands the caller's own rows to the tiers: a caller reusing its buffer once the call
    # returned must not make the worker store these outputs under other tokens (every node would be served them).
    service, url = daemon
    rows = _rows(2, seed=6)
    with connect(url, token=WRITE) as connection:
        _admit(connection, rows)
        gated = _Gated(connection)
        worker = WriteBackWorker(gated, "ns", FP, WriteBackSettings())  # type: ignore[arg-type]
        original = [ids.copy() for ids, _ in rows]
        assert all(worker.put(ids, out) for ids, out in rows)
        for ids, _ in rows:
            ids[:] = 5  # the caller's next rows, written into the same buffer
        gated.open.set()
        assert worker.flush(10.0)
        worker.close()
        found = connection.exact("ns", FP, [token_hash(ids) for ids in original], [6] * len(rows), timeout=10.0)
    assert sorted(found) == [0, 1]
    for k, (_, out) in enumerate(rows):
        np.testing.assert_allclose(found[k], out.astype(np.float16), atol=1e-3)
