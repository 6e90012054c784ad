"""The prefix tier over a daemon: one PrefixMatch, then a FetchPrefix stream received on a reader thread.

Parts arrive layer by layer (every row's layer 0 first), so the forward's
first layers run while later ones are on their way. A row error, a part
damaged in transit, the deadline, or the daemon going away (once the stream
sent again to the daemons still there has failed too) fail the rows they
affect; the forward learns of it through ``MapsUnavailableError`` from
:meth:`PrefixStream.layer` and computes those rows normally.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np

from attnstore.errors import AttnStoreError, MapsUnavailableError
from attnstore.protocol.prefix_wire import array_of
from attnstore.protocol.status_codes import error_from_rpc
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore_client.connection.base import PrefixStream
from attnstore_client.connection.resend import ResendingStream, StreamResend
from attnstore_client.resilience import cause_of

log = logging.getLogger(__name__)

_DEADLINE_SLACK_S = 1.0


class StreamedPrefix(PrefixStream):
    """The parts of one FetchPrefix call; ``hidden_part`` is the part number of the hidden states.

    ``open_call(seconds left)`` makes the call; ``resend`` says how often one broken by UNAVAILABLE is made
    again. Each part is a whole array of one row's blocks, the same from every daemon: parts already
    received stay and the new stream's copies of them are skipped.
    """

    def __init__(
        self, open_call: Callable[[float | None], grpc.Call], rows: int, hidden_part: int, deadline: float | None,
        resend: StreamResend,
    ) -> None:
        super().__init__()
        self._rows, self._hidden_part, self._deadline = rows, hidden_part, deadline
        self._parts: dict[tuple[int, int], np.ndarray] = {}
        self._failed: dict[int, str] = {}
        self._why: dict[int, str] = {}  # row -> what the store said of its failed part
        self._done = False
        self._stream = ResendingStream("FetchPrefix", open_call, resend, deadline, receive=self._receive,
                                       finish=self._finish, closed=lambda: self._done, thread="attnstore-prefix")
        self._cond = self._stream.cond
        self._stream.start()

    def _finish(self, error: BaseException | None, seconds: float) -> None:
        """The stream ended: with an error, every row not failed yet fails with its cause."""
        self.fetch_seconds = seconds
        with self._cond:
            if error is not None and not self._done:
                cause = cause_of(error_from_rpc(error) if isinstance(error, grpc.RpcError) else error)
                log.warning("FetchPrefix stream broke (%s): computing its rows", cause)
                for row in range(self._rows):
                    self._failed.setdefault(row, cause)
            self._done = True
            self._cond.notify_all()

    def _receive(self, stream: Iterator[pb.PrefixFrame]) -> None:
        """Take one attempt's messages (raises what breaks it)."""
        for message in stream:
            if message.HasField("error"):
                log.warning("store could not serve the prefix of row %d (part %d): %s %s", message.row,
                            message.part, message.error.code, message.error.message)
                self._fail(message.row, "checksum" if message.error.code == "DATA_LOSS" else "row_error",
                           f"the store could not serve its part {message.part}: {message.error.code}")
                continue
            if (int(message.row), int(message.part)) in self._parts:
                continue  # a stream sent again repeats what the broken one delivered
            try:
                array = array_of(message)
            except AttnStoreError as exc:
                self._fail(message.row, cause_of(exc))
                continue
            self.bytes_fetched += len(message.data)
            with self._cond:
                self._parts[(int(message.row), int(message.part))] = array
                self._cond.notify_all()

    def _fail(self, row: int, cause: str, why: str | None = None) -> None:
        with self._cond:
            if row not in self._failed and why is not None:
                self._why[row] = why
            self._failed.setdefault(row, cause)
            self._cond.notify_all()

    def _get(self, row: int, part: int) -> np.ndarray:
        with self._cond:
            remaining = None if self._deadline is None else self._deadline - time.monotonic() + _DEADLINE_SLACK_S
            ready = self._cond.wait_for(
                lambda: (row, part) in self._parts or row in self._failed or self._done, timeout=remaining
            )
            if not ready:
                self._failed.setdefault(row, "timeout")
            array = self._parts.get((row, part))
            if array is None or row in self._failed:
                cause = self._failed.get(row, "bad_data")
                why = self._why.get(row, f"its part {part} did not arrive")
                raise MapsUnavailableError(f"row {row}: prefix unavailable: {why} ({cause})", row=row, cause=cause)
            return array

    def layer(self, row: int, layer: int) -> np.ndarray:
        """See :meth:`PrefixStream.layer`."""
        return self._get(row, layer)

    def hidden(self, row: int) -> np.ndarray:
        """See :meth:`PrefixStream.hidden`."""
        return self._get(row, self._hidden_part)

    def close(self) -> None:
        """Cancel the call if it still streams."""
        with self._cond:
            finished = self._done
            self._done = True
            self._cond.notify_all()
        if not finished:
            self._stream.cancel()
