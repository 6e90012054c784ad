"""This process's resident pages of file mappings, read from Linux's ``/proc/self/smaps``."""

from __future__ import annotations

from pathlib import Path


def resident_bytes(path: Path, suffix: str = "") -> int:
    """Bytes of this process's resident pages in mappings of the file ``path``, or of the files under the folder
    ``path`` whose names end in ``suffix``."""
    resolved, total, inside = str(path.resolve()), 0, False
    with open("/proc/self/smaps", encoding="utf-8") as smaps:
        for line in smaps:
            fields = line.split()
            if fields and "-" in fields[0] and not fields[0].endswith(":"):
                mapped = fields[5] if len(fields) >= 6 else ""
                inside = (mapped == resolved or mapped.startswith(resolved + "/")) and mapped.endswith(suffix)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total
