"""The site's Getting started page, run as written: its commands and its Python, in order (soak: CI's second step).

Every fenced ``bash`` and ``python`` block of docs/getting-started.md after the first (the two Quick start
commands, which CI runs itself) runs in a scratch folder that has ``../shared`` beside it, as a clone does:
a command that serves (``attnstore serve``, ``attnstore node``) is started in the background and awaited (its
port accepts, ``GET /health`` answers 200), every other command must exit 0, and each Python block, ``{.skip}``
ones included (they only need the servers started above them), runs in a fresh interpreter and must exit 0.
A failing step fails the test with its output; the servers are stopped either way.
"""

from __future__ import annotations

import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.wait import wait_until

pytestmark = [pytest.mark.soak, pytest.mark.real_model]

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "getting-started.md"
SHARED = ROOT.parent / "shared"
# A fence opens with ```bash or ```python, optionally followed by attributes in braces; it closes with ```.
FENCE = re.compile(r"^```(bash|python)[ \t]*(?:\{[^}]*\})?[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
SERVES = ("serve", "node")
START_TIMEOUT_S = 120.0


def steps(page: Path) -> list[tuple[int, str, str]]:
    """``(line, language, code)`` for each fenced bash or Python block of ``page``, in order, one per command."""
    text = page.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start(2)) + 1
        language, code = match.group(1), match.group(2)
        if language == "python":
            found.append((line, language, code))
            continue
        for command in code.replace("\\\n", " ").splitlines():  # a continued line is one command
            if command.strip():
                found.append((line, language, command.strip()))
    return found


def _listen_address(argv: list[str]) -> tuple[str, int]:
    host, port = argv[argv.index("--listen") + 1].rsplit(":", 1)
    return host, int(port)


def _wait_until_serving(process: subprocess.Popen, argv: list[str], log: Path) -> None:
    host, port = _listen_address(argv)

    def serving() -> bool:
        if process.poll() is not None:
            pytest.fail(f"`{shlex.join(argv)}` exited {process.returncode}:\n{log.read_text()[-4000:]}")
        if argv[1] == "node":
            return httpx.get(f"http://{host}:{port}/health", timeout=2.0).status_code == 200
        with socket.create_connection((host, port), timeout=2.0):
            return True

    wait_until(serving, START_TIMEOUT_S, lambda: f"`{shlex.join(argv)}` serving:\n{log.read_text()[-4000:]}",
               poll=0.5, ignoring=(OSError, httpx.HTTPError))


def test_the_getting_started_steps_run_as_written(tmp_path: Path) -> None:
    if not (SHARED / "data" / "stsb_train.tsv").exists():
        pytest.skip(f"the page builds from {SHARED}/data/stsb_train.tsv, which is not there")
    (tmp_path / "shared").symlink_to(SHARED)
    workdir = tmp_path / "clone"  # ../shared beside it, as beside a clone
    workdir.mkdir()
    found = steps(PAGE)
    assert found[0][2].startswith("bash scripts/install.sh"), "the page no longer opens with the Quick start"
    servers: list[subprocess.Popen] = []
    try:
        for line, language, code in found[2:]:  # the Quick start's two commands are CI's own first steps
            where = f"docs/getting-started.md:{line}"
            if language == "python":
                done = subprocess.run([sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True,
                                      timeout=600)
                assert done.returncode == 0, f"{where}: the Python block failed:\n{done.stdout}\n{done.stderr}"
                continue
            argv = shlex.split(code)
            assert argv[0] == "attnstore", f"{where}: only attnstore commands are run here, not {code!r}"
            if argv[1] in SERVES:
                log = tmp_path / f"{argv[1]}.log"
                with log.open("w") as out:
                    servers.append(subprocess.Popen(argv, cwd=workdir, stdout=out, stderr=subprocess.STDOUT))
                _wait_until_serving(servers[-1], argv, log)
                continue
            done = subprocess.run(argv, cwd=workdir, capture_output=True, text=True, timeout=1800)
            assert done.returncode == 0, f"{where}: `{code}` exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    finally:
        for server in reversed(servers):
            server.send_signal(signal.SIGTERM)
        for server in reversed(servers):
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    assert [server.args[1] for server in servers] == ["serve", "node"], "the page no longer starts a daemon and a node"
