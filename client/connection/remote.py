"""A daemon as the client's store (``grpc://HOST:PORT``), over ``daemon.DaemonClient``.

``exact`` is one exact-only Lookup (token hashes in, stored outputs out);
``search`` one Search (matches only: the daemon reads the hits ahead into its
DRAM cache); ``fetch_maps`` one FetchMaps whose frames a reader thread receives,
layer 0 of every row first, handing each completed layer to the forward, which
may already be running. A stream whose daemon goes away (UNAVAILABLE) is sent
again to the daemons still there (``STREAM_RETRIES`` times, over several
daemons). Anything else that goes wrong once the maps stream (a row error, a
bad checksum, the deadline, the last resend failing too) marks the rows it
affects as failed; it never raises into the caller except through
:meth:`MapStream.layer` as ``MapsUnavailableError``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal

import grpc
import numpy as np

from attnstore.errors import (
    AttnStoreError,
    ChecksumError,
    ConfigError,
    FingerprintMismatchError,
    MapsUnavailableError,
    WireFormatError,
)
from attnstore.protocol.chunks import ChunkLayout, StoredChunk
from attnstore.protocol.messages import layout_from_pb
from attnstore.protocol.prefix import PrefixBlock, PrefixLayout
from attnstore.protocol.prefix_wire import (
    chains_to_pb,
    chunk_layout_from_pb,
    prefix_block_put,
    prefix_layout_from_pb,
    prefix_layout_to_pb,
)
from attnstore.protocol.records import LookupBatch
from attnstore.protocol.requests import exact_request, search_request
from attnstore.protocol.status_codes import error_from_rpc
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.wire import FrameAssembler
from attnstore.protocol.write_back import row_to_pb
from attnstore_client.connection import remote_chunks
from attnstore_client.connection.base import (
    ChunkPutCounts,
    MapStream,
    Match,
    MatchKind,
    MismatchReport,
    NamespaceHandle,
    PrefixPutCounts,
    PrefixStream,
    RefusedRow,
    RowToWrite,
    StoreConnection,
    WriteBackCounts,
    checked_projector,
)
from attnstore_client.connection.channel import DEFAULT_MAX_MESSAGE_BYTES, channel_options, grpc_target
from attnstore_client.connection.daemon import DaemonClient
from attnstore_client.connection.remote_prefix import StreamedPrefix
from attnstore_client.connection.resend import ResendingStream, StreamResend
from attnstore_client.resilience import cause_of

log = logging.getLogger(__name__)

# How long past its deadline a FetchMaps stream is waited for before its rows are given up.
_DEADLINE_SLACK_S = 1.0
_KIND: dict[int, MatchKind] = {pb.MATCH_KIND_MISS: "miss", pb.MATCH_KIND_EXACT: "exact", pb.MATCH_KIND_MAP: "map"}


class RemoteConnection(StoreConnection):
    """A daemon reached over gRPC.

    Args:
        url: the ``grpc://`` or ``grpcs://`` URL, for messages.
        target: ``HOST:PORT``.
        token: bearer token (read role suffices).
        tls, tls_ca: TLS, and the CA file that signed the daemon's certificate.
        client_cert, client_key: this client's certificate chain and key (PEM files), for a daemon that requires mTLS.
        max_message_bytes: message cap both ways (None: the daemon's default, 8 MiB).
    """

    def __init__(
        self,
        url: str,
        target: str,
        *,
        token: str | None,
        tls: bool,
        tls_ca: str | Path | None,
        max_message_bytes: int | None,
        client_cert: str | Path | None = None,
        client_key: str | Path | None = None,
    ) -> None:
        self.url = url
        if (client_cert is None) != (client_key is None):
            raise ConfigError("mTLS needs both a client certificate and its key")
        pem = {name: _read_pem(path) for name, path in
               (("root_certificates", tls_ca), ("certificate_chain", client_cert), ("private_key", client_key))}
        self._prefix_layouts: dict[str, PrefixLayout] = {}  # by namespace, as namespace() last read them
        self._remote = DaemonClient(target, token=token, timeout=None, channel=_channel(
            target, tls=tls, pem=pem, max_message_bytes=max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES))

    def namespace(self, name: str) -> NamespaceHandle:
        """See :meth:`StoreConnection.namespace`."""
        info = self._remote.get_namespace(name)
        layout = layout_from_pb(info.layout)
        return NamespaceHandle(
            name=info.name, model=info.model, fingerprint=info.fingerprint, layers=layout.layers,
            heads=layout.heads, causal=layout.causal, hidden=layout.hidden, feature_dim=layout.feature_dim,
            projector=checked_projector(
                info.name, bytes(info.projector) or None,
                info.projector_crc32c if info.HasField("projector_crc32c") else None,
            ),
            projector_version=info.projector_version,
            prefix=self._prefix_layouts.setdefault(name, prefix_layout_from_pb(info.prefix))
            if info.HasField("prefix") else None,
            chunks=chunk_layout_from_pb(info.chunks) if info.HasField("chunks") else None,
        )

    def exact(
        self, namespace: str, fingerprint: str, token_hashes: Sequence[bytes], lengths: Sequence[int], *,
        timeout: float | None,
    ) -> dict[int, np.ndarray]:
        """See :meth:`StoreConnection.exact`."""
        request = exact_request(namespace, fingerprint, token_hashes, lengths)
        return dict(self._remote.lookup(request, timeout=timeout).outputs)

    def exact_admitting(
        self, namespace: str, fingerprint: str, token_hashes: Sequence[bytes], lengths: Sequence[int], *,
        timeout: float | None,
    ) -> tuple[dict[int, np.ndarray], frozenset[int]]:
        """See :meth:`StoreConnection.exact_admitting`: the daemon marks admitted misses in the matches."""
        result = self._remote.lookup(exact_request(namespace, fingerprint, token_hashes, lengths), timeout=timeout)
        return dict(result.outputs), frozenset(m.query_index for m in result.matches if m.admit)

    @property
    def supports_write_back(self) -> bool:
        """A daemon takes written-back rows (given a write or admin token)."""
        return True

    def write_back(
        self, namespace: str, fingerprint: str, rows: Sequence[RowToWrite], *, timeout: float | None,
    ) -> WriteBackCounts:
        """See :meth:`StoreConnection.write_back`: one WriteBack call."""
        messages = [row_to_pb(r.token_ids, r.outputs, r.maps, r.feature, r.projector_version) for r in rows]
        reply = self._remote.write_back(namespace, fingerprint, messages, timeout=timeout)
        refused = tuple(RefusedRow(r.query_index, r.code, r.message) for r in reply.refused)
        return WriteBackCounts(reply.stored, reply.duplicates, reply.not_admitted, reply.maps_stored, refused)

    @property
    def supports_quarantine(self) -> bool:
        """A daemon quarantines reported objects (given a write or admin token)."""
        return True

    def report_mismatch(
        self, namespace: str, fingerprint: str, kind: Literal["row", "prefix", "chunk"], key: bytes, *, detail: str,
        timeout: float | None,
    ) -> MismatchReport:
        """See :meth:`StoreConnection.report_mismatch`: one ReportMismatch call."""
        reply = self._remote.report_mismatch(namespace, fingerprint, kind, key, detail, timeout=timeout)
        item = reply.object
        return MismatchReport(reply.found, reply.quarantined, item.writer or None,
                              int(item.entry_id) if item.has_entry_id else None)

    def search(self, batch: LookupBatch, *, timeout: float | None) -> list[Match]:
        """See :meth:`StoreConnection.search`."""
        return [
            Match(_KIND[m.kind], m.entry_id if m.kind != pb.MATCH_KIND_MISS else None, m.distance,
                  m.stored_length or None)
            for m in self._remote.search(search_request(batch), timeout=timeout)
        ]

    def fetch_maps(
        self, namespace: str, fingerprint: str, rows: Sequence[tuple[int, int]], *, timeout: float | None
    ) -> MapStream:
        """See :meth:`StoreConnection.fetch_maps`."""
        request = pb.FetchMapsRequest(
            namespace=namespace, fingerprint=fingerprint,
            rows=[pb.FetchRow(entry_id=entry_id, length=length) for entry_id, length in rows],
        )
        # The raw call, not a DaemonClient helper: the reader thread must be able to cancel it.
        return _StreamedMaps(
            lambda left: self._remote.stub.FetchMaps(request, metadata=self._remote.metadata, timeout=left),
            len(rows), None if timeout is None else time.monotonic() + timeout, self._resend,
        )

    def prefix_layout(self, namespace: str) -> PrefixLayout | None:
        """See :meth:`StoreConnection.prefix_layout`: one GetNamespace without the projector's bytes."""
        info = self._remote.get_namespace(namespace, projector=False)
        if not info.HasField("prefix"):
            return None
        return self._prefix_layouts.setdefault(namespace, prefix_layout_from_pb(info.prefix))

    def match_prefix(
        self, namespace: str, fingerprint: str, block_size: int, rows: Sequence[Sequence[bytes]], *,
        timeout: float | None,
    ) -> list[int]:
        """See :meth:`StoreConnection.match_prefix`: one PrefixMatch."""
        request = pb.PrefixMatchRequest(namespace=namespace, fingerprint=fingerprint, block_size=block_size,
                                        rows=chains_to_pb(rows))
        return list(self._remote.unary(self._remote.stub.PrefixMatch, request, timeout).blocks)

    def fetch_prefix(
        self, namespace: str, fingerprint: str, block_size: int, rows: Sequence[Sequence[bytes]], *,
        timeout: float | None,
    ) -> PrefixStream:
        """See :meth:`StoreConnection.fetch_prefix`: one FetchPrefix, received on a reader thread."""
        layout = self._prefix_layouts.get(namespace) or self.namespace(namespace).prefix
        if layout is None:
            raise FingerprintMismatchError(f"namespace {namespace!r} stores no prefix blocks")
        request = pb.FetchPrefixRequest(namespace=namespace, fingerprint=fingerprint, block_size=block_size,
                                        rows=chains_to_pb(rows))
        return StreamedPrefix(
            lambda left: self._remote.stub.FetchPrefix(request, metadata=self._remote.metadata, timeout=left),
            len(rows), layout.layers, None if timeout is None else time.monotonic() + timeout, self._resend,
        )

    def put_prefix(
        self, namespace: str, fingerprint: str, layout: PrefixLayout, blocks: Sequence[PrefixBlock], *,
        timeout: float | None,
    ) -> PrefixPutCounts:
        """See :meth:`StoreConnection.put_prefix`: one PutPrefix (a write token)."""
        request = pb.PutPrefixRequest(namespace=namespace, fingerprint=fingerprint, layout=prefix_layout_to_pb(layout),
                                      blocks=[prefix_block_put(block) for block in blocks])
        reply = self._remote.unary(self._remote.stub.PutPrefix, request, timeout)
        return PrefixPutCounts(int(reply.stored), int(reply.duplicates), int(reply.not_admitted))

    def match_chunks(
        self, namespace: str, fingerprint: str, layout: ChunkLayout, keys: Sequence[bytes], *, timeout: float | None,
    ) -> list[int | None]:
        """See :meth:`StoreConnection.match_chunks`: one ChunkMatch."""
        return remote_chunks.match_chunks(self._remote, namespace, fingerprint, layout, keys, timeout)

    def fetch_chunks(
        self, namespace: str, fingerprint: str, layout: ChunkLayout, keys: Sequence[bytes], *, timeout: float | None,
    ) -> list[np.ndarray | AttnStoreError]:
        """See :meth:`StoreConnection.fetch_chunks`: one FetchChunks, received whole."""
        return remote_chunks.fetch_chunks(self._remote, namespace, fingerprint, layout, keys, timeout)

    def put_chunks(
        self, namespace: str, fingerprint: str, layout: ChunkLayout, chunks: Sequence[StoredChunk], *,
        timeout: float | None,
    ) -> ChunkPutCounts:
        """See :meth:`StoreConnection.put_chunks`: one PutChunks (a write token)."""
        return remote_chunks.put_chunks(self._remote, namespace, fingerprint, layout, chunks, timeout)

    @property
    def streams_retried(self) -> int:
        """Read-only streams sent again after UNAVAILABLE so far (see ``STREAM_RETRIES``)."""
        return self._remote.streams_retried

    @property
    def _resend(self) -> StreamResend:
        return StreamResend(self._remote.stream_retries, self._remote.stream_retried)

    def health(self) -> str:
        """See :meth:`StoreConnection.health`."""
        return self._remote.health()

    def close(self) -> None:
        """Close the channel."""
        self._remote.close()


def _read_pem(path: str | Path | None) -> bytes | None:
    try:
        return None if path is None else Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read PEM file {path}: {exc.strerror or exc}") from None


def _channel(target: str, *, tls: bool, pem: dict[str, bytes | None], max_message_bytes: int) -> grpc.Channel:
    """A channel that reconnects quickly: the circuit breaker, not gRPC's backoff, paces retries.

    gRPC's default reconnect backoff (1 s, growing to 120 s) would fail the
    breaker's half-open trial call for minutes after the daemon is back.
    """
    grpc_address, balancing = grpc_target(target)  # several daemons: round_robin over them, with retries
    options: list[tuple[str, str | int]] = [
        *channel_options(max_message_bytes),
        *balancing,
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]
    if not tls:
        return grpc.insecure_channel(grpc_address, options=options)
    return grpc.secure_channel(grpc_address, grpc.ssl_channel_credentials(**pem), options=options)


class _StreamedMaps(MapStream):
    """The frames of one FetchMaps stream, received on a reader thread.

    ``open_call(seconds left)`` makes the call; ``resend`` says how often one broken by UNAVAILABLE is made
    again. The rows name entry ids, and an entry's maps never change (ids are never reused), so layers
    already whole stay and the new stream's copies of them are skipped; partial layers are dropped.
    """

    def __init__(
        self, open_call: Callable[[float | None], grpc.Call], rows: int, deadline: float | None, resend: StreamResend,
    ) -> None:
        super().__init__()
        self._deadline = deadline
        self._rows = range(rows)
        self._layers: dict[tuple[int, int], np.ndarray] = {}
        self._failed: dict[int, str] = {}
        self._done = False
        self._stream = ResendingStream("FetchMaps", open_call, resend, deadline, receive=self._receive,
                                       finish=self._finish, closed=lambda: self._done, thread="attnstore-maps")
        self._cond = self._stream.cond
        self._stream.start()

    def _receive(self, stream: Iterator[pb.LookupResponse]) -> None:
        """Take one attempt's messages (raises what breaks it)."""
        assembler = FrameAssembler(max_array_bytes=1 << 40)  # a fresh one: a broken stream's partial layers go
        for message in stream:
            kind = message.WhichOneof("body")
            if kind == "error":
                log.warning("store could not serve row %d (entry %d): %s %s", message.error.query_index,
                            message.error.entry_id, message.error.code, message.error.message)
                cause = "checksum" if message.error.code == "DATA_LOSS" else "row_error"
                self._fail_row(message.error.query_index, cause)
                continue
            if kind != "maps":
                raise WireFormatError(f"unexpected {kind!r} message among the map frames of a FetchMaps")
            row = message.maps.query_index
            if row in self._failed or (row, message.maps.layer) in self._layers:
                continue
            self.bytes_fetched += len(message.maps.data)
            try:
                done = assembler.add(message.maps)
            except ChecksumError as exc:
                # Damaged in transit: only this row is lost, the others keep coming.
                log.warning("map frame of row %d failed its checksum: %s", row, exc)
                self._fail_row(row, "checksum")
                continue
            if done is not None:
                (row, layer), array = done
                with self._cond:
                    self._layers[(row, int(layer))] = array  # (heads, L, L)
                    self._cond.notify_all()

    def _fail_row(self, row: int, cause: str) -> None:
        with self._cond:
            self._failed.setdefault(row, cause)
            self._cond.notify_all()

    def _fail_all(self, exc: BaseException) -> None:
        error = error_from_rpc(exc) if isinstance(exc, grpc.RpcError) else exc
        log.warning("FetchMaps stream broke: %s", error)
        with self._cond:
            self.outage = error
            for row in self._rows:
                self._failed.setdefault(row, cause_of(error))
            self._cond.notify_all()

    def _finish(self, error: BaseException | None, seconds: float) -> None:
        """The stream ended: rows still missing layers fail (with the stream's error, if any)."""
        self.fetch_seconds = seconds
        if error is not None and not (isinstance(error, grpc.RpcError) and error.code() is grpc.StatusCode.CANCELLED
                                      and self._done):
            self._fail_all(error)
        with self._cond:
            for row in self._rows:
                if row not in self._failed and not self._complete(row):
                    self._failed[row] = "bad_data"
            self._done = True
            self._cond.notify_all()

    def _complete(self, row: int) -> bool:
        # Layers stream in order for every row together, so a row is whole when it has every layer any row has.
        every = {layer for (_, layer) in self._layers}
        return bool(every) and every <= {layer for (r, layer) in self._layers if r == row}

    def _wait_for(self, ready: Callable[[], bool]) -> None:
        """Wait (holding the lock) until ``ready``; past the call's deadline every row still open fails.

        gRPC ends the call at its deadline; this bound holds even when a call caught in a
        daemon's shutdown is never ended by gRPC, so a forward never waits forever.
        """
        remaining = None if self._deadline is None else self._deadline - time.monotonic() + _DEADLINE_SLACK_S
        if not self._cond.wait_for(ready, timeout=remaining):
            log.warning("FetchMaps stream passed its deadline; computing the rows still waiting")
            for row in self._rows:
                if not self._complete(row):
                    self._failed.setdefault(row, "timeout")
            self._done = True
            self._stream.cancel()

    def layer(self, row: int, layer: int) -> np.ndarray:
        """See :meth:`MapStream.layer`."""
        with self._cond:
            self._wait_for(lambda: (row, layer) in self._layers or row in self._failed or self._done)
            array = self._layers.get((row, layer))
            if row in self._failed or array is None:
                cause = self._failed.get(row, "bad_data")
                raise MapsUnavailableError(f"row {row}: layer {layer} of its maps did not arrive ({cause})",
                                           row=row, cause=cause)
            return array

    def failed(self) -> dict[int, str]:
        """See :meth:`MapStream.failed`."""
        with self._cond:
            return dict(self._failed)

    def wait(self) -> None:
        """See :meth:`MapStream.wait`."""
        with self._cond:
            self._wait_for(lambda: self._done)

    def close(self) -> None:
        """Cancel the call if it still streams."""
        with self._cond:
            finished = self._done
            self._done = True
        if not finished:
            self._stream.cancel()
