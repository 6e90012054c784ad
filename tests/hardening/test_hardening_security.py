"""Security end to end: a TLS daemon with a self-signed certificate, mTLS, scoped tokens, loopback default, no pickle.

The certificates are made here with ``cryptography``; the daemon is the real
``attnstore serve`` subprocess. The pickle scan reads the sources of every
package (attnstore, client, tools) with ``ast``.
"""

from __future__ import annotations

import ast
import datetime
import ipaddress
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from attnstore.errors import AuthError, UnavailableError
from attnstore.protocol.records import LookupBatch
from attnstore.protocol.requests import lookup_request
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore_client.connection.daemon import DaemonClient
from attnstore_tools.cli import build_parser
from attnstore_tools.serve import config_from_args
from tests.support.daemon import ADMIN_TOKEN, READ_TOKEN, DaemonProcess
from tests.support.server_fixtures import FP, LAYOUT
from tests.support.stores import make_entry

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("attnstore", "client", "tools")


# ---- certificates --------------------------------------------------------------


def _certificate(
    name: str, key: ec.EllipticCurvePrivateKey, *, issuer: tuple[str, ec.EllipticCurvePrivateKey] | None = None,
    ca: bool = False,
) -> x509.Certificate:
    """A one-day certificate for ``name``: self-signed unless ``issuer`` (name, key) is given."""
    issuer_name, issuer_key = issuer or (name, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _write(directory: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{name}.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    (directory / f"{name}.key").chmod(0o600)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """server: self-signed for 127.0.0.1; client-ca: signs "client"; stranger: a self-signed client nobody trusts."""
    d = tmp_path_factory.mktemp("pki")
    server_key = ec.generate_private_key(ec.SECP256R1())
    _write(d, "server", _certificate("attnstore-server", server_key), server_key)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    _write(d, "client-ca", _certificate("attnstore-client-ca", ca_key, ca=True), ca_key)
    client_key = ec.generate_private_key(ec.SECP256R1())
    _write(d, "client", _certificate("node-1", client_key, issuer=("attnstore-client-ca", ca_key)), client_key)
    stranger_key = ec.generate_private_key(ec.SECP256R1())
    _write(d, "stranger", _certificate("node-x", stranger_key), stranger_key)
    return d


@pytest.fixture(scope="module")
def daemon(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    workdir = tmp_path_factory.mktemp("tls-daemon")
    process = DaemonProcess(
        workdir / "store", workdir,
        extra_args=("--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
                    "--tls-client-ca", str(pki / "client-ca.pem")),
        client_options={"tls_ca": pki / "server.pem", "client_cert": pki / "client.pem",
                        "client_key": pki / "client.key", "timeout": 10},
    ).start()
    yield process
    assert process.stop() == 0, process.log()


# ---- TLS and mTLS --------------------------------------------------------------


def test_mtls_daemon_serves_a_client_that_trusts_its_self_signed_certificate(daemon: DaemonProcess) -> None:
    entry = make_entry(LAYOUT, 8, 1)
    with daemon.client() as admin:
        admin.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
        admin.ingest("ns", FP, [entry])
    with daemon.client(READ_TOKEN) as reader:
        result = reader.lookup(lookup_request(LookupBatch("ns", FP, entry.feature[None], [8], max_distance=0.01)))
    np.testing.assert_array_equal(result.maps[0], entry.maps.astype(np.float16))
    assert "tls=True mtls=True auth=True" in daemon.log()


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="plaintext"),
        pytest.param({"tls": True}, id="system-roots-do-not-trust-a-self-signed-server"),
        pytest.param({"tls_ca": "server.pem"}, id="no-client-certificate"),
        pytest.param({"tls_ca": "server.pem", "client_cert": "stranger.pem", "client_key": "stranger.key"},
                     id="client-certificate-from-an-untrusted-issuer"),
        pytest.param({"tls_ca": "client-ca.pem", "client_cert": "client.pem", "client_key": "client.key"},
                     id="client-does-not-trust-the-server"),
    ],
)
def test_connections_without_mutual_trust_are_refused(daemon: DaemonProcess, pki: Path, options: dict) -> None:
    resolved = {key: (pki / value if isinstance(value, str) else value) for key, value in options.items()}
    with DaemonClient(daemon.target, token=ADMIN_TOKEN, timeout=5, **resolved) as remote:
        with pytest.raises(UnavailableError):
            remote.stats()
        with pytest.raises(UnavailableError):
            remote.health()


