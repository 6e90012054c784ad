"""HitBuffer: hit counts in memory until a flush is due (by count or age)."""

from __future__ import annotations

from attnstore.store.dram.hit_buffer import HitBuffer, PendingHits


def _unwritten(pending: PendingHits) -> None:
    raise AssertionError(f"these tests take the counts themselves (drain); nothing writes {dict(pending)}")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_flush_is_due_after_enough_distinct_entries():
    hits = HitBuffer(flush_count=3, flush_seconds=60, clock=_Clock(), write=_unwritten)
    assert not hits.add("ns", [1, 1, 2], when=10.0)
    assert hits.get("ns", 1) == (2, 10.0)
    assert hits.add("ns", [3], when=11.0)


def test_a_flush_is_due_once_the_oldest_hit_is_old_enough():
    clock = _Clock()
    hits = HitBuffer(flush_count=100, flush_seconds=5, clock=clock, write=_unwritten)
    assert not hits.add("ns", [1], when=1.0)
    clock.now = 6.0
    assert hits.add("ns", [1], when=2.0)
    assert hits.drain() == {("ns", 1): (2, 2.0)}
    assert len(hits) == 0 and not hits.add("ns", [1], when=3.0)


def test_restore_merges_counts_back_and_drop_forgets_deleted_entries():
    hits = HitBuffer(flush_count=100, flush_seconds=60, clock=_Clock(), write=_unwritten)
    hits.add("ns", [1, 2], when=1.0)
    pending = hits.drain()
    hits.add("ns", [1], when=5.0)
    hits.restore(pending)  # the write of `pending` failed
    assert hits.get("ns", 1) == (2, 5.0) and hits.get("ns", 2) == (1, 1.0)
    hits.drop("ns", [2])
    assert hits.get("ns", 2) == (0, 0.0)
