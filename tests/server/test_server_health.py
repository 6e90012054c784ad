"""The health service: List answers, and an open Watch is told NOT_SERVING and ended at drain."""

from __future__ import annotations

import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attnstore.server.auth import SERVICE_NAME
from tests.support.server_fixtures import memory_service, served
from tests.support.wait import wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_list_reports_the_server_and_the_attnstore_service() -> None:
    with served(memory_service()) as (_, remote), grpc.insecure_channel(remote.target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=10)
    assert {name: status.status for name, status in reply.statuses.items()} == {"": SERVING, SERVICE_NAME: SERVING}


def test_an_open_watch_is_told_not_serving_and_ended_so_the_drain_does_not_wait_for_it() -> None:
    seen: list[int] = []
    with served(memory_service()) as (server, remote), grpc.insecure_channel(remote.target) as channel:
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
        reader = threading.Thread(target=lambda: seen.extend(reply.status for reply in stream))
        reader.start()
        wait_until(lambda: seen, 10, "the watch's first status")
        start = time.monotonic()
        server.stop(30.0)
        stopped = time.monotonic() - start
        reader.join(10)
    assert not reader.is_alive()  # the stream ended (with OK) instead of being cut at the grace's end
    assert seen == [SERVING, NOT_SERVING]
    assert stopped < 5.0, f"stop took {stopped:.1f} s with a watch open"
