"""A TCP forwarder that makes a client on this host reach a server from another loopback address.

Linux routes all of 127.0.0.0/8 to ``lo``, so a socket may bind 127.0.0.2 with no setup. The forwarder
listens on ``source`` and opens each upstream connection from ``source`` too: the server sees its peer as
``source``, whatever the client's own address (gRPC clients cannot choose theirs).
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType
from typing import Self

_READ_BYTES = 1 << 16


class Forwarder:
    """Forwards ``source:port`` to ``target`` (``host:port``), each upstream connection opened from ``source``.

    Use as a context manager; ``address`` is what clients connect to; ``peers`` the local addresses the
    upstream connections were opened from (what the server saw).
    """

    def __init__(self, target: str, source: str = "127.0.0.2") -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._source = source
        self._listener = socket.create_server((source, 0))
        self.address = f"{source}:{self._listener.getsockname()[1]}"
        self.peers: list[str] = []
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._accepting = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> Self:
        self._accepting.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop accepting and close every forwarded connection."""
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(self._target, source_address=(self._source, 0))
            with self._lock:
                self.peers.append(upstream.getsockname()[0])
                self._sockets += [client, upstream]
            for reader, writer in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(reader, writer), daemon=True).start()


def _pump(reader: socket.socket, writer: socket.socket) -> None:
    """Copy ``reader`` to ``writer`` until either closes."""
    try:
        while data := reader.recv(_READ_BYTES):
            writer.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (reader, writer):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
