"""Giving back a read-only store's mapped pages: what Linux's fault-around maps in, unasked.

A process reading an LMDB store maps its file. On a page fault Linux maps not just
the page read but the neighbours it finds in the page cache ("fault-around", 64 KiB),
even with ``MADV_RANDOM``. Entry records lie between their maps' pages, so a scan of
the records to build the indexes (when an embedded client opens a store that is in the
page cache) maps a large part of the maps too: measured on a 666 MiB store of 4,276
MiniLM log lines, +245 MiB of resident memory for 5 MiB of records read. Those pages
stay in the page cache (shared, reclaimable) but count in the process's RSS.
``MADV_DONTNEED`` on a read-only file mapping drops them from this process only; a
later read faults them back in from the cache, unchanged.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)

_MADV_DONTNEED = 4


def drop_mapped_pages(folder: Path) -> int:
    """Drop this process's resident pages of every file mapping under ``folder``; returns bytes of mappings
    advised (0 where the platform has no ``/proc/self/maps``)."""
    if not sys.platform.startswith("linux"):
        return 0
    prefix = str(folder.resolve()) + "/"
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    advised = 0
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or not fields[5].strip().startswith(prefix) or "w" in fields[1]:
                continue  # only read-only mappings of the store's own files
            start, end = (int(address, 16) for address in fields[0].split("-"))
            if madvise(start, end - start, _MADV_DONTNEED) == 0:
                advised += end - start
            else:
                log.debug("madvise(%s) failed: errno %d", fields[5].strip(), ctypes.get_errno())
    return advised
