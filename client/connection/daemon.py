"""A small synchronous client of the daemon, for admin tools, tests and scripts, and the one the client's
daemon connection (``remote``) builds on.

Light on purpose: it imports grpc, numpy, the wire stubs and helpers and the
error types, never faiss, lmdb, zarr or the service. Every failed call raises
the AttnStore error the daemon's status stands for (see ``status_codes.error_from_rpc``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attnstore.protocol.chunks import ChunkLayout
from attnstore.protocol.messages import layout_to_pb, limits_to_pb
from attnstore.protocol.prefix import PrefixLayout
from attnstore.protocol.prefix_wire import chunk_layout_to_pb, prefix_layout_to_pb
from attnstore.protocol.records import NamespaceLayout, NewEntry, TokenLimits
from attnstore.protocol.requests import LookupResult, assembled_lookup, ingest_requests
from attnstore.protocol.status_codes import error_from_rpc
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.v1 import attnstore_pb2_grpc as pb_grpc
from attnstore_client.connection.channel import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_TARGET, open_channel, several_daemons
from attnstore_client.connection.resend import STREAM_RETRIES, StreamResend, guarded_stream, read_whole

T = TypeVar("T")


class DaemonClient:
    """Calls to one daemon over one channel. Use as a context manager, or ``close()``.

    Args:
        target: the daemon: ``grpc://HOST:PORT``, ``grpcs://HOST:PORT`` or ``HOST:PORT`` (see :func:`open_channel`).
        token: bearer token (read or admin); None sends none.
        timeout: default deadline per call in seconds (None: no deadline).
        channel: an open channel to use instead of making one (the TLS arguments are then ignored).
        tls, tls_ca, client_cert, client_key, max_message_bytes: see :func:`open_channel`.
        stream_retries: times a read-only stream broken by UNAVAILABLE is sent again, whole (None:
            ``STREAM_RETRIES`` when ``target`` names several daemons, else 0).
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        token: str | None = None,
        timeout: float | None = 60.0,
        channel: grpc.Channel | None = None,
        tls: bool = False,
        tls_ca: bytes | str | Path | None = None,
        client_cert: bytes | str | Path | None = None,
        client_key: bytes | str | Path | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        stream_retries: int | None = None,
    ) -> None:
        self.target = target
        self.stream_retries = (STREAM_RETRIES if several_daemons(target) else 0) if stream_retries is None \
            else stream_retries
        self._retried = 0
        self._retried_lock = threading.Lock()
        self._channel = channel or open_channel(
            target, tls=tls, tls_ca=tls_ca, client_cert=client_cert, client_key=client_key,
            max_message_bytes=max_message_bytes,
        )
        self._stub = pb_grpc.AttnStoreStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = timeout

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stub(self) -> pb_grpc.AttnStoreStub:
        """The raw stub, for calls this class does not wrap (made through :meth:`unary` and :meth:`read_stream`)."""
        return self._stub

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata (the bearer token), for calls made on ``stub``."""
        return self._metadata

    @property
    def streams_retried(self) -> int:
        """Read-only streams sent again after UNAVAILABLE so far (by this object and its users)."""
        return self._retried

    def stream_retried(self) -> None:
        """Count one read-only stream sent again (the FetchMaps and FetchPrefix readers count theirs here)."""
        with self._retried_lock:
            self._retried += 1

    def read_stream(self, read: Callable[[float | None], T], timeout: float | None = None) -> T:
        """``read(seconds left)``: one whole read-only stream on ``stub``, sent again whole after UNAVAILABLE
        (see ``resend.read_whole``); for streams this class does not wrap.

        Args:
            read: makes the call with the seconds left and returns what it received.
            timeout: deadline of every attempt together (None: this client's default).
        """
        return read_whole(read, resend=StreamResend(self.stream_retries, self.stream_retried),
                          limit=timeout or self._timeout)

    def unary(self, method: Callable[..., T], request: object, timeout: float | None = None) -> T:
        """``method(request)``, a unary method of ``stub``, with this client's metadata and deadline.

        Raises:
            AttnStoreError: the subclass the daemon's status stands for (see ``status_codes.error_from_rpc``).
        """
        try:
            return method(request, metadata=self._metadata, timeout=timeout or self._timeout)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc

    # ---- health -------------------------------------------------------------

    def health(self, service: str = "", timeout: float = 5.0) -> str:
        """The health status name ("SERVING", "NOT_SERVING", ...) of ``service`` ("" = the server)."""
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    # ---- namespaces ---------------------------------------------------------

    def create_namespace(
        self, name: str, *, model: str, fingerprint: str, layout: NamespaceLayout, projector: bytes | None = None,
        replace_projector: bool = False, limits: TokenLimits | None = None, prefix: PrefixLayout | None = None,
        chunks: ChunkLayout | None = None,
    ) -> pb.Namespace:
        """Create a namespace (admin); idempotent for the same model, fingerprint and layout.

        A projector different from the stored one is refused (ALREADY_EXISTS) unless ``replace_projector``.
        ``limits`` (the model's vocabulary size and maximum length), and the model's ``prefix`` and ``chunks``
        layouts (causal models), are recorded where the namespace has none (one it records already is kept).
        """
        request = pb.CreateNamespaceRequest(
            name=name, model=model, fingerprint=fingerprint, layout=layout_to_pb(layout),
            projector=projector or b"", replace_projector=replace_projector, limits=limits_to_pb(limits),
            prefix=None if prefix is None else prefix_layout_to_pb(prefix),
            chunks=None if chunks is None else chunk_layout_to_pb(chunks),
        )
        return self.unary(self._stub.CreateNamespace, request)

    def get_namespace(self, name: str, *, projector: bool = True) -> pb.Namespace:
        """One namespace, with its projector bytes unless ``projector`` is False."""
        return self.unary(self._stub.GetNamespace, pb.GetNamespaceRequest(name=name, without_projector=not projector))

    def list_namespaces(self) -> list[pb.Namespace]:
        """Every namespace (projector bytes left out)."""
        return list(self.unary(self._stub.ListNamespaces, pb.ListNamespacesRequest()).namespaces)

    # ---- serving ------------------------------------------------------------

    def iter_lookup(self, request: pb.LookupRequest, timeout: float | None = None) -> Iterator[pb.LookupResponse]:
        """The raw Lookup stream (matches first, then frames), for callers that consume it layer by layer.

        Never sent again: what was yielded cannot be taken back (:meth:`lookup` is).
        """
        try:
            seconds = timeout or self._timeout
            yield from guarded_stream(self._stub.Lookup(request, metadata=self._metadata, timeout=seconds), seconds)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc

    def lookup(self, request: pb.LookupRequest, timeout: float | None = None) -> LookupResult:
        """Run a Lookup and assemble every hit row's maps and outputs.

        A stream broken by a daemon going away is sent again, whole (see ``STREAM_RETRIES``).

        Raises:
            ChecksumError: a frame arrived damaged.
            WireFormatError: frames are inconsistent, or a row's layers are incomplete.
        """
        return self.read_stream(
            lambda left: assembled_lookup(
                guarded_stream(self._stub.Lookup(request, metadata=self._metadata, timeout=left), left)), timeout
        )

    def search(self, request: pb.SearchRequest, timeout: float | None = None) -> list[pb.Match]:
        """Matches only, no maps."""
        return list(self.unary(self._stub.Search, request, timeout).matches)

    def prefetch(self, namespace: str, entry_ids: Sequence[int]) -> pb.PrefetchResponse:
        """Queue entries for the DRAM cache; the reply says how many were queued and how many ids are unknown."""
        request = pb.PrefetchRequest(namespace=namespace, entry_ids=list(entry_ids))
        return self.unary(self._stub.Prefetch, request)

    # ---- admin --------------------------------------------------------------

    def ingest(
        self, namespace: str, fingerprint: str, entries: Iterable[NewEntry], timeout: float | None = None,
        *, projector_version: int = 0,
    ) -> pb.IngestSummary:
        """Ingest ``entries`` in one stream, all-or-nothing (admin); see ``ingest_requests``."""
        try:
            return self._stub.Ingest(
                ingest_requests(namespace, fingerprint, entries, projector_version=projector_version),
                metadata=self._metadata,
                timeout=timeout or self._timeout,
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc

    def write_back(
        self, namespace: str, fingerprint: str, rows: Sequence[pb.WrittenRow], timeout: float | None = None
    ) -> pb.WriteBackResponse:
        """Store computed rows' outputs for the exact tier (write or admin token); see ``protocol.write_back``."""
        request = pb.WriteBackRequest(namespace=namespace, fingerprint=fingerprint, rows=list(rows))
        return self.unary(self._stub.WriteBack, request, timeout)

    def delete(self, namespace: str, entry_ids: Sequence[int]) -> int:
        """Delete entries (admin); returns how many existed."""
        return self.unary(self._stub.Delete, pb.DeleteRequest(namespace=namespace, entry_ids=list(entry_ids))).deleted

    def drop_writer(self, namespace: str, writer: str, *, dry_run: bool = False) -> pb.DropWriterResponse:
        """Delete one writer's prefix blocks (and those chained after them) and chunks (admin); how many of each."""
        return self.unary(self._stub.DropWriter, pb.DropWriterRequest(namespace=namespace, writer=writer,
                                                                       dry_run=dry_run))

    def compact(self, timeout: float | None = None) -> pb.CompactResponse:
        """Compact the store (admin)."""
        return self.unary(self._stub.Compact, pb.CompactRequest(), timeout)

    def verify(self, timeout: float | None = None) -> pb.VerifyResponse:
        """Check every stored chunk (admin)."""
        return self.unary(self._stub.Verify, pb.VerifyRequest(), timeout)

    def stats(self) -> pb.StatsResponse:
        """Store statistics (read token suffices)."""
        return self.unary(self._stub.Stats, pb.StatsRequest())

    def iter_entries(
        self, namespace: str, *, maps_only: bool = False, writer: str = "", timeout: float | None = None
    ) -> Iterator[pb.StoredEntry]:
        """The namespace's live entries in id order, without maps (admin); ``maps_only`` leaves out
        entries that store outputs only, ``writer`` keeps only those that token name wrote back."""
        request = pb.ListEntriesRequest(namespace=namespace, maps_only=maps_only, writer=writer)
        try:
            yield from self._stub.ListEntries(request, metadata=self._metadata, timeout=timeout or self._timeout)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc

    def report_mismatch(
        self, namespace: str, fingerprint: str, kind: str, key: bytes, detail: str = "", timeout: float | None = None,
    ) -> pb.ReportMismatchResponse:
        """Report a stored object an audit found wrong (write or admin token): the daemon quarantines it and
        names its writer."""
        request = pb.ReportMismatchRequest(namespace=namespace, fingerprint=fingerprint, kind=kind, key=key,
                                           detail=detail)
        return self.unary(self._stub.ReportMismatch, request, timeout)

    def list_quarantine(self, namespace: str = "") -> list[pb.QuarantinedObject]:
        """The quarantined objects, of ``namespace`` only when given (admin)."""
        return list(self.unary(self._stub.ListQuarantine, pb.ListQuarantineRequest(namespace=namespace)).objects)

    def release_quarantine(
        self, namespace: str, kind: str, key: bytes, *, drop: bool = False
    ) -> pb.ReleaseQuarantineResponse:
        """Serve a quarantined object again, or (``drop``) delete it (admin)."""
        request = pb.ReleaseQuarantineRequest(namespace=namespace, kind=kind, key=key, drop=drop)
        return self.unary(self._stub.ReleaseQuarantine, request)

    def set_features(
        self, namespace: str, projector_version: int, entry_ids: Sequence[int], features: np.ndarray,
        timeout: float | None = None,
    ) -> pb.SetFeaturesResponse:
        """Give stored entries feature vectors (``(len(entry_ids), feature_dim)``) of the namespace's projector
        ``projector_version`` (admin); the reply counts them and lists ids no live entry has."""
        rows = np.asarray(features, dtype=np.float32)
        request = pb.SetFeaturesRequest(
            namespace=namespace, projector_version=projector_version,
            features=[pb.EntryFeature(entry_id=int(i), feature=row.tolist())
                      for i, row in zip(entry_ids, rows, strict=True)],
        )
        return self.unary(self._stub.SetFeatures, request, timeout)
