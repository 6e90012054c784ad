"""The heap trimmer and its bound: what the calls freed goes back to the system (glibc's malloc_trim)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attnstore_client.heap import HeapBound, HeapTrimmer

# Run in a child of its own: in a test worker, other tests' threads allocating or freeing meanwhile move RssAnon.
_TRIMMED = """
import json
import numpy as np
from attnstore_client.heap import HeapTrimmer
from attnstore_tools.machine import status_bytes


def anon_bytes():
    return status_bytes("self", "RssAnon")["RssAnon"]


# Blocks under glibc's mmap threshold come from the heap; one kept at the top stops free() giving the rest back.
blocks = [np.ones(100 * 1024 // 8) for _ in range(1500)]  # 150 MiB of 100 KiB blocks
top = blocks.pop()
del blocks
held = anon_bytes()
trimmed = HeapTrimmer().trim()
print(json.dumps({"held": held, "trimmed": trimmed, "after": anon_bytes()}))
"""


@pytest.mark.skipif(not HeapTrimmer().available, reason="the allocator is not glibc's")
def test_trim_returns_freed_heap_pages_that_free_alone_keeps() -> None:
    child = json.loads(subprocess.run([sys.executable, "-c", _TRIMMED], capture_output=True, text=True,
                                      check=True).stdout)
    assert child["trimmed"]
    assert child["after"] < child["held"] - 100 * 2**20


def test_trim_is_a_no_op_where_the_allocator_is_not_glibcs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    trimmer = HeapTrimmer()
    assert not trimmer.available and trimmer.trim() is False


_BOUNDED = """
import json
import numpy as np
from attnstore_client.heap import HeapBound, anonymous_bytes


def freed_but_held(mib):
    # Blocks under glibc's mmap threshold come from the heap; one kept at the top stops free() giving the rest back.
    blocks = [np.ones(100 * 1024 // 8) for _ in range(mib * 10)]
    top = blocks.pop()
    del blocks
    return top


bound = HeapBound(slack=64 * 2**20)
first = bound.check()  # sets the level
small = freed_but_held(30)
within = bound.check()
large = freed_but_held(150)
held = anonymous_bytes()
past = bound.check()
after = anonymous_bytes()
again = bound.check()
print(json.dumps({"first": first, "within": within, "past": past, "again": again, "held": held, "after": after,
                  "trims": bound.trims}))
"""


@pytest.mark.skipif(not HeapTrimmer().available, reason="the allocator is not glibc's")
def test_a_heap_bound_trims_only_once_the_heap_has_grown_past_its_slack() -> None:
    child = json.loads(subprocess.run([sys.executable, "-c", _BOUNDED], capture_output=True, text=True,
                                      check=True).stdout)
    assert (child["first"], child["within"], child["past"], child["again"]) == (False, False, True, False)
    assert child["trims"] == 1 and child["after"] < child["held"] - 100 * 2**20


def test_a_heap_bound_is_a_no_op_where_the_allocator_is_not_glibcs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    bound = HeapBound(slack=0)
    assert bound.check() is False and bound.check() is False and bound.trims == 0
