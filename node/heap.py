"""Freed memory back to the system once a burst is over: glibc keeps what a call freed in its arenas.

A call of long rows allocates large activations on two forward threads; glibc
serves such blocks from per-thread arenas and keeps the freed ones for reuse, so
without a trim a node's resident memory stays near its burst peak long after the
burst (measured in docs/BENCHMARKS.md, "A node's memory under a burst").
``malloc_trim(0)`` returns every free page of every arena; it costs a walk of the
arenas (milliseconds), so the batcher calls it only when no request is waiting.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        # The process's own symbols, libc's among them (as lmdb.env.drop_mapped_pages finds madvise): no
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
