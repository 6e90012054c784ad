"""Fork a writer, let it work a random while, SIGKILL it, and return what it reported (the crash tests).

Forking keeps a kill round fast (no interpreter start-up). The child reports on
a pipe, one line per ``os.write``, and says ``ready`` once it has opened its
store; the kill lands a random time after that.
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Callable


def read_lines(fd: int, until_ready: bool, timeout: float = 30.0) -> list[str]:
    """Lines from ``fd`` until ``ready`` has come (``until_ready``) or the writer has gone."""
    buffer = b""
    deadline = time.monotonic() + timeout
    while True:
        if until_ready and b"ready\n" in buffer:
            break
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, "the child made no progress (deadlocked after the previous kill?)"
        piece = os.read(fd, 65536)
        if not piece:
            break
        buffer += piece
    return [line for line in buffer.decode().split("\n") if line]


def run_until_killed(child: Callable[[int], None], delay: float) -> list[str]:
    """Fork, run ``child(write_fd)`` in the child, SIGKILL it ``delay`` seconds after it said ``ready``.

    Returns every line it reported but ``ready``.
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            child(write_fd)
        finally:
            os._exit(1)
    os.close(write_fd)
    try:
        lines = read_lines(read_fd, until_ready=True)
        # The kill's moment is the test's random input (the crash tests draw ``delay``): whatever the writer had
        # done by then, what it reported must be in the store. No outcome waits on this sleep's length.
        time.sleep(delay)
    finally:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    lines += read_lines(read_fd, until_ready=False)
    os.close(read_fd)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return [line for line in lines if line != "ready"]
