"""Calls to the store that may fail: deadlines, retries with backoff, a circuit breaker.

An inference node must never wait long on, or break because of, the store: its
outputs can always be computed. So a failed store call is retried only while
the call's deadline leaves room, and a store that keeps failing is left alone
for a while (the breaker is *open*: no projection, no lookup, every row computed)
before one trial call (*half-open*) decides whether to use it again.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

from attnstore.errors import (
    AttnStoreError,
    ChecksumError,
    ConfigError,
    MapShapeError,
    UnavailableError,
    WireFormatError,
)

T = TypeVar("T")

BreakerState = Literal["closed", "open", "half_open"]
# Why rows that the store should have served were computed instead.
FallbackCause = Literal["timeout", "unavailable", "checksum", "row_error", "bad_data", "refused", "circuit_open"]
FALLBACK_CAUSES: tuple[FallbackCause, ...] = (
    "timeout", "unavailable", "checksum", "row_error", "bad_data", "refused", "circuit_open",
)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a store call is retried (only transient failures, only within its deadline)."""

    attempts: int = 2  # tries per call, the first included; the fallback is always there, so keep it low
    initial_backoff: float = 0.05  # seconds before the second try
    multiplier: float = 2.0  # backoff growth per try
    max_backoff: float = 1.0  # cap on one wait
    jitter: float = 0.5  # each wait is drawn from [1 - jitter, 1] x backoff, so nodes do not retry in step

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.initial_backoff < 0 or self.max_backoff < 0 or self.multiplier < 1:
            raise ConfigError(
                "RetryPolicy needs initial_backoff >= 0, max_backoff >= 0 and multiplier >= 1; got "
                f"{self.initial_backoff}, {self.max_backoff}, {self.multiplier}"
            )
        if not 0 <= self.jitter <= 1:
            raise ConfigError(f"RetryPolicy.jitter must be in [0, 1], got {self.jitter}")

    def backoff(self, retry: int, rng: random.Random) -> float:
        """Seconds to wait before retry number ``retry`` (1 = the second try)."""
        base = min(self.max_backoff, self.initial_backoff * self.multiplier ** (retry - 1))
        return base * (1.0 - self.jitter * rng.random())


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    """When the circuit breaker opens and when it tries the store again."""

    failure_threshold: int = 3  # consecutive failed calls that open it
    reset_after: float = 10.0  # seconds open before one trial call is let through

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or self.reset_after < 0:
            raise ConfigError(
                f"BreakerPolicy needs failure_threshold >= 1 and reset_after >= 0; got "
                f"{self.failure_threshold}, {self.reset_after}"
            )


class CircuitBreaker:
    """Closed → open after ``failure_threshold`` consecutive failures → half-open after ``reset_after``.

    Half-open lets exactly one call through: its success closes the breaker, its
    failure opens it for another ``reset_after``. Thread-safe.

    Args:
        policy: thresholds.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, policy: BreakerPolicy = BreakerPolicy(), *, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None
        self._trial_running = False

    @property
    def state(self) -> BreakerState:
        """The state now (an open breaker past ``reset_after`` reads as half-open)."""
        with self._lock:
            return self._state()

    def _state(self) -> BreakerState:
        if self._opened_at is None:
            return "closed"
        return "half_open" if self._clock() - self._opened_at >= self.policy.reset_after else "open"

    def allow(self) -> bool:
        """Whether a call may go to the store now; a True in half-open state is the one trial call."""
        with self._lock:
            state = self._state()
            if state == "closed":
                return True
            if state == "half_open" and not self._trial_running:
                self._trial_running = True
                return True
            return False

    def record_success(self) -> None:
        """A call worked: close the breaker."""
        with self._lock:
            self._failures, self._opened_at, self._trial_running = 0, None, False

    def record_failure(self) -> None:
        """A call failed (outage, deadline): count it; open, or reopen after a failed trial."""
        with self._lock:
            self._failures += 1
            if self._trial_running or self._failures >= self.policy.failure_threshold:
                self._opened_at = self._clock()
            self._trial_running = False


def cause_of(exc: BaseException) -> FallbackCause:
    """The fallback cause a store error stands for."""
    if isinstance(exc, UnavailableError):
        return "timeout" if "DEADLINE_EXCEEDED" in str(exc) else "unavailable"
    if str(exc).startswith("CANCELLED"):
        return "unavailable"  # the daemon cancelled the call: it is shutting down
    if isinstance(exc, ChecksumError):
        return "checksum"
    if isinstance(exc, (WireFormatError, MapShapeError)):
        return "bad_data"
    return "refused"


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` says the store is down or slow (what retries are for)."""
    return cause_of(exc) in ("timeout", "unavailable")


def call_with_retries(
    call: Callable[[float | None], T],
    policy: RetryPolicy,
    *,
    timeout: float | None,
    rng: random.Random,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Run ``call(remaining_seconds)``, retrying outages while the overall deadline leaves room.

    Args:
        call: makes one try; gets the seconds left of the deadline (None: no deadline).
        policy: tries and backoff.
        timeout: the deadline of all tries together, in seconds (None: none).
        rng: source of jitter.
        sleep, clock: injectable for tests.

    Returns:
        What the first successful try returned.

    Raises:
        AttnStoreError: the last try's error, or at once an error that is not an outage.
    """
    deadline = None if timeout is None else clock() + timeout
    for attempt in range(1, policy.attempts + 1):
        remaining = None if deadline is None else deadline - clock()
        try:
            return call(remaining)
        except AttnStoreError as exc:
            if not is_outage(exc) or attempt == policy.attempts:
                raise
            wait = policy.backoff(attempt, rng)
            if deadline is not None and clock() + wait >= deadline:
                raise
            sleep(wait)
    raise AssertionError("unreachable: the last attempt returns or raises")
