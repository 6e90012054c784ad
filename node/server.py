"""Running the node's app on uvicorn: the listening socket, the ready file, signals, the graceful drain, and the
deadline that bounds slow clients.

The socket is bound before the model loads, so ``/health`` answers 503 while it
loads; once the model is loaded the ready file (``{pid, address, port}`` as JSON)
is written. SIGTERM and SIGINT drain: the socket stops accepting, ``/health``
says 503, requests in flight are answered (within ``grace`` seconds), the batcher
serves what it holds and closes the cache (its write-back queue sent), and the
process exits 0. SIGHUP reloads the API key file. A model that cannot be loaded
ends the process with exit code 2.

uvicorn closes an idle keep-alive connection, but not one that trickles a
request's line and headers (or sends nothing at all). The node's HTTP protocol
(uvicorn's h11 protocol with a deadline) gives each request ``read_timeout``
seconds from its first byte (from the connection's opening for the first) until
its headers are in: then it answers 408 with a JSON error body (a connection that
sent nothing is closed without one) and counts it under the route ``other``. The
body has the same time again, bounded by the app (``app``). uvicorn's own 400 for
bytes that are not HTTP gets the JSON error body too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.h11_impl import H11Protocol

from attnstore.errors import ConfigError
from attnstore_node.app import REQUEST_TIMEOUT, NodeState
from attnstore_node.errors import ApiError, bad_request
from attnstore_node.metrics import OTHER_ROUTE

log = logging.getLogger(__name__)

# Exit code of a node whose model or store could not be opened (the CLI's code for a refused configuration).
EXIT_LOAD_FAILED = 2


def bind(listen: str) -> socket.socket:
    """A TCP socket bound to ``HOST:PORT`` (``[v6]:PORT``; port 0 takes a free one), not yet listening.

    Raises:
        ConfigError: not ``HOST:PORT``, or the address cannot be bound.
    """
    host, sep, port_text = listen.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"--listen must be HOST:PORT with a port in 0..65535, got {listen!r}")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, int(port_text)))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {listen}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


class _DeadlineProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on each request's line and headers (see the module)."""

    read_timeout: float = 60.0  # the subclass ``node_protocol`` makes sets both
    count: Callable[[int], None] = staticmethod(lambda status: None)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Arm the deadline of the first request."""
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._sent = False  # bytes of the request under the deadline came
        self._arm()

    def data_received(self, data: bytes) -> None:
        """Arm the deadline at a request's first byte; disarm it once its headers are in (a new cycle)."""
        cycle = self.cycle
        if self._deadline is None and (cycle is None or cycle.response_complete):
            self._arm()
        self._sent = True
        super().data_received(data)
        if self.cycle is not cycle:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        """See uvicorn's; the deadline goes with the connection."""
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not HTTP, as a JSON error body, counted."""
        self._disarm()
        self._answer(bad_request(f"{msg} (not HTTP/1.1)", "invalid_http"), "Bad Request")

    def _arm(self) -> None:
        self._sent = False
        self._deadline = self.loop.call_later(self.read_timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if not self._sent:  # nothing came: no request to answer
            self.transport.close()
            return
        log.info("event=read_timeout client=%s seconds=%g while=headers", self.client, self.read_timeout)
        self._answer(ApiError(REQUEST_TIMEOUT, f"the request's headers did not arrive within {self.read_timeout:g} s",
                              "request_timeout"), "Request Timeout")

    def _answer(self, error: ApiError, reason: str) -> None:
        """Write ``error`` as the connection's last response (no request cycle runs) and close it."""
        body = json.dumps(error.body()).encode()
        head = (f"HTTP/1.1 {error.status} {reason}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode("ascii")
        self.count(error.status)
        self.transport.write(head + body)
        self.transport.close()


def node_protocol(read_timeout: float, count: Callable[[int], None]) -> type[H11Protocol]:
    """The node's HTTP protocol class for uvicorn: each request's headers within ``read_timeout`` seconds;
    ``count(status)`` counts what it answers itself."""
    return type("NodeProtocol", (_DeadlineProtocol,), {"read_timeout": read_timeout, "count": staticmethod(count)})


class _NodeServer(uvicorn.Server):
    """uvicorn's server with the node's signals (drain, key reload) and its ready file."""

    def __init__(self, config: uvicorn.Config, state: NodeState, ready: Callable[[], None],
                 on_reload: Callable[[], None]) -> None:
        super().__init__(config)
        self._state = state
        self._ready = ready
        self._on_reload = on_reload
        self._ready_written = False
        self.exit_code = 0

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGTERM/SIGINT drain, SIGHUP reloads the keys; unlike uvicorn's, no signal is raised again after the
        drain, so a drained node exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_stop(signum: int, frame: FrameType | None) -> None:
            if not self.should_exit:
                log.info("event=draining signal=%s", signal.Signals(signum).name)
            self._state.draining = True
            self.handle_exit(signum, frame)

        def on_reload(signum: int, frame: FrameType | None) -> None:
            self._on_reload()

        previous = {sig: signal.signal(sig, handler) for sig, handler in (
            (signal.SIGTERM, on_stop), (signal.SIGINT, on_stop), (signal.SIGHUP, on_reload))}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def on_tick(self, counter: int) -> bool:
        """Writes the ready file once the model is loaded; ends the server if it could not be."""
        embedder = self._state.embedder
        if embedder.failure is not None:
            self.exit_code = EXIT_LOAD_FAILED
            return True
        if not self._ready_written and embedder.info is not None:
            self._ready_written = True
            self._ready()
        return await super().on_tick(counter)


def serve(app: Starlette, sock: socket.socket, *, ready_file: Path | None = None, grace: int = 30) -> int:
    """Serve ``app`` (``app.create_app``) on ``sock`` until SIGTERM/SIGINT; returns the exit code.

    Args:
        app: the node's app.
        sock: the bound socket (``bind``).
        ready_file: where to write ``{pid, address, port}`` once the model is loaded (removed at exit).
        grace: seconds requests in flight get to finish on SIGTERM; past them they are cancelled.
    """
    state: NodeState = app.state.node
    host, port = sock.getsockname()[:2]
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def ready() -> None:
        log.info("event=serving address=%s model=%s", address, state.embedder.info)
        if ready_file is not None:
            tmp = ready_file.with_name(ready_file.name + ".tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "address": address, "port": port}), encoding="utf-8")
            os.replace(tmp, ready_file)

    def count(status: int) -> None:
        state.metrics.requests.labels(OTHER_ROUTE, str(status)).inc()

    protocol = node_protocol(state.limits.read_timeout, count)
    config = uvicorn.Config(app, lifespan="on", log_config=None, access_log=False, timeout_graceful_shutdown=grace,
                            http=protocol)
    server = _NodeServer(config, state, ready, state.keys.reload)
    log.info("event=listening address=%s health=loading", address)
    try:
        server.run(sockets=[sock])
    finally:
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
    if server.exit_code == 0 and state.embedder.failure is not None:
        return EXIT_LOAD_FAILED
    log.info("event=stopped code=%d", server.exit_code)
    return server.exit_code
