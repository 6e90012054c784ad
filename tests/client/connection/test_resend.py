"""Read-only streams as the client reads them (``connection.resend``): a stream is never waited on past its
deadline, even where gRPC's own deadline does not end it (a Lookup was seen waiting for ever after its in-process
daemon stopped, hanging a CI run)."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from attnstore.errors import UnavailableError
from attnstore_client.connection.resend import DEADLINE_GRACE_S, guarded_stream

_METHOD = "/test.Stalls/Stream"


def _stalling_server(release: threading.Event) -> tuple[grpc.Server, int]:
    """A real server whose one stream sends a message, then stalls until ``release`` is set."""

    def stream(request: bytes, context: grpc.ServicerContext):
        yield b"first"
        release.wait(30)
        yield b"second"

    handler = grpc.method_handlers_generic_handler(
        "test.Stalls", {"Stream": grpc.unary_stream_rpc_method_handler(stream)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_a_stream_gRPC_does_not_end_is_cancelled_from_this_side_past_its_deadline() -> None:
    release = threading.Event()
    server, port = _stalling_server(release)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream(_METHOD)(b"", timeout=None)  # no deadline of gRPC's: only the guard's
            started = time.monotonic()
            received = []
            with pytest.raises(UnavailableError, match="DEADLINE_EXCEEDED"):
                for message in guarded_stream(call, 0.2):
                    received.append(message)
            assert received == [b"first"]
            assert time.monotonic() - started < 0.2 + DEADLINE_GRACE_S + 5.0
    finally:
        release.set()
        server.stop(0)


def test_a_stream_that_ends_in_time_is_read_whole_and_never_cancelled() -> None:
    release = threading.Event()
    release.set()
    server, port = _stalling_server(release)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream(_METHOD)(b"", timeout=5.0)
            assert list(guarded_stream(call, 5.0)) == [b"first", b"second"]
            assert call.code() is grpc.StatusCode.OK  # code() waits for the call's end: OK, not CANCELLED
    finally:
        server.stop(0)
