"""Run the real daemon (``attnstore serve``) as a subprocess for integration tests.

It listens on a free loopback port (port 0; the daemon reports the port in its
ready file), is waited for until health says SERVING, and is stopped with
SIGTERM. Its log goes to a file beside the store, shown when a start fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from attnstore.errors import UnavailableError
from attnstore.protocol.remote import RemoteStore

ADMIN_TOKEN = "admin-token-0123456789abcdef"
READ_TOKEN = "read-token-0123456789abcdef"


def write_token_file(path: Path) -> Path:
    """A token file with one admin and one read token (mode 600)."""
    path.write_text(f"# test tokens\nadmin {ADMIN_TOKEN}\nread {READ_TOKEN}  # monitoring\n", encoding="utf-8")
    path.chmod(0o600)
    return path


class DaemonProcess:
    """One ``attnstore serve`` subprocess.

    Args:
        store: map store directory (created if missing).
        workdir: where the ready file and the log go.
        tokens: serve with the test token file (admin and read tokens above).
        extra_args: more ``serve`` arguments.
        client_options: RemoteStore options every client of it needs (TLS roots, client certificate).
    """

    def __init__(
        self,
        store: Path,
        workdir: Path,
        *,
        tokens: bool = True,
        extra_args: tuple[str, ...] = (),
        client_options: dict[str, object] | None = None,
    ) -> None:
        self.store = store
        self.ready_file = workdir / "daemon-ready.json"
        self.log_path = workdir / "daemon.log"
        self.token_file = write_token_file(workdir / "tokens.txt") if tokens else None
        self._args = extra_args
        self._client_options = client_options or {}
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.metrics_port: int | None = None

    @property
    def target(self) -> str:
        """``127.0.0.1:PORT`` of the running daemon."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> DaemonProcess:
        """Start the daemon and wait until health says SERVING.

        Raises:
            RuntimeError: it exited or did not become SERVING within ``timeout`` (its log is in the message).
        """
        self.ready_file.unlink(missing_ok=True)
        command = [
            sys.executable, "-m", "attnstore_tools.cli", "serve",
            "--store", str(self.store), "--create", "--listen", "127.0.0.1:0",
            "--ready-file", str(self.ready_file), "--metrics-port", "0", "--grace", "1",
            *self._args,
        ]
        if self.token_file is not None:
            command += ["--token-file", str(self.token_file)]
        log = self.log_path.open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.process.returncode}:\n{self.log()}")
            if self.ready_file.exists():
                info = json.loads(self.ready_file.read_text(encoding="utf-8"))
                self.port, self.metrics_port = info["port"], info["metrics_port"]
                if self._serving():
                    return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"daemon did not become SERVING within {timeout}s:\n{self.log()}")

    def _serving(self) -> bool:
        try:
            with RemoteStore(self.target, **self._client_options) as remote:  # type: ignore[arg-type]
                return remote.health(timeout=2.0) == "SERVING"
        except UnavailableError:
            return False

    def client(self, token: str | None = ADMIN_TOKEN, **options: object) -> RemoteStore:
        """A RemoteStore on the daemon (admin token by default)."""
        return RemoteStore(self.target, token=token, **{**self._client_options, **options})  # type: ignore[arg-type]

    def log(self) -> str:
        """The daemon's log so far."""
        return self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``sig`` and wait for the exit code.

        Raises:
            RuntimeError: it did not exit within ``timeout`` (it is then killed).
        """
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"daemon did not exit within {timeout}s after signal {sig}:\n{self.log()}") from None

    def kill(self) -> None:
        """SIGKILL the daemon if it still runs."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
