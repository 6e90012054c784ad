"""Giving back the resident pages of this process's read-only file mappings.

A process that reads a file through a mapping keeps every page it touched resident, and Linux maps not just
the page read but the neighbours it finds in the page cache ("fault-around", 64 KiB), even with
``MADV_RANDOM``. Those pages stay in the page cache (shared, reclaimable) but count in the process's RSS.
``MADV_DONTNEED`` on a read-only file mapping drops them from this process only; a later read faults them
back in from the cache, unchanged. Two readers give theirs back: a read-only LMDB store
(``attnstore.store.lmdb.env``: its reads map the maps around the records) and an OpenVINO graph
(``attnstore_client.tiers.engines.runtimes``: the runtime maps its weights file, keeps its own copy of the
linear layers' weights and reads the file again only for the embedding rows of the tokens it sees). It lives
in ``protocol`` so the client may import it.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

_MADV_DONTNEED = 4


def drop_mapped_pages(path: Path) -> int:
    """Drop this process's resident pages of every read-only mapping of the file ``path`` or of a file under the
    folder ``path``; returns bytes of mappings advised (0 where the platform has no ``/proc/self/maps``).

    The mappings are read from ``/proc/self/maps`` on every call (1-4 ms): one kept from an earlier call could
    have been unmapped since, and its addresses given to memory this must not touch.
    """
    if not sys.platform.startswith("linux"):
        return 0
    resolved = str(path.resolve())
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    advised = 0
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or "w" in fields[1]:
                continue  # read-only mappings only: a written page dropped would be lost
            mapped = fields[5].strip()
            if mapped != resolved and not mapped.startswith(resolved + "/"):
                continue
            start, end = (int(address, 16) for address in fields[0].split("-"))
            if madvise(start, end - start, _MADV_DONTNEED) == 0:
                advised += end - start
            else:
                logger.debug("madvise(%s) failed: errno %d", mapped, ctypes.get_errno())
    return advised