# ---- scoped tokens -----------------------------------------------------------------


def test_read_token_reads_but_every_admin_call_is_permission_denied(daemon: DaemonProcess) -> None:
    with daemon.client() as admin:
        admin.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
        admin.ingest("ns", FP, [make_entry(LAYOUT, 8, 1)])
    with daemon.client(READ_TOKEN) as reader:
        assert reader.stats().entries >= 1
        assert [n.name for n in reader.list_namespaces()] == ["ns"]
        admin_calls = (
            (reader.stub.CreateNamespace, pb.CreateNamespaceRequest(name="x", fingerprint=FP)),
            (reader.stub.Delete, pb.DeleteRequest(namespace="ns", entry_ids=[1])),
            (reader.stub.Compact, pb.CompactRequest()),
            (reader.stub.Verify, pb.VerifyRequest()),
        )
        for call, request in admin_calls:
            with pytest.raises(grpc.RpcError) as caught:
                call(request, metadata=reader.metadata, timeout=10)
            assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED and "admin token" in caught.value.details()
        with pytest.raises(AuthError, match="PERMISSION_DENIED"):
            reader.ingest("ns", FP, [make_entry(LAYOUT, 8, 2)])


@pytest.mark.parametrize("token", [None, "x" * 40, READ_TOKEN + "x"])
def test_missing_or_unknown_tokens_are_unauthenticated_even_with_a_valid_certificate(
    daemon: DaemonProcess, token: str | None
) -> None:
    with daemon.client(token) as remote:
        with pytest.raises(AuthError, match="UNAUTHENTICATED"):
            remote.stats()
        assert remote.health() == "SERVING"  # probes need no token


# ---- default bind -------------------------------------------------------------------


def test_serve_binds_loopback_unless_told_otherwise() -> None:
    config = config_from_args(build_parser().parse_args(["serve", "--store", "s"]))
    assert config.listen.startswith("127.0.0.1:") and config.metrics_host == "127.0.0.1"
    assert config.token_file is None and not config.tls  # and the daemon warns about both (test_server_daemon)


# ---- no pickle -------------------------------------------------------------------------

_PICKLE_MODULES = frozenset({"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"})


def pickle_uses(source: str, filename: str = "<source>") -> list[str]:
    """Places in ``source`` that may unpickle or pickle: imports of pickle-like modules,
    ``torch.load`` without ``weights_only=True``, ``allow_pickle=True``, ``read_pickle``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[0] in _PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom):
            module = (node.module or "").split(".")[0]
            if module in _PICKLE_MODULES:
                found.append(f"{where} from {node.module} import ...")
            if module == "torch" and any(a.name == "load" for a in node.names):
                found.append(f"{where} from torch import load")
        elif isinstance(node, ast.Call):
            func = node.func
            keywords = {k.arg: k.value for k in node.keywords}
            if (isinstance(func, ast.Attribute) and func.attr == "load" and isinstance(func.value, ast.Name)
                    and func.value.id == "torch"):
                weights_only = keywords.get("weights_only")
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    found.append(f"{where} torch.load without weights_only=True")
            allow = keywords.get("allow_pickle")
            if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                found.append(f"{where} allow_pickle")
            if isinstance(func, ast.Attribute) and func.attr == "read_pickle":
                found.append(f"{where} read_pickle")
    return found


def test_the_scan_finds_each_kind_of_pickle_use() -> None:
    source = (
        "import pickle\nfrom joblib import load\nimport torch\nfrom torch import load\n"
        "torch.load('w.pt')\ntorch.load('w.pt', weights_only=False)\ntorch.load('w.pt', weights_only=True)\n"
        "import numpy as np\nnp.load('a.npy', allow_pickle=True)\nimport pandas as pd\npd.read_pickle('f')\n"
        "import safetensors.torch\nsafetensors.torch.load(b'')\n"
    )
    assert [use.split(" ", 1)[1] for use in pickle_uses(source)] == [
        "import pickle", "from joblib import ...", "from torch import load",
        "torch.load without weights_only=True", "torch.load without weights_only=True", "allow_pickle", "read_pickle",
    ]


def test_no_package_source_uses_pickle() -> None:
    files = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    assert len(files) > 50  # the scan really read the packages
    uses = [use for path in files for use in pickle_uses(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))]
    assert not uses, "pickle can run code on load; use safetensors, JSON or raw arrays:\n" + "\n".join(uses)
