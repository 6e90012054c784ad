"""A small synchronous client of the daemon, for admin tools, tests and scripts.

Light on purpose: it imports grpc, numpy, the wire stubs and helpers and the
error types, never faiss, lmdb, zarr or the service, so the inference-node
client library may build on it. Every failed call raises the AttnStore error
the daemon's status stands for (see ``status_codes.error_from_rpc``).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attnstore.errors import ConfigError, WireFormatError
from attnstore.protocol.messages import layout_to_pb, limits_to_pb
from attnstore.protocol.records import LookupBatch, NamespaceLayout, NewEntry, TokenLimits
from attnstore.protocol.status_codes import error_from_rpc
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.v1 import attnstore_pb2_grpc as pb_grpc
from attnstore.protocol.wire import ChunkAssembler, map_chunks, output_chunks

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_MAX_MESSAGE_BYTES = 8 << 20  # the daemon's default; chunks are at most 4 MiB
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AttnStore"].full_name

T = TypeVar("T")
log = logging.getLogger(__name__)


# A call in flight pings its daemon this often, and gives the connection up when a ping is not answered
# within the timeout: a daemon that stopped answering (SIGSTOP, a host gone, a half-open TCP connection)
# then fails the call in about 30 s even without a deadline (``timeout=None``). The daemon accepts pings
# this often (``server.KEEPALIVE_MIN_PING_MS``).
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """gRPC channel options with explicit message sizes (match the daemon's) and keepalive pings during calls."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),  # gRPC's own bound on a ping's answer (else 60 s)
        ("grpc.keepalive_permit_without_calls", 0),  # an idle channel costs the daemon nothing
        ("grpc.http2.max_pings_without_data", 0),  # a long wait for maps sends no data, and must be pinged
    ]


