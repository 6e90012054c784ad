"""Write-back across a fleet: two real daemons on one real Redis server, client processes listing both.

Behind round-robin a row's exact-tier asks and its WriteBack reach different
daemons; admission counts live in the shared store, so the daemon that takes
the WriteBack sees the asks the other one answered.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attnstore_tools.admin.cold_start import create_exact_namespace
from tests.support.caches import tiny_loaded
from tests.support.daemon import ADMIN_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess

ROOT = Path(__file__).resolve().parents[2]  # children run as modules of tests.support from here
ROWS = 40


@pytest.fixture
def fleet(redis_server, tmp_path: Path):
    url = redis_server.url()
    started: list[DaemonProcess] = []
    try:
        for name in ("a", "b"):
            workdir = tmp_path / name
            workdir.mkdir()
            started.append(DaemonProcess(url, workdir, extra_args=("--create", "--admit-after", "1")).start())
        with started[0].client(ADMIN_TOKEN) as admin:
            create_exact_namespace(admin, tiny_loaded("bert"), "default")
        yield started
    finally:
        for process in started:
            assert process.stop() == 0, process.log()


def _encode(url: str, token: str, seed: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.children.write_back", url, token, str(seed), str(ROWS)],
        capture_output=True, text=True, cwd=ROOT, timeout=180, check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_rows_admitted_through_one_daemon_are_stored_through_the_other(fleet: list[DaemonProcess]) -> None:
    url = "grpc://" + ",".join(process.target for process in fleet)
    first = _encode(url, WRITE_TOKEN, 5)
    written = first["written"]
    assert first["stats"]["misses"] == ROWS and written["queued"] == ROWS
    assert (written["not_admitted"], written["dropped_failed"]) == (0, 0)
    assert written["stored"] + written["duplicates"] == ROWS
    second = _encode(url, READ_TOKEN, 5)  # another node: every row is an exact hit, through either daemon
    assert second["stats"]["exact_hits"] == ROWS
    not_admitted = 0
    for process in fleet:
        with process.client(READ_TOKEN) as reader:
            not_admitted += reader.stats().written_back_not_admitted
    assert not_admitted == 0
