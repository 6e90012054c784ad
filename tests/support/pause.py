"""Pause a process (SIGSTOP) and know it is paused: a server that stops answering, as its clients see it.

``kill(pid, SIGSTOP)`` returns once the signal is pending, not once the process has stopped: one of its
threads takes the signal and then stops the others. On a loaded machine that thread may wait for a CPU
while the server's other threads still answer a call or two (CI, 2026-11-28: a daemon "stopped" by the test
served the call's exact lookup, and only its next call went unanswered). ``paused`` waits until every thread
reports the stopped state in ``/proc``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.wait import wait_until


def _all_stopped(pid: int) -> bool:
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:  # a thread that exited meanwhile
            continue
        if stat[stat.rindex(")") + 2] not in "Tt":  # the state follows the parenthesised name
            return False
    return True


def stop(pid: int, timeout: float = 30.0) -> None:
    """SIGSTOP ``pid`` and return once every one of its threads is stopped.

    Raises:
        AssertionError: some thread did not stop within ``timeout`` seconds.
    """
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: _all_stopped(pid), timeout, f"every thread of process {pid} stopped by SIGSTOP", poll=0.001)


@contextmanager
def paused(pid: int) -> Iterator[None]:
    """``pid`` stopped (every thread) for the block, continued (SIGCONT) after it, whatever the block raised."""
    try:
        stop(pid)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
