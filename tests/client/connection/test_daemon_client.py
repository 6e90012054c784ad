"""The synchronous daemon client: what it loads, TLS / mTLS against an in-process server, daemon address forms.

That the client never imports a store backend is a contract in pyproject.toml (``lint-imports``); torch,
which the store's codecs import when they first cast, is checked here, at run time."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnstore.errors import ConfigError, UnavailableError
from attnstore_client.connection.daemon import DaemonClient
from tests.support.server_fixtures import tls_server


def test_the_daemon_client_loads_no_storage_backend_or_torch() -> None:
    code = (
        "import sys, attnstore_client.connection.daemon, attnstore.protocol.requests;"
        "print(sorted(m for m in ('faiss', 'lmdb', 'zarr', 'torch', 'attnstore.service') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_tls_server_serves_clients_that_trust_its_ca_only(pki: Path) -> None:
    server, target = tls_server(pki, mtls=False)
    try:
        with DaemonClient(target, tls_ca=pki / "ca.pem") as trusting:
            assert trusting.stats().entries == 0
        with DaemonClient(target, timeout=5) as plaintext, pytest.raises(UnavailableError):
            plaintext.stats()
    finally:
        server.stop(0)


def test_mtls_server_refuses_clients_without_a_certificate(pki: Path) -> None:
    server, target = tls_server(pki, mtls=True)
    try:
        with DaemonClient(target, tls_ca=pki / "ca.pem", client_cert=pki / "client.pem",
                         client_key=pki / "client.key") as client:
            assert client.stats().entries == 0
        with DaemonClient(target, tls_ca=pki / "ca.pem", timeout=5) as anonymous, pytest.raises(UnavailableError):
            anonymous.stats()
    finally:
        server.stop(0)


def test_client_certificate_without_its_key_is_a_config_error(pki: Path) -> None:
    with pytest.raises(ConfigError, match="both a client certificate and its key"):
        DaemonClient("127.0.0.1:1", client_cert=pki / "client.pem")


def test_grpcs_urls_and_bare_targets_with_a_ca_reach_a_tls_server(pki: Path) -> None:
    server, target = tls_server(pki, mtls=False)
    try:
        for address in (f"grpcs://{target}", target):
            with DaemonClient(address, tls_ca=pki / "ca.pem") as client:
                assert client.stats().entries == 0
    finally:
        server.stop(0)


def test_a_plaintext_grpc_url_with_tls_options_or_another_scheme_is_a_config_error(pki: Path) -> None:
    with pytest.raises(ConfigError, match="plaintext: use grpcs://127.0.0.1:1"):
        DaemonClient("grpc://127.0.0.1:1", tls_ca=pki / "ca.pem")
    with pytest.raises(ConfigError, match="'dns://h:1' is not one of grpc://HOST:PORT"):
        DaemonClient("dns://h:1")


@pytest.mark.parametrize(
    ("address", "target", "balanced"),
    [
        ("127.0.0.1:5001", "127.0.0.1:5001", False),
        ("127.0.0.1:5001,127.0.0.2:5002", "ipv4:127.0.0.1:5001,127.0.0.2:5002", True),
        ("[::1]:5001,[::1]:5002", "ipv6:[::1]:5001,[::1]:5002", True),
        ("dns:///daemons.internal:50051", "dns:///daemons.internal:50051", True),
    ],
)
def test_several_daemon_addresses_become_one_round_robin_target_with_retries(address, target, balanced):
    from attnstore_client.connection.channel import grpc_target

    got, options = grpc_target(address)
    assert got == target
    assert (("grpc.lb_policy_name", "round_robin") in options) == balanced
    assert any(name == "grpc.service_config" and "UNAVAILABLE" in str(value) for name, value in options) == balanced


@pytest.mark.parametrize(
    ("address", "named"),
    [
        ("127.0.0.1:5001,", "'' is not IP:PORT"),
        ("127.0.0.1:5001,daemon-b:5002", "'daemon-b' is not an IP address"),
        ("127.0.0.1:5001,[::1]:5002", "mixes IPv4 and IPv6"),
    ],
)
def test_a_bad_daemon_list_is_refused_naming_the_item_and_the_forms(address, named):
    from attnstore_client.connection.channel import grpc_target

    with pytest.raises(ConfigError, match=re.escape(named)):
        grpc_target(address)
