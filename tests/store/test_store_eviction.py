"""The byte cap's planner (``store.eviction``), which every backend's eviction runs through."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnstore.errors import ConfigError
from attnstore.store.eviction import ChunkCandidate, EntryCandidate, check_cap, least_recent_first, plan_eviction


def test_nothing_is_evicted_within_the_cap_or_without_one():
    entries = [EntryCandidate(1.0, "ns", 1, 10)]
    assert plan_eviction(100, 100, 0.5, entries).victims == []
    assert plan_eviction(10**9, None, 0.5, entries).victims == []


def test_over_the_cap_it_evicts_least_recent_first_down_to_the_low_water_mark():
    entries = [EntryCandidate(float(i), "ns", i, 10) for i in range(10)]
    plan = plan_eviction(110, 100, 0.5, entries)  # down to 50: six of them
    assert [c.key for c in plan.victims] == [0, 1, 2, 3, 4, 5] and plan.left == 50
    assert [c.key for c in plan_eviction(110, 100, 1.0, entries).victims] == [0]  # to the cap itself


def test_candidates_are_read_only_as_far_as_needed():
    counted = itertools.count()
    lazily = (EntryCandidate(float(next(counted)), "ns", i, 10) for i in range(1000))
    assert len(plan_eviction(120, 100, 0.9, lazily).victims) == 3  # 120 down to 90
    assert next(counted) == 4  # and one more read, to see the mark was reached


def test_entries_and_chunks_merge_by_recency_then_namespace_an_entry_first_at_a_tie():
    chunks = [ChunkCandidate(2.0, "a", b"k2", 1), ChunkCandidate(1.0, "b", b"k1", 1),
              ChunkCandidate(1.0, "a", b"k0", 1)]
    per_namespace = [[EntryCandidate(1.0, "a", 7, 1), EntryCandidate(3.0, "a", 8, 1)], [EntryCandidate(0.5, "b", 9, 1)]]
    order = [c.key for c in least_recent_first(chunks, *per_namespace)]
    assert order == [9, 7, b"k0", b"k1", b"k2", 8]


@pytest.mark.parametrize(("max_bytes", "low_water"), [(0, 0.9), (100, 0.0), (100, 1.5)])
def test_a_cap_or_low_water_mark_out_of_range_is_refused_by_name(max_bytes, low_water):
    with pytest.raises(ConfigError, match="max_bytes|evict_low_water"):
        check_cap(max_bytes, low_water)


@given(
    sizes=st.lists(st.integers(1, 50), max_size=30),
    max_bytes=st.integers(1, 600),
    low_water=st.floats(0.01, 1.0),
)
def test_the_plan_ends_at_the_mark_or_evicts_everything_and_never_more_than_needed(sizes, max_bytes, low_water):
    used = sum(sizes) + 25  # 25 bytes nothing may evict (this write's own)
    candidates = [EntryCandidate(float(i), "ns", i, n) for i, n in enumerate(sizes)]
    plan = plan_eviction(used, max_bytes, low_water, candidates)
    assert plan.victims == candidates[: len(plan.victims)]  # a prefix: least recent first
    assert plan.left == used - sum(c.nbytes for c in plan.victims)
    if used <= max_bytes:
        assert plan.victims == []
    else:
        target = int(max_bytes * low_water)
        assert plan.left <= target or len(plan.victims) == len(candidates)
        assert plan.left + (plan.victims[-1].nbytes if plan.victims else target + 1) > target  # no extra victim
