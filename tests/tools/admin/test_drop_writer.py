"""``attnstore admin drop-writer`` against a real daemon: one writer's entries go, the others' stay."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from attnstore.protocol.keys import token_hash
from attnstore.protocol.requests import exact_request
from attnstore.protocol.write_back import row_to_pb
from attnstore_tools.admin.cold_start import create_exact_namespace
from attnstore_tools.cli import main as cli_main
from tests.support.caches import tiny_loaded
from tests.support.daemon import ADMIN_TOKEN, OTHER_WRITE_TOKEN, WRITE_TOKEN, DaemonProcess


@pytest.fixture
def daemon(tmp_path: Path):
    process = DaemonProcess(tmp_path / "store", tmp_path, extra_args=("--create", "--admit-after", "2")).start()
    with process.client(ADMIN_TOKEN) as admin:
        create_exact_namespace(admin, tiny_loaded("bert"), "default")
    yield process
    assert process.stop() == 0, process.log()


def _write(daemon: DaemonProcess, token: str, seeds: list[int]) -> list[bytes]:
    """Rows of ``seeds`` written back by ``token`` after both nodes asked for them; their token hashes."""
    rng = [np.random.default_rng(seed) for seed in seeds]
    rows = [(r.integers(1, 90, size=6), r.normal(size=(6, 64)).astype(np.float32)) for r in rng]
    keys = [token_hash(ids) for ids, _ in rows]
    with daemon.client(WRITE_TOKEN) as a, daemon.client(OTHER_WRITE_TOKEN) as b, daemon.client(token) as writer:
        fingerprint = writer.get_namespace("default").fingerprint
        for node in (a, b):
            node.lookup(exact_request("default", fingerprint, keys, [6] * len(rows)))
        assert writer.write_back("default", fingerprint, [row_to_pb(*row) for row in rows]).stored == len(rows)
    return keys


def _exact_hits(daemon: DaemonProcess, keys: list[bytes]) -> int:
    with daemon.client(ADMIN_TOKEN) as admin:
        fingerprint = admin.get_namespace("default").fingerprint
        return len(admin.lookup(exact_request("default", fingerprint, keys, [6] * len(keys))).outputs)


def test_drop_writer_deletes_every_entry_that_writer_stored_and_nothing_else(
    daemon: DaemonProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad, good = _write(daemon, WRITE_TOKEN, [1, 2, 3]), _write(daemon, OTHER_WRITE_TOKEN, [4, 5])
    with daemon.client(ADMIN_TOKEN) as admin:
        writers = sorted(e.writer for e in admin.iter_entries("default"))
    assert writers == ["node-a"] * 3 + ["node-b"] * 2
    base = ["admin", "drop-writer", "--target", daemon.target, "--token-file", str(daemon.token_file),
            "--namespace", "default", "--writer", "node-a", "--json", "-"]
    assert cli_main([*base, "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out) | {} == {"namespace": "default", "writer": "node-a", "found": 3,
                                                          "deleted": 0, "prefix_blocks": 0, "chunks": 0,
                                                          "dry_run": True}
    assert _exact_hits(daemon, bad) == 3
    assert cli_main(base) == 0
    assert json.loads(capsys.readouterr().out)["deleted"] == 3
    assert (_exact_hits(daemon, bad), _exact_hits(daemon, good)) == (0, 2)
