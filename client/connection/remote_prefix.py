"""The prefix tier over a daemon: one PrefixMatch, then a FetchPrefix stream received on a reader thread.

Chunks arrive layer by layer (every row's layer 0 first), so the forward's
first layers run while later ones are on their way. A row error, a chunk
damaged in transit, the daemon going away or the deadline fail the rows they
affect; the forward learns of it through ``MapsUnavailableError`` from
:meth:`PrefixStream.layer` and computes those rows normally.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np

from attnstore.errors import AttnStoreError, MapsUnavailableError
from attnstore.protocol.prefix_wire import array_of
from attnstore.protocol.status_codes import error_from_rpc
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore_client.connection.base import PrefixStream
from attnstore_client.resilience import cause_of

log = logging.getLogger(__name__)

_DEADLINE_SLACK_S = 1.0


class StreamedPrefix(PrefixStream):
    """The chunks of one FetchPrefix call; ``hidden_chunk`` is the chunk number of the hidden states."""

    def __init__(self, call: grpc.Call, rows: int, hidden_chunk: int, deadline: float | None) -> None:
        super().__init__()
        self._call = call
        self._rows = rows
        self._hidden_chunk = hidden_chunk
        self._deadline = deadline
        self._cond = threading.Condition()
        self._chunks: dict[tuple[int, int], np.ndarray] = {}
        self._failed: dict[int, str] = {}
        self._done = False
        self._reader = threading.Thread(target=self._read, args=(call,), name="attnstore-prefix", daemon=True)
        self._reader.start()

    def _read(self, stream: Iterator[pb.PrefixChunk]) -> None:
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            for message in stream:
                if message.HasField("error"):
                    log.warning("store could not serve the prefix of row %d: %s %s", message.row,
                                message.error.code, message.error.message)
                    self._fail(message.row, "checksum" if message.error.code == "DATA_LOSS" else "row_error")
                    continue
                try:
                    array = array_of(message)
                except AttnStoreError as exc:
                    self._fail(message.row, cause_of(exc))
                    continue
                self.bytes_fetched += len(message.data)
                with self._cond:
                    self._chunks[(int(message.row), int(message.chunk))] = array
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            error = exc
        finally:
            self.fetch_seconds = time.perf_counter() - start
            with self._cond:
                if error is not None and not self._done:
                    cause = cause_of(error_from_rpc(error))
                    log.warning("FetchPrefix stream broke (%s): computing its rows", cause)
                    for row in range(self._rows):
                        self._failed.setdefault(row, cause)
                self._done = True
                self._cond.notify_all()

    def _fail(self, row: int, cause: str) -> None:
        with self._cond:
            self._failed.setdefault(row, cause)
            self._cond.notify_all()

    def _get(self, row: int, chunk: int) -> np.ndarray:
        with self._cond:
            remaining = None if self._deadline is None else self._deadline - time.monotonic() + _DEADLINE_SLACK_S
            ready = self._cond.wait_for(
                lambda: (row, chunk) in self._chunks or row in self._failed or self._done, timeout=remaining
            )
            if not ready:
                self._failed.setdefault(row, "timeout")
            array = self._chunks.get((row, chunk))
            if array is None or row in self._failed:
                cause = self._failed.get(row, "bad_data")
                raise MapsUnavailableError(f"row {row}: prefix chunk {chunk} did not arrive ({cause})", row=row,
                                           cause=cause)
            return array

    def layer(self, row: int, layer: int) -> np.ndarray:
        """See :meth:`PrefixStream.layer`."""
        return self._get(row, layer)

    def hidden(self, row: int) -> np.ndarray:
        """See :meth:`PrefixStream.hidden`."""
        return self._get(row, self._hidden_chunk)

    def close(self) -> None:
        """Cancel the call if it still streams."""
        with self._cond:
            finished = self._done
            self._done = True
            self._cond.notify_all()
        if not finished:
            self._call.cancel()
