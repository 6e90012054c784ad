"""Shared pieces of the server tests: a tiny synthetic namespace and an in-process server."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from attnstore.index import ExactIndex
from attnstore.protocol.records import TokenLimits
from attnstore.server.auth import TokenTable
from attnstore.server.config import ServerLimits
from attnstore.server.server import AttnStoreServer, ServerTls, create_server
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore, NamespaceLayout
from attnstore_client.connection.daemon import DaemonClient

FP = "c0ffee" * 10 + "beef"  # 64 hex characters
# Causal, so shorter queries may reuse longer entries (cropped).
LAYOUT = NamespaceLayout(layers=3, heads=2, causal=True, hidden=8, feature_dim=16)
# What written-back rows of "ns" are checked against: token ids below 1000, at most 64 tokens.
LIMITS = TokenLimits(vocab_size=1000, max_length=64)


def memory_service() -> AttnStoreService:
    """A service over an in-memory store with one namespace "ns" of ``LAYOUT`` and ``LIMITS``."""
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    service.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT, limits=LIMITS)
    return service


@contextmanager
def served(
    service: AttnStoreService | None,
    *,
    limits: ServerLimits = ServerLimits(),
    tokens: TokenTable | None = None,
    client_token: str | None = None,
) -> Iterator[tuple[AttnStoreServer, DaemonClient]]:
    """An in-process server on a free port and a client of it; stopped on exit."""
    server, port = create_server(service, "127.0.0.1:0", limits=limits, tokens=tokens)
    server.start()
    remote = DaemonClient(f"127.0.0.1:{port}", token=client_token, timeout=30.0)
    try:
        yield server, remote
    finally:
        remote.close()
        server.stop(0)


def tls_server(pki: Path, *, mtls: bool) -> tuple[grpc.Server, str]:
    """An in-process TLS server (mTLS: client certificates required) over ``memory_service()``; started."""
    tls = ServerTls(
        cert_chain=(pki / "server.pem").read_bytes(),
        private_key=(pki / "server.key").read_bytes(),
        client_ca=(pki / "ca.pem").read_bytes() if mtls else None,
    )
    server, port = create_server(memory_service(), "127.0.0.1:0", tls=tls)
    server.start()
    return server, f"127.0.0.1:{port}"
