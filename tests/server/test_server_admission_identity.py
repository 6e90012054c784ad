"""Admission by identity, against a real daemon (``--admit-after 2``): a caller is its token, never its address.

The probe of issue 48 admitted a row with one write token asking once from 127.0.0.1 and once from 127.0.0.2,
and with a write token plus a read token. Here the second address is a TCP forwarder bound to 127.0.0.2 (Linux
routes 127/8 to ``lo``), so the daemon sees the second ask from another host.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from attnstore.protocol.keys import token_hash
from attnstore.protocol.requests import exact_request
from attnstore.protocol.write_back import row_to_pb
from attnstore.server.server import ServerTls, create_server
from attnstore.service.admission import Admission, AdmissionConfig
from attnstore_client.connection.daemon import DaemonClient
from attnstore_tools.admin.cold_start import create_exact_namespace
from tests.support.caches import tiny_loaded
from tests.support.daemon import ADMIN_TOKEN, OTHER_WRITE_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess
from tests.support.forwarder import Forwarder
from tests.support.server_fixtures import FP, LAYOUT, memory_service

LENGTH = 6


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    workdir = tmp_path_factory.mktemp("admission-identity")
    process = DaemonProcess(workdir / "store", workdir, extra_args=("--admit-after", "2")).start()
    with process.client(ADMIN_TOKEN) as admin:
        create_exact_namespace(admin, tiny_loaded("bert"), "default")
    yield process
    assert process.stop() == 0, process.log()


def _row(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A row no other test asks about: token ids and outputs of the tiny BERT's shape."""
    rng = np.random.default_rng(seed)
    return rng.integers(1, 90, size=LENGTH), rng.normal(size=(LENGTH, 64)).astype(np.float32)


def _ask(remote: DaemonClient, row: tuple[np.ndarray, np.ndarray]) -> bool:
    """Ask the exact tier about ``row`` (a miss): whether the daemon answers admit."""
    fingerprint = remote.get_namespace("default", projector=False).fingerprint
    (match,) = remote.lookup(exact_request("default", fingerprint, [token_hash(row[0])], [LENGTH])).matches
    return bool(match.admit)


def _write(remote: DaemonClient, row: tuple[np.ndarray, np.ndarray]) -> tuple[int, int]:
    """Write ``row`` back: (stored, not admitted)."""
    fingerprint = remote.get_namespace("default", projector=False).fingerprint
    reply = remote.write_back("default", fingerprint, [row_to_pb(*row)])
    assert not reply.refused
    return reply.stored, reply.not_admitted


def test_one_write_token_from_two_addresses_does_not_admit_a_row(daemon: DaemonProcess) -> None:
    row = _row(1)
    with Forwarder(daemon.target, "127.0.0.2") as second_host, daemon.client(WRITE_TOKEN) as first:
        with DaemonClient(second_host.address, token=WRITE_TOKEN, timeout=30.0) as second:
            assert not _ask(first, row)
            assert not _ask(second, row)
            assert second_host.peers and set(second_host.peers) == {"127.0.0.2"}  # the daemon saw another host
            assert _write(second, row) == (0, 1)
            assert _write(first, row) == (0, 1)


@pytest.mark.parametrize("reader_first", [True, False], ids=["read-then-write", "write-then-read"])
def test_a_write_token_plus_a_read_token_does_not_admit_a_row(daemon: DaemonProcess, reader_first: bool) -> None:
    row = _row(2 + reader_first)
    with daemon.client(WRITE_TOKEN) as writer, daemon.client(READ_TOKEN) as reader:
        asks = [reader, writer] if reader_first else [writer, reader]
        assert [_ask(remote, row) for remote in asks] == [False, False]
        assert not _ask(writer, row)  # the writer asking again still counts once
        assert _write(writer, row) == (0, 1)


def test_two_distinct_write_tokens_admit_a_row(daemon: DaemonProcess) -> None:
    row = _row(4)
    with daemon.client(WRITE_TOKEN) as writer, daemon.client(OTHER_WRITE_TOKEN) as other:
        assert not _ask(writer, row)
        assert _ask(other, row)
        assert _write(writer, row) == (1, 0)
        assert _ask(other, row) is False  # now an exact hit: nothing left to admit
    with daemon.client(ADMIN_TOKEN) as admin:
        writers = {e.writer for e in admin.iter_entries("default") if e.token_hash == token_hash(row[0])}
    assert writers == {"node-a"}
    assert "event=admission admit_after=2 " in daemon.log() and " callers=token" in daemon.log()


def test_without_tokens_the_host_is_the_caller(tmp_path: Path) -> None:
    """Auth off: no identity exists, so admission counts peer hosts (a popularity rule; anyone may write)."""
    process = DaemonProcess(tmp_path / "store", tmp_path, tokens=False, extra_args=("--admit-after", "2")).start()
    try:
        row = _row(5)
        with process.client(None) as admin:
            create_exact_namespace(admin, tiny_loaded("bert"), "default")
            assert not _ask(admin, row)
            assert not _ask(admin, row)  # the same host again
            with Forwarder(process.target, "127.0.0.2") as second_host:
                with DaemonClient(second_host.address, timeout=30.0) as second:
                    assert _ask(second, row)
            assert _write(admin, row) == (1, 0)
            (entry,) = [e for e in admin.iter_entries("default") if e.token_hash == token_hash(row[0])]
            assert entry.writer == "anonymous"
        assert " callers=address" in process.log()
    finally:
        assert process.stop() == 0, process.log()


def test_under_mtls_without_tokens_a_caller_is_its_certificate_not_its_address(pki: Path) -> None:
    """Two addresses presenting one client certificate are one caller; the certificate names the writer."""
    service = memory_service()
    service.admission = Admission(AdmissionConfig(admit_after=2))
    tls = ServerTls(cert_chain=(pki / "server.pem").read_bytes(), private_key=(pki / "server.key").read_bytes(),
                    client_ca=(pki / "ca.pem").read_bytes())
    server, port = create_server(service, "127.0.0.1:0", tls=tls)
    server.start()
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(), private_key=(pki / "client.key").read_bytes(),
        certificate_chain=(pki / "client.pem").read_bytes())
    rng = np.random.default_rng(6)
    row = rng.integers(0, 1000, size=5), rng.normal(size=(5, LAYOUT.hidden)).astype(np.float32)
    request = exact_request("ns", FP, [token_hash(row[0])], [5])
    try:
        with Forwarder(f"127.0.0.1:{port}", "127.0.0.2") as second_host:
            # The server's certificate names 127.0.0.1 and localhost: the forwarded channel checks it as localhost.
            channels = [grpc.secure_channel(target, credentials, options=[("grpc.ssl_target_name_override",
                                                                            "localhost")])
                        for target in (f"127.0.0.1:{port}", second_host.address)]
            with DaemonClient(channel=channels[0]) as first, DaemonClient(channel=channels[1]) as second:
                assert [m.admit for remote in (first, second) for m in remote.lookup(request).matches] == [False] * 2
                assert set(second_host.peers) == {"127.0.0.2"}
                assert first.write_back("ns", FP, [row_to_pb(*row)]).not_admitted == 1
                service.admission = Admission(AdmissionConfig(admit_after=1))  # to see who a stored row's writer is
                assert first.lookup(request).matches[0].admit
                assert first.write_back("ns", FP, [row_to_pb(*row)]).stored == 1
        assert [e.writer for e in service.store.entries("ns")] == ["cert:client"]
    finally:
        server.stop(0)
