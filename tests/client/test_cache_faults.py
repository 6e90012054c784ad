"""``AttnCache`` under the faults an independent probe found (issue 25): real daemon processes, real LMDB.

- the breaker's half-open trial always ends, so a store back after an outage is used again;
- a daemon that stops answering (SIGSTOP) cannot hang ``encode`` even without a deadline;
- a cache whose construction fails, or that is dropped without ``close()``, leaves nothing open;
- write-back is refused from a model not in fp32, and what a caller does to its results never reaches the store.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from attnstore.errors import ConfigError
from attnstore.service import AttnStoreService
from attnstore_client.cache import AttnCache
from attnstore_client.resilience import BreakerPolicy, RetryPolicy
from attnstore_client.tiers.cost_model import CostSettings
from attnstore_tools.admin.cold_start import create_exact_namespace
from tests.support.caches import fill_namespace, plain_hidden, sentences, tiny_loaded
from tests.support.daemon import ADMIN_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess
from tests.support.pause import paused
from tests.support.wait import wait_until

SHORT = sentences(4, seed=51, min_words=3, max_words=3)
LONG = sentences(4, seed=52, min_words=12, max_words=12)


@pytest.fixture
def bert():
    return tiny_loaded("bert")


def _store(path: Path, bert, texts: list[str]) -> Path:
    with AttnStoreService.open(path, create=True) as service:
        fill_namespace(service, bert, texts)
    return path


def test_a_call_that_never_asks_the_store_leaves_the_breaker_able_to_close_once_the_daemon_is_back(
    tmp_path: Path, bert
) -> None:
    store = _store(tmp_path / "store", bert, SHORT)
    daemon = DaemonProcess(store, tmp_path).start()
    port = int(daemon.target.rsplit(":", 1)[1])
    try:
        cache = AttnCache(bert, f"grpc://{daemon.target}", token=READ_TOKEN, exact=False, max_distance=1e-3,
                          breaker=BreakerPolicy(failure_threshold=1, reset_after=0.2), retry=RetryPolicy(attempts=1),
                          timeout=2.0, cost=CostSettings(min_samples=10**9))
        cache.encode(SHORT)
        assert cache.last_stats.map_hits == len(SHORT)
        daemon.kill()
        cache.encode(SHORT)  # asks the store: fails, the breaker opens
        assert cache.last_stats.fallbacks == {"unavailable": len(SHORT)} and cache.breaker.state == "open"
        daemon = DaemonProcess(store, tmp_path, port=port).start()
        wait_until(lambda: cache.breaker.state == "half_open", 10, "the breaker half-open (past reset_after)")
        cache.maps = False  # calls that need nothing of the store (exact tiers off too) take no trial
        for _ in range(3):
            cache.encode(SHORT)
            assert cache.last_stats.fallback_rows == 0 and cache.last_stats.misses == len(SHORT)
        cache.maps = True
        # A trial may still find the channel reconnecting: then another.
        wait_until(lambda: cache.encode(SHORT) is not None and cache.last_stats.map_hits >= len(SHORT), 15.0,
                   lambda: f"the store used again ({cache.last_stats.fallbacks})", poll=0.3)
        assert cache.breaker.state == "closed"
        cache.close()
    finally:
        daemon.stop()


def test_a_daemon_that_stops_answering_cannot_hang_encode_even_without_a_deadline(tmp_path: Path, bert) -> None:
    store = _store(tmp_path / "store", bert, SHORT)
    daemon = DaemonProcess(store, tmp_path).start()
    cache = AttnCache(bert, f"grpc://{daemon.target}", token=READ_TOKEN, timeout=None, exact_cache_bytes=0,
                      retry=RetryPolicy(attempts=1))
    try:
        with paused(daemon.pid):
            started = time.monotonic()
            embeddings = cache.encode(SHORT + LONG)
            seconds = time.monotonic() - started
    finally:
        cache.close()
        daemon.stop()
    assert seconds < 45.0  # a keepalive ping went unanswered: 10 to 30 s (it waited 120 s and more before)
    assert cache.last_stats.fallback_rows == len(SHORT + LONG)
    expected = torch.stack([h.mean(dim=0) for h in plain_hidden(bert, SHORT + LONG)]).numpy()
    np.testing.assert_allclose(embeddings, expected, atol=1e-4)


def _open_files_under(folder: Path) -> list[str]:
    prefix = str(folder.resolve())
    fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
           if os.path.exists(f"/proc/self/fd/{fd}")]
    with open("/proc/self/maps", encoding="utf-8") as maps:
        mapped = [line.split()[-1] for line in maps if prefix in line]
    return [path for path in fds if path.startswith(prefix)] + mapped


def test_a_cache_whose_options_are_refused_opens_nothing(tmp_path: Path, bert) -> None:
    store = _store(tmp_path / "store", bert, SHORT)
    for bad in ({"exact_cache_bytes": -1}, {"prefix_min_tokens": -5}):
        with pytest.raises(ConfigError):
            AttnCache(bert, f"local:{store}", **bad)
        assert _open_files_under(store) == []


def test_caches_dropped_without_close_stop_their_write_back_threads_and_close_their_connections(
    tmp_path: Path, bert
) -> None:
    daemon = DaemonProcess(tmp_path / "store", tmp_path).start()
    try:
        with daemon.client(ADMIN_TOKEN) as admin:
            create_exact_namespace(admin, bert, "default")
        with AttnCache(bert, f"grpc://{daemon.target}", token=WRITE_TOKEN, write_back=True) as first:
            first.encode(SHORT[:1])  # gRPC's own threads, started once per process, run from here on
        gc.collect()
        threads = threading.active_count()
        closed: list[str] = []
        for _ in range(5):
            cache = AttnCache(bert, f"grpc://{daemon.target}", token=WRITE_TOKEN, write_back=True)
            connection = cache.connection
            close = connection.close
            connection.close = lambda close=close: (closed.append("closed"), close())[-1]  # type: ignore[method-assign]
            cache.encode(SHORT[:1])
            del cache, connection
        gc.collect()
        wait_until(lambda: threading.active_count() <= threads, 10,  # each had a write-back thread
                   lambda: f"the dropped caches' threads ended: {threading.active_count()} threads, {threads} before",
                   poll=0.1)
        assert closed == ["closed"] * 5
    finally:
        daemon.stop()


def test_write_back_from_a_model_not_in_fp32_is_refused_naming_its_dtype(tmp_path: Path) -> None:
    half = tiny_loaded("bert")
    half.model.to(torch.float16)
    daemon = DaemonProcess(tmp_path / "store", tmp_path).start()
    try:
        with daemon.client(ADMIN_TOKEN) as admin:
            create_exact_namespace(admin, tiny_loaded("bert"), "default")  # same fingerprint: weights digested as fp32
        with pytest.raises(ConfigError, match="torch.float16"):
            AttnCache(half, f"grpc://{daemon.target}", token=WRITE_TOKEN, write_back=True)
    finally:
        daemon.stop()


def test_results_changed_in_place_by_the_caller_never_reach_the_store(tmp_path: Path, bert) -> None:
    daemon = DaemonProcess(tmp_path / "store", tmp_path, extra_args=("--admit-after", "1")).start()
    try:
        with daemon.client(ADMIN_TOKEN) as admin:
            create_exact_namespace(admin, bert, "default")
        url = f"grpc://{daemon.target}"
        with AttnCache(bert, url, token=WRITE_TOKEN, write_back=True, exact_cache_bytes=0) as writer:
            writer.encode(SHORT[:1])  # asked once: admitted; computed and queued
            tokens = writer.encode(SHORT[:1], output_value="token_embeddings")  # admitted now, queued
            tokens[0].fill_(7.0)  # the caller reuses its buffer before the worker sends
            assert writer.write_back is not None and writer.write_back.flush(30.0)
        with AttnCache(bert, url, token=READ_TOKEN) as reader:
            served = reader.encode(SHORT[:1], output_value="token_embeddings")
            assert reader.last_stats.exact_hits == 1
        np.testing.assert_allclose(served[0].numpy(), plain_hidden(bert, SHORT[:1])[0].numpy(), atol=2e-3)
    finally:
        daemon.stop()
