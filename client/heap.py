"""Freed memory back to the system: glibc keeps what a call freed in its arenas.

Forwards on several threads allocate their activations from per-thread arenas, and glibc keeps the freed
blocks for reuse: the process's resident memory grows, window after window, well past what the forwards hold
at once (a 20,000-row int8 call: +360 MiB of anonymous memory, of which ``malloc_trim`` gave back about 200).
``malloc_trim(0)`` returns every free page of every arena; it costs a walk of the arenas (milliseconds) and,
more, the faults of the pages the next forwards touch again. So the node trims when no request is waiting
(``attnstore_node.batcher``), and a call trims only when the heap has grown past a slack since its last trim
(``HeapBound``), not after every window (which cost 0.6-0.9 s of an 8,000-row call: docs/BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable

# How far the process's anonymous memory may grow past its level after the last trim before a call trims again.
DEFAULT_HEAP_SLACK = 64 * 2**20


def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        # The process's own symbols, libc's among them (as protocol.mapped_pages finds madvise): no
        # find_library, which runs ldconfig in a subprocess.
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim  # glibc only: musl has none
    except (OSError, AttributeError):
        return None
    return trim


class HeapTrimmer:
    """Gives the process's free heap pages back to the system (``trim``); a no-op without glibc."""

    def __init__(self) -> None:
        self._trim = _malloc_trim()

    @property
    def available(self) -> bool:
        """Whether this platform's allocator can be trimmed (glibc)."""
        return self._trim is not None

    def trim(self) -> bool:
        """Return the free pages of every malloc arena to the system; True when some were returned."""
        return bool(self._trim(0)) if self._trim is not None else False


def anonymous_bytes() -> int:
    """This process's resident memory that no file backs (heap, tensors): ``statm``'s resident less shared."""
    with open("/proc/self/statm", encoding="ascii") as statm:
        fields = statm.read().split()
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")


class HeapBound:
    """Trims the heap (``HeapTrimmer``) when the process's anonymous memory has grown more than ``slack`` bytes
    past its level after the last trim; thread-safe. A no-op without glibc or ``/proc``."""

    def __init__(self, slack: int = DEFAULT_HEAP_SLACK) -> None:
        self.slack = slack
        self._trimmer = HeapTrimmer()
        self._lock = threading.Lock()
        self._level: int | None = None  # anonymous bytes after the last trim (or the first check)
        self.trims = 0

    def check(self) -> bool:
        """Trim if the heap has grown past the slack; True when it trimmed."""
        if not self._trimmer.available:
            return False
        with self._lock:
            now = anonymous_bytes()
            if self._level is None:
                self._level = now
                return False
            if now <= self._level + self.slack:
                return False
            trimmed = self._trimmer.trim()
            self._level = anonymous_bytes() if trimmed else now
            self.trims += int(trimmed)
            return trimmed
