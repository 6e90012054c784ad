"""The gRPC server of the daemon: the AttnStore servicer and what surrounds it.

The grpc sync server with a thread pool (the service does LMDB and faiss work
synchronously), the standard health service, reflection (v1 and v1alpha), the bearer-token
interceptor, explicit message sizes, and optional TLS. ``create_server`` follows
the grpc examples: it returns the server and its bound port, so tests serve on
port 0.

The standard health service is ``HealthServicer`` here: grpcio-health-checking's
servicer answers ``List`` with UNIMPLEMENTED although reflection advertises it,
and keeps ``Watch`` streams open through a shutdown (``grpc.Server.stop(grace)``
then waits the whole grace period for them); this subclass answers ``List`` and,
at drain, sends NOT_SERVING to every watcher and ends its stream, so an idle
daemon stops at once.
"""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from attnstore.errors import ConfigError
from attnstore.protocol.v1 import attnstore_pb2_grpc as pb_grpc
from attnstore.server.auth import SERVICE_NAME, BearerTokenInterceptor, TokenTable, anonymous_caller
from attnstore.server.config import ServerLimits
from attnstore.server.metrics import DaemonMetrics
from attnstore.server.reflection import enable_reflection
from attnstore.server.servicer import AttnStoreServicer
from attnstore.service import AttnStoreService


class HealthServicer(health.HealthServicer):
    """``grpc.health.v1.Health``: Check, Watch and List; watches are non-blocking (one small pool)."""

    def __init__(self) -> None:
        super().__init__(
            experimental_non_blocking=True, experimental_thread_pool=futures.ThreadPoolExecutor(max_workers=1)
        )

    def List(
        self, request: health_pb2.HealthListRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthListResponse:
        """Every service's status ("" is the server as a whole)."""
        with self._lock:
            statuses = dict(self._server_status)
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=status) for name, status in statuses.items()}
        )

    def drain(self) -> None:
        """Report NOT_SERVING for good, and end every open ``Watch`` (after it was told NOT_SERVING)."""
        self.enter_graceful_shutdown()
        with self._lock:
            watchers = [callback for callbacks in self._send_response_callbacks.values() for callback in callbacks]
        for send in watchers:
            send(None)  # None ends the stream with OK; the stream's close callback then forgets it


@dataclass(frozen=True, slots=True)
class ServerTls:
    """PEM bytes of the server's TLS identity, and the CA that client certificates need (mTLS)."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None  # set: clients must present a certificate signed by it


class AttnStoreServer:
    """A gRPC server for the AttnStore service, health and reflection; not started.

    Use :func:`create_server` to build one. ``start()`` serves; the health status
    is SERVING only while a service is attached (see ``attach``).
    """

    def __init__(
        self,
        grpc_server: grpc.Server,
        servicer: AttnStoreServicer,
        health_servicer: HealthServicer,
        interceptor: BearerTokenInterceptor | None,
        metrics: DaemonMetrics,
    ) -> None:
        self.grpc_server = grpc_server
        self.servicer = servicer
        self.health = health_servicer
        self._interceptor = interceptor
        self._metrics = metrics

    def start(self) -> None:
        """Start serving calls (AttnStore calls are UNAVAILABLE until a service is attached)."""
        self.grpc_server.start()

    def attach(self, service: AttnStoreService | None) -> None:
        """Serve ``service`` and report SERVING; None reports NOT_SERVING and refuses calls."""
        self.servicer.attach(service)
        self.set_serving(service is not None)

    def set_serving(self, serving: bool) -> None:
        """Set the health status of the server and of the AttnStore service."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)
        self._metrics.set_serving(serving)

    def replace_tokens(self, tokens: TokenTable) -> None:
        """Swap the accepted tokens (rotation).

        Raises:
            ConfigError: the server was created without auth; restart it with a token file.
        """
        if self._interceptor is None:
            raise ConfigError("this server runs without auth: tokens cannot be loaded while serving")
        self._interceptor.replace_tokens(tokens)

    def stop(self, grace: float | None, *, idle_timeout: float = 30.0) -> bool:
        """Drain and stop: health NOT_SERVING, refuse new calls, let calls in flight finish.

        Health ``Watch`` streams are told NOT_SERVING and ended first: they would
        otherwise hold the stop for the whole grace period. Calls still running
        after ``grace`` seconds are cancelled. Returns True when every call had
        left the servicer within ``idle_timeout`` more seconds, so the service may
        be closed safely.
        """
        self.health.drain()
        self._metrics.set_serving(False)
        self.grpc_server.stop(grace).wait()
        idle = self.servicer.wait_idle(idle_timeout)
        self.servicer.attach(None)
        return idle


# Shortest interval between a client's pings the daemon accepts: half the clients' keepalive time.
KEEPALIVE_MIN_PING_MS = 10_000


def create_server(
    service: AttnStoreService | None,
    address: str = "127.0.0.1:0",
    *,
    tokens: TokenTable | None = None,
    tls: ServerTls | None = None,
    limits: ServerLimits = ServerLimits(),
    metrics: DaemonMetrics | None = None,
) -> tuple[AttnStoreServer, int]:
    """Build an AttnStore server bound to ``address``; call ``start()`` on it.

    Args:
        service: the service to serve, or None to attach one later (the daemon
            binds first and loads the store while health says NOT_SERVING).
        address: ``HOST:PORT``; port 0 picks a free port.
        tokens: accepted bearer tokens; None serves without auth.
        tls: the server's TLS identity; None serves plaintext.
        limits: message sizes, threads, per-call limits.
        metrics: where the servicer records its metrics; a fresh registry if None.

    Returns:
        The server (health SERVING when ``service`` is given) and its bound port.

    Raises:
        ConfigError: ``address`` cannot be bound.
    """
    metrics = metrics or DaemonMetrics()
    interceptor = BearerTokenInterceptor(tokens, on_refused=metrics.refused) if tokens is not None else None
    grpc_server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=limits.max_workers, thread_name_prefix="attnstore-rpc"),
        interceptors=[interceptor] if interceptor is not None else [],
        options=[
            ("grpc.max_receive_message_length", limits.max_message_bytes),
            ("grpc.max_send_message_length", limits.max_message_bytes),
            # Two daemons must never share a port silently (gRPC sets SO_REUSEPORT by default).
            ("grpc.so_reuseport", 0),
            # Clients ping calls in flight (attnstore_client.connection.channel.KEEPALIVE_TIME_MS): accept it, or
            # gRPC would answer a third ping without data with GOAWAY and fail the call.
            ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MIN_PING_MS),
            ("grpc.http2.max_ping_strikes", 0),
        ],
        maximum_concurrent_rpcs=limits.max_concurrent_rpcs,
    )
    servicer = AttnStoreServicer(service, limits=limits, metrics=metrics,
                                 callers=interceptor.caller if interceptor is not None else anonymous_caller)
    pb_grpc.add_AttnStoreServicer_to_server(servicer, grpc_server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    enable_reflection((SERVICE_NAME, health.SERVICE_NAME), grpc_server)
    try:
        if tls is None:
            port = grpc_server.add_insecure_port(address)
        else:
            credentials = grpc.ssl_server_credentials(
                [(tls.private_key, tls.cert_chain)],
                root_certificates=tls.client_ca,
                require_client_auth=tls.client_ca is not None,
            )
            port = grpc_server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen on {address}: {exc} (port in use, or not an address of this host?)") from None
    if port == 0:
        raise ConfigError(f"cannot listen on {address} (port in use, or not an address of this host?)")
    server = AttnStoreServer(grpc_server, servicer, health_servicer, interceptor, metrics)
    server.attach(service)
    return server, port
