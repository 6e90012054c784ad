"""``attnstore admin quarantine list|release|drop`` against a real daemon: what a node reported, with its writer and
reporter; released, the row is served again; dropped, it is deleted. A read token may report nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from attnstore.errors import AuthError
from attnstore.protocol.keys import token_hash
from attnstore.protocol.requests import exact_request
from attnstore.protocol.write_back import row_to_pb
from attnstore_tools.admin.cold_start import create_exact_namespace
from attnstore_tools.cli import main as cli_main
from tests.support.caches import tiny_loaded
from tests.support.daemon import ADMIN_TOKEN, OTHER_WRITE_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess


@pytest.fixture
def daemon(tmp_path: Path):
    process = DaemonProcess(tmp_path / "store", tmp_path, extra_args=("--create", "--admit-after", "1")).start()
    with process.client(ADMIN_TOKEN) as admin:
        create_exact_namespace(admin, tiny_loaded("bert"), "default")
    yield process
    assert process.stop() == 0, process.log()


def test_list_release_and_drop_what_an_audit_reported(daemon: DaemonProcess, capsys: pytest.CaptureFixture) -> None:
    ids = np.arange(1, 7)
    key = token_hash(ids)
    with daemon.client(WRITE_TOKEN) as writer:
        fingerprint = writer.get_namespace("default").fingerprint
        writer.lookup(exact_request("default", fingerprint, [key], [6]))
        outputs = np.random.default_rng(0).normal(size=(6, 64)).astype(np.float32)
        reply = writer.write_back("default", fingerprint, [row_to_pb(ids, outputs)])
        assert reply.stored == 1, reply

    def hits() -> int:
        with daemon.client(READ_TOKEN) as reader:
            return len(reader.lookup(exact_request("default", fingerprint, [key], [6])).outputs)

    def report() -> None:
        with daemon.client(OTHER_WRITE_TOKEN) as auditor:
            reply = auditor.report_mismatch("default", fingerprint, "row", key, "min_cosine=0.1")
        assert (reply.found, reply.object.writer) == (True, "node-a")

    with daemon.client(READ_TOKEN) as reader, pytest.raises(AuthError):
        reader.report_mismatch("default", fingerprint, "row", key)  # a read token cannot take rows out of service
    report()
    assert hits() == 0
    base = ["admin", "quarantine", "--target", daemon.target, "--token-file", str(daemon.token_file), "--json", "-"]
    assert cli_main([*base, "list"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)["objects"]
    assert {k: listed[k] for k in ("namespace", "kind", "key", "writer", "reporter", "detail")} == {
        "namespace": "default", "kind": "row", "key": key.hex(), "writer": "node-a", "reporter": "node-b",
        "detail": "min_cosine=0.1"}
    assert cli_main([*base, "release", "--namespace", "default", "--key", key.hex()]) == 0
    assert hits() == 1
    report()
    assert cli_main([*base, "drop", "--namespace", "default", "--key", key.hex()]) == 0
    assert hits() == 0
    with daemon.client(ADMIN_TOKEN) as admin:
        assert list(admin.iter_entries("default")) == [] and admin.list_quarantine() == []
    capsys.readouterr()
    assert cli_main([*base, "drop", "--namespace", "default", "--key", key.hex()]) != 0  # no longer quarantined


def test_the_quarantine_survives_a_restart_of_the_daemon(daemon: DaemonProcess, tmp_path: Path) -> None:
    ids = np.arange(2, 8)
    key = token_hash(ids)
    with daemon.client(WRITE_TOKEN) as writer:
        fingerprint = writer.get_namespace("default").fingerprint
        writer.lookup(exact_request("default", fingerprint, [key], [6]))
        outputs = np.random.default_rng(1).normal(size=(6, 64)).astype(np.float32)
        assert writer.write_back("default", fingerprint, [row_to_pb(ids, outputs)]).stored == 1
    with daemon.client(OTHER_WRITE_TOKEN) as auditor:
        assert auditor.report_mismatch("default", fingerprint, "row", key).quarantined
    assert daemon.stop() == 0, daemon.log()
    assert (tmp_path / "store" / "quarantine.json").exists()  # beside the LMDB store, by default
    daemon.start()
    with daemon.client(ADMIN_TOKEN) as admin:
        (held,) = admin.list_quarantine("default")
        assert (bytes(held.key), held.writer) == (key, "node-a")
        assert not admin.lookup(exact_request("default", fingerprint, [key], [6])).outputs  # still a miss
