"""The daemon's watchdog (its main loop): an unexpected error in a check is logged and counted, never fatal."""

from __future__ import annotations

import json
import logging
import threading
import urllib.request
from pathlib import Path

import pytest

from attnstore.server.config import DaemonConfig
from attnstore.server.daemon import Daemon
from attnstore.service.monitoring import ServiceMonitoring
from tests.support.wait import wait_until


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_a_watchdog_check_that_raises_is_counted_and_the_daemon_still_drains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(self: ServiceMonitoring) -> str | None:
        raise RuntimeError("a bug in a health check")

    monkeypatch.setattr(ServiceMonitoring, "storage_fault", broken)
    ready = tmp_path / "ready.json"
    daemon = Daemon(DaemonConfig(tmp_path / "store", listen="127.0.0.1:0", create=True, metrics_port=0,
                                 ready_file=ready, grace_seconds=1.0))
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(daemon.run(handle_signals=False)))
    with caplog.at_level(logging.ERROR, logger="attnstore.server.daemon"):
        thread.start()

        def serving() -> bool:
            assert thread.is_alive(), "the daemon's thread ended before it served"
            return ready.exists()

        wait_until(serving, 30, "the daemon's ready file")
        port = json.loads(ready.read_text())["metrics_port"]
        wait_until(lambda: _metric(port, 'attnstore_background_errors_total{thread="attnstore-watchdog"}') >= 2, 30,
                   "two watchdog errors counted")
        daemon.request_stop()
        thread.join(30)
    assert codes == [0]
    assert any("event=watchdog_error" in r.getMessage() for r in caplog.records)
