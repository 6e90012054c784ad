"""Admission: distinct callers per (namespace, token hash) admit a repeated miss; fixed memory; counts fade
by windows; the counts of a shared (Redis) store are the fleet's."""

from __future__ import annotations

import hashlib

import pytest

from attnstore.errors import ConfigError
from attnstore.service.admission import Admission, AdmissionConfig
from attnstore.store.admission import MemoryCounts, SketchShape
from attnstore.store.redis.mapstore import RedisMapStore

SMALL = SketchShape(depth=2, width=1024, seen_bits=1 << 14)


def _key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_a_miss_is_admitted_once_its_nth_distinct_caller_asks_and_not_before():
    admission = Admission(AdmissionConfig(admit_after=3))
    assert admission.observe("ns", [_key(1)], [True], "a@h") == [False]
    assert admission.observe("ns", [_key(1)], [True], "b@h") == [False]
    assert admission.observe("ns", [_key(1)], [True], "c@h") == [True]
    assert admission.stats().admitted == 1 and admission.stats().asked == 3


def test_one_caller_asking_again_and_again_never_admits_its_own_row():
    admission = Admission(AdmissionConfig(admit_after=2))
    for _ in range(20):
        assert admission.observe("ns", [_key(1)], [True], "writer@h") == [False]
    assert admission.count("ns", _key(1)) == 1
    assert admission.observe("ns", [_key(1)], [True], "other@h") == [True]


def test_admit_after_one_admits_every_miss_but_never_a_hit():
    admission = Admission(AdmissionConfig(admit_after=1))
    assert admission.observe("ns", [_key(1), _key(2), None], [True, False, True], "a@h") == [True, False, False]


def test_admit_after_zero_turns_write_back_off_and_counts_nothing():
    admission = Admission(AdmissionConfig(admit_after=0))
    assert not admission.enabled
    assert admission.observe("ns", [_key(1)] * 3, [True] * 3, "a@h") == [False] * 3
    assert admission.stats().asked == 0


def test_namespaces_are_counted_apart():
    admission = Admission(AdmissionConfig(admit_after=2))
    admission.observe("a", [_key(1)], [True], "x@h")
    assert admission.observe("b", [_key(1)], [True], "y@h") == [False]
    assert admission.count("a", _key(1)) == 1


def test_memory_is_fixed_by_the_shape_whatever_the_traffic():
    admission = Admission(AdmissionConfig(shape=SMALL))
    admission.observe("ns", [_key(i) for i in range(5000)], [True] * 5000, "a@h")
    assert admission.stats().sketch_bytes == SMALL.nbytes == 2 * (2 * 1024 * 2 + (1 << 14) // 8)


def test_estimates_never_fall_below_the_true_count_within_a_window():
    counts = MemoryCounts(SketchShape(depth=2, width=64, seen_bits=1 << 16, window=1 << 30))
    for caller in range(6):
        counts.observe("ns", [_key(i) for i in range(50)], f"c{caller}@h")
    assert min(counts.counts("ns", [_key(i) for i in range(50)])) >= 6


def test_counts_fade_after_two_windows_and_turning_windows_does_not_let_a_caller_count_twice():
    counts = MemoryCounts(SketchShape(depth=2, width=1024, seen_bits=1 << 14, window=4))
    assert counts.observe("ns", [_key(1)], "a@h") == [1]
    counts.observe("ns", [_key(i) for i in range(10, 13)], "flood@h")  # fills the window: the next ask turns it
    assert counts.observe("ns", [_key(1)], "a@h") == [1]  # the last window still knows a@h asked
    assert counts.observe("ns", [_key(1)], "b@h") == [2]
    for start in (20, 30, 40):  # a full window, then two turns
        counts.observe("ns", [_key(i) for i in range(start, start + 4)], "flood@h")
    assert counts.counts("ns", [_key(1)]) == [0] and counts.windows == 3


@pytest.mark.parametrize(
    "kwargs", [{"depth": 0}, {"width": 1000}, {"seen_bits": 3}, {"window": 0}],
)
def test_bad_shapes_are_refused_naming_the_value(kwargs):
    with pytest.raises(ConfigError, match=str(next(iter(kwargs.values())))):
        SketchShape(**kwargs)


def test_a_negative_admit_after_is_refused():
    with pytest.raises(ConfigError, match="-1"):
        AdmissionConfig(admit_after=-1)


def test_daemons_on_one_redis_store_count_together(redis_server):
    url = redis_server.url()
    with RedisMapStore.open(url, create=True) as one, RedisMapStore.open(url) as other:
        first = Admission(AdmissionConfig(admit_after=2, shape=SMALL), one.admission_counts(SMALL))
        second = Admission(AdmissionConfig(admit_after=2, shape=SMALL), other.admission_counts(SMALL))
        assert first.observe("ns", [_key(1)], [True], "a@h") == [False]
        assert second.observe("ns", [_key(1)], [True], "a@h") == [False]  # the same caller, through another daemon
        assert second.admitted("ns", [_key(1)]) == [False]
        assert second.observe("ns", [_key(1)], [True], "b@h") == [True]
        assert first.admitted("ns", [_key(1), _key(2)]) == [True, False]  # what a WriteBack to the first sees
        assert first.stats().shared and first.stats().sketch_bytes == SMALL.nbytes
