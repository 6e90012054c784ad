"""A daemon as the client's store (``grpc://HOST:PORT``), over ``attnstore.protocol.remote``.

One Lookup call per batch. The caller's thread reads the matches and the exact
rows' outputs (they come first); a reader thread then receives the map chunks,
layer 0 of every hit row first, and hands each completed layer to the forward,
which may already be running. Anything that goes wrong after the matches (a row
error, a bad checksum, the daemon going away, the deadline) marks the rows it
affects as failed; it never raises into the caller except through
:meth:`Retrieval.layer` as ``MapsUnavailableError``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np

from attnstore.errors import AttnStoreError, ChecksumError, ConfigError, MapsUnavailableError, WireFormatError
from attnstore.protocol.messages import layout_from_pb
from attnstore.protocol.records import LookupBatch
from attnstore.protocol.remote import DEFAULT_MAX_MESSAGE_BYTES, RemoteStore, channel_options, lookup_request
from attnstore.protocol.status_codes import error_from_rpc
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.wire import ChunkAssembler
from attnstore_client.connection import Match, MatchKind, NamespaceHandle, Retrieval, StoreConnection
from attnstore_client.connection.base import checked_projector
from attnstore_client.resilience import cause_of

log = logging.getLogger(__name__)

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
        self._remote = RemoteStore(target, token=token, timeout=None, channel=_channel(
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
        )

    def lookup(self, batch: LookupBatch, *, timeout: float | None) -> Retrieval:
        """See :meth:`StoreConnection.lookup`."""
        # The raw call, not RemoteStore.iter_lookup: the reader thread must be able to cancel it.
        call = self._remote.stub.Lookup(lookup_request(batch), metadata=self._remote.metadata, timeout=timeout)
        return _StreamedRetrieval(call)

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
    options = [
        *channel_options(max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]
    if not tls:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(**pem), options=options)


class _StreamedRetrieval(Retrieval):
    """The answer of one Lookup stream, received on a reader thread after the matches and outputs."""

    def __init__(self, call: grpc.Call) -> None:
        self._call = call
        stream: Iterator[pb.LookupResponse] = call
        start = time.perf_counter()
        try:
            first = next(stream, None)
            if first is None or first.WhichOneof("body") != "matches":
                raise WireFormatError("a Lookup stream must start with the matches")
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc
        matches = [
            Match(_KIND[m.kind], m.entry_id if m.kind != pb.MATCH_KIND_MISS else None, m.distance,
                  m.stored_length or None)
            for m in first.matches.matches
        ]
        super().__init__(matches, {})
        self._assembler = ChunkAssembler(max_array_bytes=1 << 40)
        self._cond = threading.Condition()
        self._layers: dict[tuple[int, int], np.ndarray] = {}
        self._failed: dict[int, str] = {}
        self._done = False
        pending = self._read_outputs(stream)
        self._outputs_seconds = self.fetch_seconds = time.perf_counter() - start
        if pending is None or not self.map_rows:
            self._finish(None)
            return
        self._reader = threading.Thread(target=self._read_maps, args=(pending, stream), name="attnstore-lookup",
                                        daemon=True)
        self._reader.start()

    def _read_outputs(self, stream: Iterator[pb.LookupResponse]) -> pb.LookupResponse | None:
        """Receive the exact rows' outputs; return the first message after them (None: the stream ended)."""
        try:
            for message in stream:
                if message.WhichOneof("body") != "outputs":
                    return message
                done = self._assembler.add(message.outputs)
                self.bytes_fetched += len(message.outputs.data)
                if done is not None:
                    (row, _), array = done
                    self.outputs[row] = array  # (L, hidden)
        except (grpc.RpcError, AttnStoreError) as exc:
            # Outputs not complete are dropped: those rows will be computed.
            self._fail_all(exc)
        return None

    def _read_maps(self, first: pb.LookupResponse, stream: Iterator[pb.LookupResponse]) -> None:
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            for message in _chain(first, stream):
                kind = message.WhichOneof("body")
                if kind == "error":
                    log.warning("store could not serve row %d (entry %d): %s %s", message.error.query_index,
                                message.error.entry_id, message.error.code, message.error.message)
                    cause = "checksum" if message.error.code == "DATA_LOSS" else "row_error"
                    self._fail_row(message.error.query_index, cause)
                    continue
                if kind != "chunk":
                    raise WireFormatError(f"unexpected {kind!r} message among the map chunks of a Lookup")
                row = message.chunk.query_index
                if row in self._failed:
                    continue
                self.bytes_fetched += len(message.chunk.data)
                try:
                    done = self._assembler.add(message.chunk)
                except ChecksumError as exc:
                    # Damaged in transit: only this row is lost, the others keep coming.
                    log.warning("map chunk of row %d failed its checksum: %s", row, exc)
                    self._fail_row(row, "checksum")
                    continue
                if done is not None:
                    (row, layer), array = done
                    with self._cond:
                        self._layers[(row, int(layer))] = array  # (heads, L, L)
                        self._cond.notify_all()
        except (grpc.RpcError, AttnStoreError) as exc:
            error = exc
        finally:
            self.fetch_seconds = self._outputs_seconds + time.perf_counter() - start
            self._finish(error)

    def _fail_row(self, row: int, cause: str) -> None:
        with self._cond:
            self._failed.setdefault(row, cause)
            self._cond.notify_all()

    def _fail_all(self, exc: BaseException) -> None:
        error = error_from_rpc(exc) if isinstance(exc, grpc.RpcError) else exc
        log.warning("Lookup stream broke: %s", error)
        with self._cond:
            self.outage = error
            for row in self.map_rows:
                self._failed.setdefault(row, cause_of(error))
            self._cond.notify_all()

    def _finish(self, error: BaseException | None) -> None:
        """The stream ended: rows still missing layers fail (with the stream's error, if any)."""
        if error is not None and not (isinstance(error, grpc.RpcError) and error.code() is grpc.StatusCode.CANCELLED
                                      and self._done):
            self._fail_all(error)
        with self._cond:
            for row in self.map_rows:
                if row not in self._failed and not self._complete(row):
                    self._failed[row] = "bad_data"
            self._done = True
            self._cond.notify_all()

    def _complete(self, row: int) -> bool:
        # Layers stream in order for every row together, so a row is whole when it has every layer any row has.
        every = {layer for (_, layer) in self._layers}
        return bool(every) and every <= {layer for (r, layer) in self._layers if r == row}

    def layer(self, row: int, layer: int) -> np.ndarray:
        """See :meth:`Retrieval.layer`."""
        with self._cond:
            self._cond.wait_for(lambda: (row, layer) in self._layers or row in self._failed or self._done)
            array = self._layers.get((row, layer))
            if row in self._failed or array is None:
                cause = self._failed.get(row, "bad_data")
                raise MapsUnavailableError(f"row {row}: layer {layer} of its maps did not arrive ({cause})",
                                           row=row, cause=cause)
            return array

    def failed(self) -> dict[int, str]:
        """See :meth:`Retrieval.failed`."""
        with self._cond:
            return dict(self._failed)

    def wait(self) -> None:
        """See :meth:`Retrieval.wait`."""
        with self._cond:
            self._cond.wait_for(lambda: self._done)

    def close(self) -> None:
        """Cancel the call if it still streams."""
        with self._cond:
            finished = self._done
            self._done = True
        if not finished:
            self._call.cancel()


def _chain(first: pb.LookupResponse, rest: Iterator[pb.LookupResponse]) -> Iterator[pb.LookupResponse]:
    yield first
    yield from rest
