"""``attnstore_tools.launcher.ServeProcess``: a failed start shows the log; a stop that hangs ends in a kill."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from attnstore.errors import DaemonProcessError
from attnstore_tools.launcher import ServeProcess
from tests.support.pause import stop


def test_a_daemon_that_exits_at_start_raises_with_its_log_tail(tmp_path: Path) -> None:
    daemon = ServeProcess(tmp_path / "store", tmp_path, args=["--tls-cert", str(tmp_path / "missing.pem")])
    with pytest.raises(DaemonProcessError, match=r"exited with 2 at start") as raised:
        daemon.start(timeout=60)
    message = str(raised.value)
    assert str(daemon.log_path) in message and "--tls-key" in message  # serve's own complaint, from the log
    assert daemon.stop() == 2  # already gone: stop just reports the exit code


def test_pid_before_start_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DaemonProcessError, match="never started"):
        ServeProcess(tmp_path / "store", tmp_path).pid  # noqa: B018


def test_a_serving_daemon_that_ignores_sigterm_is_killed_after_the_wait(tmp_path: Path) -> None:
    daemon = ServeProcess(tmp_path / "store", tmp_path, args=["--metrics-port", "0"]).start()
    assert daemon.port > 0 and daemon.metrics_port and daemon.target == f"127.0.0.1:{daemon.port}"
    with daemon.client() as remote:
        assert remote.health() == "SERVING"
    stop(daemon.pid)  # stopped: SIGTERM stays pending, nothing exits
    with pytest.raises(DaemonProcessError, match="did not exit within 0.5 s of SIGTERM"):
        daemon.stop(timeout=0.5)
    assert daemon.process.returncode == -signal.SIGKILL