def _pem(value: bytes | str | Path | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    try:
        return Path(value).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read PEM file {value}: {exc.strerror or exc}") from None


# Daemon address forms, the same for every client and command: grpc:// is plaintext,
# grpcs:// is TLS, and a bare HOST:PORT is TLS only when TLS options are given.
TARGET_FORMS = "grpc://HOST:PORT, grpcs://HOST:PORT or HOST:PORT"


def split_target(target: str) -> tuple[str, bool | None]:
    """``(HOST:PORT, tls)`` of a daemon address: tls True for grpcs://, False for grpc://, None when bare.

    Raises:
        ConfigError: another scheme (``http://``...), or nothing after the scheme.
    """
    scheme, sep, address = target.partition("://")
    if not sep:
        return target, None
    if scheme not in ("grpc", "grpcs") or not address:
        raise ConfigError(f"daemon address {target!r} is not one of {TARGET_FORMS}")
    return address, scheme == "grpcs"


# Several daemons: gRPC's round_robin spreads calls over every address that answers, and a call that
# meets a daemon going away (UNAVAILABLE) before any reply is sent again, to another one. Writes included:
# an Ingest resent finds what it had stored as duplicates; one of more than gRPC's 256 KiB retry buffer
# is not resent.
_SEVERAL_RETRIES = {
    "methodConfig": [{
        "name": [{"service": SERVICE_NAME}],
        "retryPolicy": {
            "maxAttempts": 5, "initialBackoff": "0.05s", "maxBackoff": "1s", "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }],
}
ADDRESS_FORMS = "HOST:PORT, IP:PORT,IP:PORT,... (several daemons) or dns:///NAME:PORT (every address NAME resolves to)"

# gRPC's retries stop at a call's first reply message: a read-only stream (Lookup, Fetch, FetchMaps,
# FetchPrefix) whose daemon dies after that ends UNAVAILABLE. Over several daemons it is sent again, whole,
# this many times more (round_robin picks a daemon still there), within the call's deadline; what the broken
# stream delivered is discarded. Write-type calls (Ingest, WriteBack, Delete) are never sent again mid-stream.
STREAM_RETRIES = 2
STREAM_RETRY_PAUSE_S = 0.05  # gRPC notices the dead daemon's connection meanwhile


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
    """How a stream received on a reader thread is sent again: ``retries`` times at most, each ``count``-ed."""

    retries: int
    count: Callable[[], None]


def several_daemons(target: str) -> bool:
    """Whether ``target`` names several daemons (a list, or a DNS name): calls are balanced over them."""
    return bool(grpc_target(split_target(target)[0])[1])


def grpc_target(address: str) -> tuple[str, list[tuple[str, str | int]]]:
    """The gRPC target and extra channel options of a daemon address (the part after ``grpc://``).

    ``HOST:PORT`` is one daemon (the first address HOST resolves to). A
    comma-separated list of ``IP:PORT`` becomes gRPC's ``ipv4:``/``ipv6:`` target, and
    ``dns:///NAME:PORT`` stays a DNS target; both get round_robin load balancing over every address
    and retries of calls a daemon refused while going away.

    Raises:
        ConfigError: a list with an empty item, an item without a port, a host name in a list (gRPC
            resolves names only one at a time: give one DNS name), or IPv4 and IPv6 mixed.
    """
    several: list[tuple[str, str | int]] = [("grpc.lb_policy_name", "round_robin"), ("grpc.enable_retries", 1),
               ("grpc.service_config", json.dumps(_SEVERAL_RETRIES))]
    if address.startswith("dns:"):
        return address, several
    if "," not in address:
        return address, []  # one daemon: gRPC's defaults, as before
    families = set()
    for item in address.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"daemon address {address!r}: {item!r} is not IP:PORT; the forms are {ADDRESS_FORMS}")
        try:
            families.add(ipaddress.ip_address(host.strip("[]")).version)
        except ValueError:
            raise ConfigError(
                f"daemon address {address!r}: {host!r} is not an IP address; a list takes IP:PORT items, and"
                f" several daemons behind one name are dns:///NAME:PORT (the forms are {ADDRESS_FORMS})"
            ) from None
    if len(families) > 1:
        raise ConfigError(f"daemon address {address!r} mixes IPv4 and IPv6 addresses: gRPC takes one family per list")
    scheme = "ipv4" if families == {4} else "ipv6"
    return f"{scheme}:{','.join(item.strip() for item in address.split(','))}", several


def open_channel(
    target: str,
    *,
    tls: bool = False,
    tls_ca: bytes | str | Path | None = None,
    client_cert: bytes | str | Path | None = None,
    client_key: bytes | str | Path | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> grpc.Channel:
    """A channel to the daemon at ``target`` (``grpc://HOST:PORT``, ``grpcs://HOST:PORT`` or ``HOST:PORT``).

    Args:
        target: daemon address; grpcs:// implies ``tls``, grpc:// refuses the TLS arguments.
        tls: use TLS (implied by any of the PEM arguments); system roots when no ``tls_ca``.
        tls_ca: CA certificate(s) that signed the daemon's certificate (PEM bytes or path).
        client_cert: this client's certificate chain, for mTLS.
        client_key: this client's private key, for mTLS.
        max_message_bytes: message size limit both ways.

    Raises:
        ConfigError: a PEM file cannot be read, only one of client cert and key is given, the
            address is malformed, or TLS arguments come with a grpc:// (plaintext) address.
    """
    if (client_cert is None) != (client_key is None):
        raise ConfigError("mTLS needs both a client certificate and its key")
    address, scheme_tls = split_target(target)
    grpc_address, balancing = grpc_target(address)
    options: list[tuple[str, str | int]] = [*channel_options(max_message_bytes), *balancing]
    wants_tls = bool(tls or tls_ca or client_cert)
    if scheme_tls is False and wants_tls:
        raise ConfigError(f"TLS options are given but {target!r} is plaintext: use grpcs://{address}")
    if not (wants_tls or scheme_tls):
        return grpc.insecure_channel(grpc_address, options=options)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_pem(tls_ca), private_key=_pem(client_key), certificate_chain=_pem(client_cert)
    )
    return grpc.secure_channel(grpc_address, credentials, options=options)


@dataclass(frozen=True, slots=True)
class LookupResult:
    """A Lookup's answer, assembled: matches, and the arrays of the hit rows by query index."""

    matches: list[pb.Match]  # one per query, in order
    maps: dict[int, np.ndarray] = field(default_factory=dict)  # query -> (layers, heads, L, L) of MAP rows
    outputs: dict[int, np.ndarray] = field(default_factory=dict)  # query -> (L, hidden) of EXACT rows
    row_errors: dict[int, pb.RowError] = field(default_factory=dict)  # MAP rows the daemon could not serve


def lookup_request(batch: LookupBatch, *, want_maps: bool = True, want_outputs: bool | None = None) -> pb.LookupRequest:
    """The LookupRequest of ``batch``.

    Args:
        batch: the rows to look up.
        want_maps: stream the map hits' maps (else matches and outputs only).
        want_outputs: consult the exact tier and stream its outputs; by default
            when the batch has token hashes.
    """
    hashes = batch.token_hashes if batch.token_hashes is not None else [None] * batch.size
    ids = batch.token_ids if batch.token_ids is not None else [()] * batch.size
    return pb.LookupRequest(
        namespace=batch.namespace,
        fingerprint=batch.fingerprint,
        queries=[
            pb.Query(feature=row.tolist(), length=int(length), token_hash=token_hash or b"", token_ids=list(row_ids))
            for row, length, token_hash, row_ids in zip(batch.features, batch.lengths, hashes, ids, strict=True)
        ],
        max_distance=batch.max_distance,
        want_maps=want_maps,
        want_outputs=batch.exact if want_outputs is None else want_outputs,
        gate=batch.gate,
        projector_version=batch.projector_version,
    )


def exact_request(
    namespace: str, fingerprint: str, token_hashes: Sequence[bytes], lengths: Sequence[int]
) -> pb.LookupRequest:
    """A Lookup of the exact tier alone: the rows' token hashes and lengths, no features, nothing searched."""
    return pb.LookupRequest(
        namespace=namespace,
        fingerprint=fingerprint,
        queries=[
            pb.Query(length=int(length), token_hash=bytes(token_hash))
            for token_hash, length in zip(token_hashes, lengths, strict=True)
        ],
        want_outputs=True,
        exact_only=True,
    )


def search_request(batch: LookupBatch) -> pb.SearchRequest:
    """The SearchRequest of ``batch``: the map tier's matches only (token hashes are not sent)."""
    ids = batch.token_ids if batch.token_ids is not None else [()] * batch.size
    return pb.SearchRequest(
        namespace=batch.namespace,
        fingerprint=batch.fingerprint,
        queries=[
            pb.Query(feature=row.tolist(), length=int(length), token_ids=list(row_ids))
            for row, length, row_ids in zip(batch.features, batch.lengths, ids, strict=True)
        ],
        max_distance=batch.max_distance,
        gate=batch.gate,
        projector_version=batch.projector_version,
    )


def ingest_requests(
    namespace: str, fingerprint: str, entries: Iterable[NewEntry], *, commit: bool = True, projector_version: int = 0
) -> Iterator[pb.IngestRequest]:
    """The messages of one Ingest stream for ``entries`` (maps sent in their own dtype, fp16 or fp32).

    ``commit=False`` leaves the commit out (a stream that must write nothing). ``projector_version``
    states which projector made the features (0: none stated).
    """
    yield pb.IngestRequest(
        begin=pb.IngestBegin(namespace=namespace, fingerprint=fingerprint, projector_version=projector_version)
    )
    for index, entry in enumerate(entries):
        maps = np.asarray(entry.maps)  # (layers, heads, L, L)
        feature = [] if entry.feature is None else np.asarray(entry.feature, dtype=np.float32).tolist()
        token_ids = [] if entry.token_ids is None else np.asarray(entry.token_ids).tolist()
        yield pb.IngestRequest(
            entry=pb.EntryBegin(length=maps.shape[-1], token_hash=bytes(entry.token_hash), feature=feature,
                                token_ids=token_ids)
        )
        for layer in range(maps.shape[0]):
            for chunk in map_chunks(maps[layer], query_index=index, entry_id=0, layer=layer):
                yield pb.IngestRequest(chunk=chunk)
        if entry.outputs is not None:
            for part in output_chunks(np.asarray(entry.outputs), query_index=index, entry_id=0):
                yield pb.IngestRequest(outputs=part)
    if commit:
        yield pb.IngestRequest(commit=pb.IngestCommit())


class RemoteStore:
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

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stub(self) -> pb_grpc.AttnStoreStub:
        """The raw stub, for calls this class does not wrap."""
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

    def _read_stream(self, read: Callable[[float | None], T], timeout: float | None) -> T:
        """``read(seconds left)``: one whole read-only stream, received and assembled; sent again, whole,
        while :func:`retries_stream` says so (a broken stream's partial reply is dropped with it)."""
        limit = timeout or self._timeout
        if self.stream_retries == 0:  # one daemon: nothing to resend to, one plain call
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
                if not retries_stream(exc, attempt, self.stream_retries, deadline):
                    raise error_from_rpc(exc) from exc
                log.info("a read-only stream broke (%s: %s); sending it again", exc.code().name, exc.details())
            attempt += 1
            self.stream_retried()
            time.sleep(STREAM_RETRY_PAUSE_S)

    def _unary(self, method: Callable[..., T], request: object, timeout: float | None = None) -> T:
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
        replace_projector: bool = False, limits: TokenLimits | None = None,
    ) -> pb.Namespace:
        """Create a namespace (admin); idempotent for the same model, fingerprint and layout.

        A projector different from the stored one is refused (ALREADY_EXISTS) unless ``replace_projector``.
        ``limits`` (the model's vocabulary size and maximum length) are recorded where the namespace has none.
        """
        request = pb.CreateNamespaceRequest(
            name=name, model=model, fingerprint=fingerprint, layout=layout_to_pb(layout),
            projector=projector or b"", replace_projector=replace_projector, limits=limits_to_pb(limits),
        )
        return self._unary(self._stub.CreateNamespace, request)

    def get_namespace(self, name: str) -> pb.Namespace:
        """One namespace, with its projector bytes."""
        return self._unary(self._stub.GetNamespace, pb.GetNamespaceRequest(name=name))

    def list_namespaces(self) -> list[pb.Namespace]:
        """Every namespace (projector bytes left out)."""
        return list(self._unary(self._stub.ListNamespaces, pb.ListNamespacesRequest()).namespaces)

    # ---- serving ------------------------------------------------------------

    def iter_lookup(self, request: pb.LookupRequest, timeout: float | None = None) -> Iterator[pb.LookupResponse]:
        """The raw Lookup stream (matches first, then chunks), for callers that consume it layer by layer.

        Never sent again: what was yielded cannot be taken back (:meth:`lookup` is).
        """
        try:
            yield from self._stub.Lookup(request, metadata=self._metadata, timeout=timeout or self._timeout)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc

    def lookup(self, request: pb.LookupRequest, timeout: float | None = None) -> LookupResult:
        """Run a Lookup and assemble every hit row's maps and outputs.

        A stream broken by a daemon going away is sent again, whole (see ``STREAM_RETRIES``).

        Raises:
            ChecksumError: a chunk arrived damaged.
            WireFormatError: chunks are inconsistent, or a row's layers are incomplete.
        """
        return self._read_stream(
            lambda left: _assembled_lookup(self._stub.Lookup(request, metadata=self._metadata, timeout=left)), timeout
        )

    def search(self, request: pb.SearchRequest, timeout: float | None = None) -> list[pb.Match]:
        """Matches only, no maps."""
        return list(self._unary(self._stub.Search, request, timeout).matches)

    def fetch(
        self,
        namespace: str,
        fingerprint: str,
        entry_ids: Sequence[int],
        *,
        length: int = 0,
        timeout: float | None = None,
    ) -> list[np.ndarray]:
        """Maps ``(layers, heads, L, L)`` of each id, cropped to ``length`` (0 = stored length)."""
        request = pb.FetchRequest(
            namespace=namespace, fingerprint=fingerprint, entry_ids=list(entry_ids), length=length
        )

        def read(left: float | None) -> list[np.ndarray]:
            assembler = ChunkAssembler(max_array_bytes=1 << 40)
            layers: dict[int, dict[int, np.ndarray]] = {}
            for chunk in self._stub.Fetch(request, metadata=self._metadata, timeout=left):
                done = assembler.add(chunk)
                if done is not None:
                    (index, layer), array = done
                    layers.setdefault(index, {})[int(layer)] = array
            return [np.stack([layers[i][j] for j in sorted(layers[i])]) for i in range(len(entry_ids))]

        return self._read_stream(read, timeout)

    def prefetch(self, namespace: str, entry_ids: Sequence[int]) -> pb.PrefetchResponse:
        """Queue entries for the DRAM tier; the reply says how many were queued and how many ids are unknown."""
        request = pb.PrefetchRequest(namespace=namespace, entry_ids=list(entry_ids))
        return self._unary(self._stub.Prefetch, request)

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
        return self._unary(self._stub.WriteBack, request, timeout)

    def delete(self, namespace: str, entry_ids: Sequence[int]) -> int:
        """Delete entries (admin); returns how many existed."""
        return self._unary(self._stub.Delete, pb.DeleteRequest(namespace=namespace, entry_ids=list(entry_ids))).deleted

    def compact(self, timeout: float | None = None) -> pb.CompactResponse:
        """Compact the store (admin)."""
        return self._unary(self._stub.Compact, pb.CompactRequest(), timeout)

    def verify(self, timeout: float | None = None) -> pb.VerifyResponse:
        """Check every stored chunk (admin)."""
        return self._unary(self._stub.Verify, pb.VerifyRequest(), timeout)

    def stats(self) -> pb.StatsResponse:
        """Store statistics (read token suffices)."""
        return self._unary(self._stub.Stats, pb.StatsRequest())

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
        return self._unary(self._stub.SetFeatures, request, timeout)


def _assembled_lookup(stream: Iterator[pb.LookupResponse]) -> LookupResult:
    """Every message of one Lookup stream, assembled (a broken stream raises its grpc.RpcError)."""
    first = next(stream, None)
    if first is None or first.WhichOneof("body") != "matches":
        raise WireFormatError("a Lookup stream must start with the matches")
    result = LookupResult(matches=list(first.matches.matches))
    layers: dict[int, dict[int, np.ndarray]] = {}
    assembler = ChunkAssembler(max_array_bytes=1 << 40)
    for message in stream:
        kind = message.WhichOneof("body")
        if kind == "error":
            result.row_errors[message.error.query_index] = message.error
            layers.pop(message.error.query_index, None)
            continue
        done = assembler.add(message.chunk if kind == "chunk" else message.outputs)
        if done is None:
            continue
        (query_index, what), array = done
        if what == "outputs":
            result.outputs[query_index] = array
        else:
            layers.setdefault(query_index, {})[int(what)] = array
    for query_index, by_layer in layers.items():
        result.maps[query_index] = np.stack([by_layer[i] for i in sorted(by_layer)])  # (layers, heads, L, L)
    return result
