"""The standard health service (``grpc.health.v1``), with ``List`` and watches that end at drain.

grpcio-health-checking's servicer answers ``List`` with UNIMPLEMENTED although
reflection advertises it, and keeps ``Watch`` streams open through a shutdown:
``grpc.Server.stop(grace)`` then waits the whole grace period for them. This
subclass answers ``List`` and, at drain, sends NOT_SERVING to every watcher and
ends its stream, so an idle daemon stops at once.
"""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2


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
