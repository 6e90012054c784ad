"""Giving back resident pages of read-only file mappings (``attnstore.protocol.mapped_pages``)."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest

from attnstore.protocol.mapped_pages import drop_mapped_pages
from tests.support.mapped import resident_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mappings are read from /proc/self")

_SIZE = 64 * mmap.PAGESIZE


def _mapped(path: Path, *, writable: bool = False) -> mmap.mmap:
    """``path`` (a new file of distinct pages) mapped shared, read-only or not, every page read."""
    path.write_bytes(bytes(range(256)) * (_SIZE // 256))
    with path.open("r+b" if writable else "rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
    assert sum(mapping[offset] for offset in range(0, _SIZE, mmap.PAGESIZE)) == 0  # every page's first byte
    return mapping


def test_a_dropped_read_only_mapping_holds_no_resident_page_and_reads_the_same_bytes(tmp_path: Path) -> None:
    mapping = _mapped(tmp_path / "weights.bin")
    before = bytes(mapping)
    assert resident_bytes(tmp_path / "weights.bin") == _SIZE
    assert drop_mapped_pages(tmp_path / "weights.bin") == _SIZE
    assert resident_bytes(tmp_path / "weights.bin") == 0
    assert bytes(mapping) == before  # read again from the page cache, unchanged
    mapping.close()


def test_a_folder_drops_the_mappings_of_its_files_and_nothing_outside_it(tmp_path: Path) -> None:
    (tmp_path / "graph").mkdir()
    inside = _mapped(tmp_path / "graph" / "model.bin")
    outside = _mapped(tmp_path / "graph-other.bin")  # its name starts as the folder's does
    assert drop_mapped_pages(tmp_path / "graph") == _SIZE
    assert resident_bytes(tmp_path / "graph") == 0
    assert resident_bytes(tmp_path / "graph-other.bin") == _SIZE
    inside.close()
    outside.close()


def test_a_writable_mapping_is_left_resident_with_what_was_written(tmp_path: Path) -> None:
    mapping = _mapped(tmp_path / "lock.mdb", writable=True)
    mapping[0] = 255
    assert drop_mapped_pages(tmp_path) == 0
    assert resident_bytes(tmp_path / "lock.mdb") == _SIZE and mapping[0] == 255
    mapping.close()
