"""Staging of one Ingest stream: entries assembled from frames, held until commit.

The daemon refuses anything that does not fit the namespace's layout before it
allocates memory for it, and caps the bytes one stream may stage, so a client
cannot make the daemon allocate more than ``max_bytes`` per stream. A stream
that goes quiet is ended (``idle_limited``), so idle streams cannot hold the
daemon's few Ingest slots.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from attnstore.errors import RequestLimitError, WireFormatError
from attnstore.protocol.keys import TokenHash
from attnstore.protocol.records import NamespaceLayout, NewEntry
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.wire import WIRE_DTYPES, FrameAssembler


@dataclass
class _Pending:
    """The entry being received."""

    index: int  # position in the stream, for messages
    length: int
    token_hash: bytes
    feature: np.ndarray | None  # (feature_dim,) float32
    token_ids: np.ndarray | None  # (length,) uint32
    maps_dtype: str | None = None  # wire dtype of the first map frame; every layer must share it
    maps: np.ndarray | None = None  # (layers, heads, L, L), allocated when the first layer is complete
    layers_done: set[int] = field(default_factory=set)
    outputs: np.ndarray | None = None  # (L, hidden)
    opened: set[int | str] = field(default_factory=set)  # arrays whose first part has arrived


class IngestStaging:
    """Assembles the entries of one Ingest stream (the part after its begin).

    Args:
        layout: the namespace's layout; every array must fit it.
        max_bytes: most array bytes the stream may hold before its commit.
    """

    def __init__(self, layout: NamespaceLayout, *, max_bytes: int) -> None:
        self._layout = layout
        self._max_bytes = max_bytes
        self._staged = 0  # bytes allocated for arrays of this stream
        self._received = 0  # array bytes received
        self._done: list[NewEntry] = []
        self._pending: _Pending | None = None
        self._assembler = FrameAssembler(max_bytes)

    @property
    def received_bytes(self) -> int:
        """Array bytes received so far."""
        return self._received

    def add(self, message: pb.IngestRequest) -> bool:
        """Take one message after the begin; True when it is the commit.

        Raises:
            WireFormatError: a message out of order, an array that does not fit
                the layout, an incomplete entry, a second begin.
            ChecksumError: a frame's data does not match its crc32c.
            RequestLimitError: the stream would stage more than ``max_bytes``.
        """
        kind = message.WhichOneof("body")
        if kind == "entry":
            self._finish_entry()
            self._begin_entry(message.entry)
        elif kind == "maps":
            self._add_layer_part(message.maps)
        elif kind == "outputs":
            self._add_outputs_part(message.outputs)
        elif kind == "commit":
            self._finish_entry()
            return True
        else:
            raise WireFormatError(f"Ingest: unexpected {kind or 'empty'} message after the begin")
        return False

    def entries(self) -> list[NewEntry]:
        """The complete entries, in stream order (after the commit)."""
        return list(self._done)

    # ---- internals ----------------------------------------------------------

    def _begin_entry(self, begin: pb.EntryBegin) -> None:
        if begin.length < 1:
            raise WireFormatError(f"Ingest entry {len(self._done)}: length must be >= 1, got {begin.length}")
        feature = np.fromiter(begin.feature, dtype=np.float32, count=len(begin.feature)) if begin.feature else None
        token_ids = (
            np.fromiter(begin.token_ids, dtype=np.uint32, count=len(begin.token_ids)) if begin.token_ids else None
        )
        self._pending = _Pending(len(self._done), int(begin.length), bytes(begin.token_hash), feature, token_ids)

    def _entry(self, what: str) -> _Pending:
        if self._pending is None:
            raise WireFormatError(f"Ingest: {what} before any EntryBegin")
        return self._pending

    def _open(self, entry: _Pending, key: int | str, nbytes: int) -> None:
        """Account for a new array of ``nbytes`` before any memory is allocated for it."""
        if key in entry.opened:
            return
        if self._staged + nbytes > self._max_bytes:
            raise RequestLimitError(
                f"Ingest entry {entry.index}: staging {nbytes} more bytes would pass this stream's limit of"
                f" {self._max_bytes} bytes ({self._staged} staged); commit in smaller streams"
            )
        entry.opened.add(key)
        self._staged += nbytes

    def _check_part(
        self, entry: _Pending, what: str, frame: pb.MapFrame | pb.OutputFrame, shape: tuple[int, ...]
    ) -> int:
        """Check a part's dtype and whole-array shape; returns the array's size in bytes."""
        dtype = WIRE_DTYPES.get(frame.dtype)
        if dtype is None:
            raise WireFormatError(
                f"Ingest entry {entry.index} {what}: dtype must be one of {sorted(WIRE_DTYPES)}, got {frame.dtype!r}"
            )
        got = tuple(int(n) for n in frame.shape)
        if got != shape:
            raise WireFormatError(
                f"Ingest entry {entry.index} {what}: shape {got} does not fit the layout, expected {shape}"
            )
        self._received += len(frame.data)
        return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

    def _add_layer_part(self, frame: pb.MapFrame) -> None:
        entry = self._entry("a map frame")
        layout = self._layout
        if not 0 <= frame.layer < layout.layers:
            raise WireFormatError(
                f"Ingest entry {entry.index}: layer {frame.layer} is out of range 0..{layout.layers - 1}"
            )
        if frame.layer in entry.layers_done:
            raise WireFormatError(f"Ingest entry {entry.index}: layer {frame.layer} sent twice")
        shape = (layout.heads, entry.length, entry.length)
        layer_bytes = self._check_part(entry, f"layer {frame.layer}", frame, shape)
        if entry.maps_dtype is None:
            self._open(entry, "maps", layer_bytes * layout.layers)
            entry.maps_dtype = frame.dtype
        elif frame.dtype != entry.maps_dtype:
            raise WireFormatError(
                f"Ingest entry {entry.index}: layers of one entry must share one dtype,"
                f" got {frame.dtype!r} after {entry.maps_dtype!r}"
            )
        done = self._assembler.add(frame)
        if done is None:
            return
        _, layer_maps = done  # (heads, L, L)
        if entry.maps is None:
            entry.maps = np.empty((layout.layers, *shape), dtype=layer_maps.dtype)  # (layers, heads, L, L)
        entry.maps[frame.layer] = layer_maps
        entry.layers_done.add(frame.layer)

    def _add_outputs_part(self, frame: pb.OutputFrame) -> None:
        entry = self._entry("an outputs frame")
        if entry.outputs is not None:
            raise WireFormatError(f"Ingest entry {entry.index}: outputs sent twice")
        nbytes = self._check_part(entry, "outputs", frame, (entry.length, self._layout.hidden))
        self._open(entry, "outputs", nbytes)
        done = self._assembler.add(frame)
        if done is not None:
            entry.outputs = done[1]  # (L, hidden)

    def _finish_entry(self) -> None:
        entry, self._pending = self._pending, None
        if entry is None:
            return
        missing = sorted(set(range(self._layout.layers)) - entry.layers_done)
        if missing or self._assembler.incomplete:
            raise WireFormatError(
                f"Ingest entry {entry.index} is incomplete: layers {missing} missing"
                f" or {self._assembler.incomplete} arrays with parts missing"
            )
        assert entry.maps is not None  # allocated when the first layer completed, and every layer did
        self._done.append(
            NewEntry(maps=entry.maps, token_hash=TokenHash(entry.token_hash), outputs=entry.outputs,
                     feature=entry.feature, token_ids=entry.token_ids)
        )


_END = object()  # the request stream ended (or failed: the call is over either way)


def idle_limited(requests: Iterator[pb.IngestRequest], idle_seconds: float) -> Iterator[pb.IngestRequest]:
    """The messages of ``requests``; raises when none arrives for ``idle_seconds``.

    gRPC's request iterator blocks without a timeout, so a helper thread reads it
    and hands messages over a one-slot queue. Once the caller gives up, the call
    ends, the blocked read returns, and the helper exits.

    Raises:
        RequestLimitError: ``idle_seconds`` passed without a message (nothing is written).
    """
    handoff: queue.Queue[object] = queue.Queue(maxsize=1)
    stopped = threading.Event()  # the caller stopped taking messages: the helper must not wait to hand one over

    def hand_over(item: object) -> bool:
        while not stopped.is_set():
            try:
                handoff.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for message in requests:
                if not hand_over(message):
                    return
        except Exception:  # the call was cancelled or ended under the read: nothing left to take
            pass
        hand_over(_END)

    threading.Thread(target=read, name="attnstore-ingest-read", daemon=True).start()
    try:
        while True:
            try:
                message = handoff.get(timeout=idle_seconds)
            except queue.Empty:
                raise RequestLimitError(
                    f"the Ingest stream sent nothing for {idle_seconds} s, this daemon's idle limit: it was ended"
                    " and nothing of it was written; send a stream's messages without pauses"
                ) from None
            if message is _END:
                return
            assert isinstance(message, pb.IngestRequest)
            yield message
    finally:
        stopped.set()
