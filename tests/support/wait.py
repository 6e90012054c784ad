"""Waiting for what another thread or process does: the one way a test waits, on a condition with a deadline.

A test never sleeps a fixed time to let something happen: on a loaded machine
the time is too short (the test fails) and elsewhere too long (the suite is
slow). It polls a condition it can read (a metric, a counter, a file, a log
line, a queue's length) with ``wait_until``, which fails naming what was awaited
and the last value seen once the deadline has passed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from attnstore.errors import AttnStoreError

T = TypeVar("T")

POLL_SECONDS = 0.02


def wait_until(
    check: Callable[[], T], seconds: float, what: str | Callable[[], str], *, poll: float = POLL_SECONDS,
    ignoring: tuple[type[BaseException], ...] = (AttnStoreError,),
) -> T:
    """Poll ``check()`` every ``poll`` seconds until it returns a true value, and return that value.

    An exception of ``ignoring`` that ``check`` raises counts as not yet (by default an ``AttnStoreError``:
    Redis coming back, a daemon noticing a flushed store or catching up); any other is raised at once, so a
    check can end the wait early (a process that exited, say).

    Args:
        check: the condition; its value is returned once true.
        seconds: the deadline, from now.
        what: what is awaited, for the failure's message; a callable is called then (a log's tail, say).

    Raises:
        AssertionError: ``check()`` was not true within ``seconds``; the message names ``what``, the seconds
            and the last value ``check`` returned (or the exception it last raised).
    """
    deadline = time.monotonic() + seconds
    while True:
        try:
            value = check()
        except ignoring as exc:
            value, last = None, f"raised {exc!r}"
        else:
            if value:
                return value
            last = f"gave {value!r}"
        left = deadline - time.monotonic()
        if left <= 0:
            said = what() if callable(what) else what
            raise AssertionError(f"not within {seconds:g} s: {said} (the last check {last})")
        time.sleep(min(poll, left))
