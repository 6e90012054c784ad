"""Run ``attnstore serve`` as a subprocess: for the benchmarks that need a daemon and for the integration tests.

The daemon listens on a free loopback port (port 0; it reports the port in its
ready file) and is waited for until health says SERVING. It is stopped with
SIGTERM, and killed if it outlives the wait. Its log goes to a file in the
working folder; a failed start or stop ends its error message with the log's tail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from attnstore.errors import DaemonProcessError, UnavailableError
from attnstore_client.connection.daemon import DaemonClient

# Enough of the log for a start-up traceback, without flooding a test report.
_LOG_TAIL_CHARS = 8000
_POLL_SECONDS = 0.05


class ServeProcess:
    """One ``attnstore serve`` subprocess on a free loopback port.

    Args:
        store: map store folder (created if missing), or a ``redis://`` store URL.
        workdir: where the ready file (``daemon-ready.json``) and the log (``daemon.log``) go.
        args: more ``serve`` arguments (token file, caps, TLS files, ...).
        port: the loopback port to listen on; 0 (the default) takes a free one.
        client_options: ``DaemonClient`` options every client of it needs (TLS roots, client certificate);
            the health check at start uses them too.
        create: serve with ``--create`` (make the store if it is missing).
    """

    def __init__(
        self,
        store: Path | str,
        workdir: Path,
        *,
        args: Sequence[str] = (),
        port: int = 0,
        client_options: Mapping[str, object] | None = None,
        create: bool = True,
    ) -> None:
        self.store = store
        self._create = create
        self.ready_file = workdir / "daemon-ready.json"
        self.log_path = workdir / "daemon.log"
        self._args = tuple(args)
        self._client_options: dict[str, Any] = dict(client_options or {})
        self.process: subprocess.Popen[bytes] | None = None
        self._listen_port = port
        self.port = port
        self.metrics_port: int | None = None

    @property
    def target(self) -> str:
        """``127.0.0.1:PORT`` of the running daemon."""
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The daemon's process id.

        Raises:
            DaemonProcessError: it was never started.
        """
        if self.process is None:
            raise DaemonProcessError("ServeProcess.pid: the daemon was never started")
        return self.process.pid

    def _command(self) -> list[str]:
        return [
            sys.executable, "-m", "attnstore_tools.cli", "serve",
            "--store", str(self.store), *(["--create"] if self._create else []),
            "--listen", f"127.0.0.1:{self._listen_port}",
            "--ready-file", str(self.ready_file),
            *self._args,
        ]

    def start(self, timeout: float = 60.0) -> Self:
        """Start the daemon and wait until health says SERVING; returns ``self``.

        Raises:
            DaemonProcessError: it exited, or did not become SERVING within ``timeout`` seconds (it is then
                killed); the message ends with its log's tail.
        """
        self.ready_file.unlink(missing_ok=True)  # a restart must not read the previous run's port
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # Appended to: a restart on the same folder keeps the earlier runs' log.
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self._command(), stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise DaemonProcessError(f"the daemon exited with {self.process.returncode} at start{self._log_tail()}")
            if self.ready_file.exists():  # written (atomically) once the service is attached
                info = json.loads(self.ready_file.read_text(encoding="utf-8"))
                self.port, self.metrics_port = info["port"], info["metrics_port"]
                if self._serving():
                    return self
            time.sleep(_POLL_SECONDS)
        self.kill()
        raise DaemonProcessError(f"the daemon did not become SERVING within {timeout:g} s{self._log_tail()}")

    def _serving(self) -> bool:
        try:
            with self.client() as remote:
                return remote.health(timeout=2.0) == "SERVING"
        except UnavailableError:
            return False

    def client(self, token: str | None = None, **options: Any) -> DaemonClient:
        """A ``DaemonClient`` on the daemon with ``client_options``, ``options`` taking precedence."""
        return DaemonClient(self.target, token=token, **{**self._client_options, **options})

    def log(self) -> str:
        """The daemon's log so far ("" before the first start)."""
        return self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path.exists() else ""

    def _log_tail(self) -> str:
        text = self.log()
        cut = "...\n" if len(text) > _LOG_TAIL_CHARS else ""
        return f"; its log, {self.log_path}:\n{cut}{text[-_LOG_TAIL_CHARS:]}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``sig`` (unless it has exited already) and wait; returns its exit code (0 if never started).

        Raises:
            DaemonProcessError: it did not exit within ``timeout`` seconds (it is then killed).
        """
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise DaemonProcessError(
                f"the daemon did not exit within {timeout:g} s of {signal.Signals(sig).name}{self._log_tail()}"
            ) from None

    def kill(self) -> None:
        """SIGKILL the daemon if it still runs, and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
