"""Run the real daemon (``attnstore serve``) as a subprocess for integration tests.

The process handling is ``attnstore_tools.launcher.ServeProcess``'s (free
loopback port, wait for SERVING, SIGTERM, the log shown when a start fails);
this adds the tests' settings: a token file with the tokens below, metrics on a
free port, a one-second grace, and admin-token clients.
"""

from __future__ import annotations

from pathlib import Path

from attnstore_client.connection.daemon import DaemonClient
from attnstore_tools.launcher import ServeProcess

ADMIN_TOKEN = "admin-token-0123456789abcdef"
READ_TOKEN = "read-token-0123456789abcdef"
WRITE_TOKEN = "write-token-0123456789abcdef"
# Another node's write token: admission counts it as another caller.
OTHER_WRITE_TOKEN = "write-token-fedcba9876543210"
# A read token that may name namespace "sm" only.
SCOPED_READ_TOKEN = "scoped-read-token-0123456789"


def write_token_file(path: Path) -> Path:
    """A token file with one admin, one read and two write tokens, of nodes "node-a" and "node-b", and a read token
    scoped to namespace "sm" (mode 600)."""
    path.write_text(
        f"# test tokens\nadmin {ADMIN_TOKEN}\nread {READ_TOKEN}  # monitoring\n"
        f"write {WRITE_TOKEN} name=node-a  # a node\nwrite {OTHER_WRITE_TOKEN} name=node-b  # another node\n"
        f"read {SCOPED_READ_TOKEN} name=sm-reader namespaces=sm  # an untrusted node of namespace sm\n",
        encoding="utf-8",
    )
    path.chmod(0o600)
    return path


class DaemonProcess(ServeProcess):
    """One ``attnstore serve`` subprocess with the tests' settings.

    Args:
        store: map store directory (created if missing), or a redis:// URL.
        workdir: where the ready file, the log and the token file go.
        tokens: serve with the test token file (admin and read tokens above).
        extra_args: more ``serve`` arguments.
        port: the loopback port (0: a free one).
        client_options: DaemonClient options every client of it needs (TLS roots, client certificate).
        create: serve with ``--create``.
    """

    def __init__(
        self,
        store: Path | str,
        workdir: Path,
        *,
        tokens: bool = True,
        extra_args: tuple[str, ...] = (),
        port: int = 0,
        client_options: dict[str, object] | None = None,
        create: bool = True,
    ) -> None:
        self.token_file = write_token_file(workdir / "tokens.txt") if tokens else None
        args = ["--metrics-port", "0", "--grace", "1", *extra_args]
        if self.token_file is not None:
            args += ["--token-file", str(self.token_file)]
        super().__init__(store, workdir, args=args, port=port, client_options=client_options, create=create)

    def client(self, token: str | None = ADMIN_TOKEN, **options: object) -> DaemonClient:
        """A DaemonClient on the daemon (admin token by default)."""
        return super().client(token, **options)
