"""The admission sketch: counts asks per (namespace, token hash), admits repeated misses, fixed memory, ages."""

from __future__ import annotations

import hashlib

import pytest

from attnstore.errors import ConfigError
from attnstore.service.admission import Admission, AdmissionConfig


def _key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_a_miss_is_admitted_on_its_nth_ask_and_not_before():
    admission = Admission(AdmissionConfig(admit_after=3))
    assert admission.observe("ns", [_key(1)], [True]) == [False]
    assert admission.observe("ns", [_key(1)], [True]) == [False]
    assert admission.observe("ns", [_key(1)], [True]) == [True]
    assert admission.stats().admitted == 1 and admission.stats().asked == 3


def test_admit_after_one_admits_every_miss_but_never_a_hit():
    admission = Admission(AdmissionConfig(admit_after=1))
    assert admission.observe("ns", [_key(1), _key(2), None], [True, False, True]) == [True, False, False]


def test_admit_after_zero_turns_write_back_off_and_counts_nothing():
    admission = Admission(AdmissionConfig(admit_after=0))
    assert not admission.enabled
    assert admission.observe("ns", [_key(1)] * 3, [True] * 3) == [False] * 3
    assert admission.stats().asked == 0


def test_namespaces_are_counted_apart():
    admission = Admission(AdmissionConfig(admit_after=2))
    admission.observe("a", [_key(1)], [True])
    assert admission.observe("b", [_key(1)], [True]) == [False]
    assert admission.count("a", _key(1)) == 1


def test_memory_is_fixed_by_the_config_whatever_the_traffic():
    admission = Admission(AdmissionConfig(depth=2, width=1024))
    admission.observe("ns", [_key(i) for i in range(5000)], [True] * 5000)
    assert admission.stats().sketch_bytes == 2 * 1024 * 4
    assert admission._counts.nbytes == 2 * 1024 * 4


def test_estimates_never_fall_below_the_true_count_before_aging():
    admission = Admission(AdmissionConfig(depth=2, width=64, aging=1 << 30))
    for i in range(300):
        admission.observe("ns", [_key(i % 50)], [True])
    assert all(admission.count("ns", _key(i)) >= 6 for i in range(50))


def test_aging_halves_the_counts_so_old_repeats_fade():
    admission = Admission(AdmissionConfig(admit_after=4, aging=4))
    admission.observe("ns", [_key(1)] * 3 + [_key(2)], [True] * 4)  # the 4th ask ages: 3 -> 1
    assert admission.count("ns", _key(1)) == 1
    assert admission.stats().agings == 1


@pytest.mark.parametrize(
    "kwargs", [{"admit_after": -1}, {"width": 1000}, {"depth": 0}, {"aging": 0}],
)
def test_bad_settings_are_refused_naming_the_value(kwargs):
    with pytest.raises(ConfigError, match=str(next(iter(kwargs.values())))):
        AdmissionConfig(**kwargs)
