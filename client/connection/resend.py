"""Read-only streams sent again, whole, when the daemon serving them goes away: the one resend loop.

gRPC's retries stop at a call's first reply message: a read-only stream (Lookup, Fetch, FetchMaps,
FetchPrefix) whose daemon dies after that ends UNAVAILABLE. Over several daemons it is sent again, whole,
``STREAM_RETRIES`` times more (round_robin picks a daemon still there), within the call's deadline. Write-type
calls (Ingest, WriteBack, Delete) are never sent again mid-stream.

Two shapes of reader share the loop: :func:`read_whole` receives a stream on the calling thread and drops
what a broken attempt delivered (``DaemonClient``'s Lookup and entry listings, the admin tools' Fetch);
:class:`ResendingStream` receives one on a reader thread for a forward that consumes it as it arrives
(FetchMaps in ``remote``, FetchPrefix in ``remote_prefix``): what a broken attempt delivered stays, and the
reader skips it when the new stream repeats it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc

from attnstore.errors import AttnStoreError, UnavailableError
from attnstore.protocol.status_codes import error_from_rpc

log = logging.getLogger(__name__)

T = TypeVar("T")

STREAM_RETRIES = 2
STREAM_RETRY_PAUSE_S = 0.05  # gRPC notices the dead daemon's connection meanwhile
# How long past its deadline a server stream is left before this side cancels it: gRPC's own deadline
# fires first, except when it does not (a Lookup was seen waiting for ever after its daemon stopped).
DEADLINE_GRACE_S = 1.0
M = TypeVar("M")


def guarded_stream(call: Iterator[M], seconds: float | None) -> Iterator[M]:
    """The messages of a server stream (a ``grpc.Call`` as its stub returned it), cancelled from this side
    ``DEADLINE_GRACE_S`` past ``seconds`` should gRPC's own deadline not end it, so no read waits for ever.

    Raises:
        UnavailableError: ``DEADLINE_EXCEEDED``, the stream cancelled past its deadline.
        grpc.RpcError: what else ends the stream.
    """
    if seconds is None:
        yield from call
        return
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        call.cancel()  # type: ignore[attr-defined]  # a stub's stream is a grpc.Call

    timer = threading.Timer(max(0.0, seconds) + DEADLINE_GRACE_S, expire)
    timer.daemon = True
    timer.start()
    try:
        yield from call
    except grpc.RpcError as exc:
        if expired.is_set():
            raise UnavailableError(f"DEADLINE_EXCEEDED: the stream outlived its deadline of {seconds:.2f} s and"
                                   " was cancelled by the client") from exc
        raise
    finally:
        timer.cancel()


def retries_stream(exc: BaseException, attempt: int, retries: int, deadline: float | None) -> bool:
    """Whether a read-only stream that failed with ``exc`` on ``attempt`` (0: the first) is sent again.

    Only UNAVAILABLE (the daemon went away or refused the call), only ``retries`` times, and only while
    the deadline (``time.monotonic()`` based; None: none) leaves time past the pause.
    """
    return (
        isinstance(exc, grpc.RpcError) and exc.code() is grpc.StatusCode.UNAVAILABLE and attempt < retries
        and (deadline is None or deadline - time.monotonic() > STREAM_RETRY_PAUSE_S)
    )


@dataclass(frozen=True, slots=True)
class StreamResend:
    """How a stream is sent again: ``retries`` times at most, each ``count``-ed (the connection's tally)."""

    retries: int
    count: Callable[[], None]


def read_whole(read: Callable[[float | None], T], *, resend: StreamResend, limit: float | None) -> T:
    """``read(seconds left)``: one whole stream, received and assembled; sent again, whole, while
    :func:`retries_stream` says so (a broken attempt's partial reply is dropped with it).

    Raises:
        AttnStoreError: what the daemon's status stands for (``status_codes.error_from_rpc``).
    """
    if resend.retries == 0:  # one daemon: nothing to resend to, one plain call
        try:
            return read(limit)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc
    deadline = None if limit is None else time.monotonic() + limit
    attempt = 0
    while True:
        try:
            return read(None if deadline is None else deadline - time.monotonic())
        except grpc.RpcError as exc:
            if not retries_stream(exc, attempt, resend.retries, deadline):
                raise error_from_rpc(exc) from exc
            log.info("a read-only stream broke (%s: %s); sending it again", exc.code().name, exc.details())
        attempt += 1
        resend.count()
        time.sleep(STREAM_RETRY_PAUSE_S)


class ResendingStream:
    """One read-only call received on its own reader thread, made again while its :class:`StreamResend` allows.

    The reader (``remote``'s FetchMaps, ``remote_prefix``'s FetchPrefix) keeps what arrives and calls
    :meth:`start` once set up: ``receive(call)``
    takes one attempt's messages and raises what breaks it; ``finish(error, seconds)`` runs once on the reader
    thread when the last attempt ends (``error``: what ended it, or None when it ended whole or the reader
    was ``closed`` meanwhile; ``seconds``: time spent receiving).

    Args:
        name: the RPC, for logs.
        open_call: makes the call, given the seconds left (None: no deadline).
        resend: how often a call broken by UNAVAILABLE is made again.
        deadline: ``time.monotonic()`` by which the call must end, or None.
        receive, finish: see above.
        closed: whether the reader was closed (called holding :attr:`cond`).
        thread: the reader thread's name.
    """

    def __init__(
        self, name: str, open_call: Callable[[float | None], grpc.Call], resend: StreamResend, deadline: float | None,
        *, receive: Callable[[grpc.Call], None], finish: Callable[[BaseException | None, float], None],
        closed: Callable[[], bool], thread: str,
    ) -> None:
        self.cond = threading.Condition()  # the reader's lock: a new call is made under it, so cancel reaches it
        self._name = name
        self._open_call = open_call
        self._resend = resend
        self._deadline = deadline
        self._receive = receive
        self._finish = finish
        self._closed = closed
        self._call = open_call(self.seconds_left())
        self._thread = threading.Thread(target=self._run, name=thread, daemon=True)

    def start(self) -> None:
        """Start receiving on the reader thread (once the reader has set itself up: its callbacks run there)."""
        self._thread.start()

    def seconds_left(self) -> float | None:
        """Seconds to the deadline (None: no deadline)."""
        return None if self._deadline is None else self._deadline - time.monotonic()

    def _run(self) -> None:
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            error = self._receive_all()
        finally:
            self._finish(error, time.perf_counter() - start)

    def _receive_all(self) -> BaseException | None:
        call, attempt = self._call, 0
        while True:
            try:
                self._receive(call)
                return None
            except (grpc.RpcError, AttnStoreError) as exc:
                if not retries_stream(exc, attempt, self._resend.retries, self._deadline):
                    return exc
                log.info("%s stream broke (%s); sending it again", self._name, exc)
            time.sleep(STREAM_RETRY_PAUSE_S)
            with self.cond:
                if self._closed():  # closed, or past its deadline, meanwhile
                    return None
                attempt += 1
                self._resend.count()
                call = self._call = self._open_call(self.seconds_left())

    def cancel(self) -> None:
        """Cancel the live call."""
        self._call.cancel()
