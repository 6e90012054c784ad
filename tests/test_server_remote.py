"""The light client helper: what it imports, and TLS / mTLS against an in-process server."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from server_fixtures import memory_service

from attnstore.errors import ConfigError, UnavailableError
from attnstore.remote import RemoteStore
from attnstore.server import ServerTls, create_server


def test_remote_helper_imports_no_storage_backend_or_torch() -> None:
    code = (
        "import sys, attnstore.remote, attnstore.status_codes, attnstore.wire, attnstore.messages;"
        "print(sorted(m for m in ('faiss', 'lmdb', 'zarr', 'torch', 'attnstore.service') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=attnstore-test-ca", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", "san.cnf", cwd=d)
    return d


def _tls_server(pki: Path, *, mtls: bool):
    tls = ServerTls(
        cert_chain=(pki / "server.pem").read_bytes(),
        private_key=(pki / "server.key").read_bytes(),
        client_ca=(pki / "ca.pem").read_bytes() if mtls else None,
    )
    server, port = create_server(memory_service(), "127.0.0.1:0", tls=tls)
    server.start()
    return server, f"127.0.0.1:{port}"


def test_tls_server_serves_clients_that_trust_its_ca_only(pki: Path) -> None:
    server, target = _tls_server(pki, mtls=False)
    try:
        with RemoteStore(target, tls_ca=pki / "ca.pem") as trusting:
            assert trusting.stats().entries == 0
        with RemoteStore(target, timeout=5) as plaintext, pytest.raises(UnavailableError):
            plaintext.stats()
    finally:
        server.stop(0)


def test_mtls_server_refuses_clients_without_a_certificate(pki: Path) -> None:
    server, target = _tls_server(pki, mtls=True)
    try:
        with RemoteStore(target, tls_ca=pki / "ca.pem", client_cert=pki / "client.pem",
                         client_key=pki / "client.key") as client:
            assert client.stats().entries == 0
        with RemoteStore(target, tls_ca=pki / "ca.pem", timeout=5) as anonymous, pytest.raises(UnavailableError):
            anonymous.stats()
    finally:
        server.stop(0)


def test_client_certificate_without_its_key_is_a_config_error(pki: Path) -> None:
    with pytest.raises(ConfigError, match="both a client certificate and its key"):
        RemoteStore("127.0.0.1:1", client_cert=pki / "client.pem")
