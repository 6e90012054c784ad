"""The heap trimmer: what the calls freed goes back to the system (glibc's malloc_trim)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from attnstore_node.heap import HeapTrimmer


def _anon_bytes() -> int:
    with open("/proc/self/status", encoding="utf-8") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not HeapTrimmer().available, reason="the allocator is not glibc's")
def test_trim_returns_freed_heap_pages_that_free_alone_keeps() -> None:
    # Blocks under glibc's mmap threshold come from the heap; one kept at the top stops free() giving the rest back.
    blocks = [np.ones(100 * 1024 // 8) for _ in range(1500)]  # 150 MiB of 100 KiB blocks
    top = blocks.pop()
    del blocks
    held = _anon_bytes()
    assert HeapTrimmer().trim()
    assert _anon_bytes() < held - 100 * 2**20
    del top


def test_trim_is_a_no_op_where_the_allocator_is_not_glibcs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    trimmer = HeapTrimmer()
    assert not trimmer.available and trimmer.trim() is False
