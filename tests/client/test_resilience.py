"""Retries with backoff and jitter inside a deadline, and the circuit breaker's states."""

from __future__ import annotations

import random

import pytest

from attnstore.errors import (
    ChecksumError,
    ConfigError,
    FingerprintMismatchError,
    UnavailableError,
    WireFormatError,
)
from attnstore_client.resilience import (
    BreakerPolicy,
    CircuitBreaker,
    RetryPolicy,
    call_with_retries,
    cause_of,
)


class FakeClock:
    """Monotonic seconds that move only when told (sleeping moves them too)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_backoff_grows_by_the_multiplier_is_capped_and_jitter_only_shortens_it() -> None:
    policy = RetryPolicy(attempts=6, initial_backoff=0.1, multiplier=2.0, max_backoff=0.3, jitter=0.5)
    rng = random.Random(0)
    for retry, base in ((1, 0.1), (2, 0.2), (3, 0.3), (4, 0.3)):
        waits = [policy.backoff(retry, rng) for _ in range(200)]
        assert base * 0.5 <= min(waits) and max(waits) <= base
        assert max(waits) - min(waits) > base * 0.3  # jitter spreads nodes apart
    assert RetryPolicy(jitter=0.0).backoff(1, rng) == RetryPolicy().initial_backoff


def test_outages_are_retried_until_a_try_succeeds() -> None:
    clock, calls = FakeClock(), []

    def call(remaining: float | None) -> str:
        calls.append(remaining)
        if len(calls) < 3:
            raise UnavailableError("UNAVAILABLE: connection refused")
        return "ok"

    policy = RetryPolicy(attempts=3, initial_backoff=0.1, jitter=0.0)
    assert call_with_retries(call, policy, timeout=5.0, rng=random.Random(0), sleep=clock.sleep, clock=clock) == "ok"
    assert clock.sleeps == [0.1, 0.2]
    assert calls == [5.0, pytest.approx(4.9), pytest.approx(4.7)]  # each try gets what is left of the deadline


def test_refusals_are_not_retried_and_the_last_outage_is_raised() -> None:
    clock = FakeClock()
    tries = []

    def refused(remaining: float | None) -> None:
        tries.append(remaining)
        raise FingerprintMismatchError("FAILED_PRECONDITION: another model")

    with pytest.raises(FingerprintMismatchError):
        call_with_retries(refused, RetryPolicy(attempts=5), timeout=None, rng=random.Random(0), sleep=clock.sleep)
    assert tries == [None]

    def down(remaining: float | None) -> None:
        raise UnavailableError("UNAVAILABLE: down")

    with pytest.raises(UnavailableError):
        call_with_retries(down, RetryPolicy(attempts=3, jitter=0.0), timeout=None, rng=random.Random(0),
                          sleep=clock.sleep, clock=clock)
    assert len(clock.sleeps) == 2


def test_no_retry_starts_when_its_backoff_would_pass_the_deadline() -> None:
    clock = FakeClock()

    def slow_outage(remaining: float | None) -> None:
        clock.now += 0.95  # the try used most of the deadline
        raise UnavailableError("DEADLINE_EXCEEDED: too slow")

    with pytest.raises(UnavailableError, match="DEADLINE_EXCEEDED"):
        call_with_retries(slow_outage, RetryPolicy(attempts=3, initial_backoff=0.1, jitter=0.0), timeout=1.0,
                          rng=random.Random(0), sleep=clock.sleep, clock=clock)
    assert clock.sleeps == []


def test_breaker_opens_after_consecutive_failures_and_a_success_resets_the_count() -> None:
    breaker = CircuitBreaker(BreakerPolicy(failure_threshold=3, reset_after=10.0), clock=FakeClock())
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state == "closed" and breaker.allow()
    breaker.record_failure()
    assert breaker.state == "open"
    assert not breaker.allow()


def test_open_breaker_half_opens_after_reset_and_lets_exactly_one_trial_through() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(BreakerPolicy(failure_threshold=1, reset_after=10.0), clock=clock)
    breaker.record_failure()
    clock.now = 9.9
    assert breaker.state == "open" and not breaker.allow()
    clock.now = 10.0
    assert breaker.state == "half_open"
    assert breaker.allow()
    assert not breaker.allow()  # a second caller waits for the trial's outcome
    breaker.record_failure()  # the trial failed: open for another reset_after
    assert breaker.state == "open"
    clock.now = 19.9
    assert not breaker.allow()
    clock.now = 20.0
    assert breaker.allow()
    breaker.record_success()  # the trial worked: closed, everyone goes through
    assert breaker.state == "closed" and breaker.allow() and breaker.allow()


def test_errors_map_to_fallback_causes() -> None:
    assert cause_of(UnavailableError("DEADLINE_EXCEEDED: Deadline Exceeded")) == "timeout"
    assert cause_of(UnavailableError("UNAVAILABLE: failed to connect")) == "unavailable"
    assert cause_of(ChecksumError("DATA_LOSS: crc32c")) == "checksum"
    assert cause_of(WireFormatError("bad shape")) == "bad_data"
    assert cause_of(FingerprintMismatchError("FAILED_PRECONDITION")) == "refused"


@pytest.mark.parametrize(
    "make",
    [lambda: RetryPolicy(attempts=0), lambda: RetryPolicy(jitter=1.5), lambda: RetryPolicy(multiplier=0.5),
     lambda: BreakerPolicy(failure_threshold=0), lambda: BreakerPolicy(reset_after=-1)],
)
def test_bad_policies_are_config_errors(make) -> None:
    with pytest.raises(ConfigError):
        make()
