"""Timing rounds: warm-up rounds, then timed ones, and the median over them.

Every timed figure of the benchmarks and the evaluation comes from this loop.
Each round calls every variant once; the first ``warmup`` rounds only warm
caches, kernels and the page cache and are not kept. The variants are
interleaved in one loop rather than timed one after another, so load from other
processes hits every variant alike; ``rotate`` also shifts their order from
round to round, so none always runs first.
"""

from __future__ import annotations

import argparse
import logging
import statistics
from collections.abc import Callable, Hashable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Sample(Generic[T]):
    """One timed call."""

    seconds: float  # wall time of the call (perf_counter)
    value: T  # what the call returned: kept for every timed call, so calls return only what is needed


def time_rounds(
    calls: Mapping[K, Callable[[], T]],
    *,
    repeats: int,
    warmup: int,
    rotate: bool = False,
    each_round: Callable[[], AbstractContextManager[object]] | None = None,
    after_call: Callable[[], object] | None = None,
) -> dict[K, list[Sample[T]]]:
    """Call every entry of ``calls`` once per round, ``warmup`` untimed rounds first, then ``repeats`` timed ones.

    Args:
        calls: the variants, run in this order (rotated with ``rotate``).
        repeats: timed rounds kept.
        warmup: rounds run first and dropped.
        rotate: round ``r`` starts at variant ``r % len(calls)``.
        each_round: a context entered around every round, outside the timed calls (untimed set-up and
            tear-down, such as dropping the page cache and reopening a store).
        after_call: called after every call, warm-up ones included (a progress bar's ``update``).

    Returns:
        Per key of ``calls``, its ``repeats`` samples in round order.

    Raises:
        ValueError: ``calls`` is empty, ``repeats`` < 1 or ``warmup`` < 0.
    """
    if not calls or repeats < 1 or warmup < 0:
        raise ValueError(
            f"time_rounds(): need calls, repeats >= 1 and warmup >= 0; got {len(calls)} calls, "
            f"repeats={repeats}, warmup={warmup}"
        )
    keys = list(calls)
    samples: dict[K, list[Sample[T]]] = {key: [] for key in keys}
    for round_index in range(warmup + repeats):
        shift = round_index % len(keys) if rotate else 0
        with each_round() if each_round is not None else nullcontext():
            for key in keys[shift:] + keys[:shift]:
                start = perf_counter()
                value = calls[key]()
                seconds = perf_counter() - start
                if round_index >= warmup:
                    samples[key].append(Sample(seconds, value))
                logger.info("round %s %s %.1f ms", round_index, key, seconds * 1000.0)
                if after_call is not None:
                    after_call()
    return samples


def median_ms(seconds: Iterable[float]) -> float:
    """The median of ``seconds``, in milliseconds.

    Raises:
        statistics.StatisticsError: ``seconds`` is empty.
    """
    return statistics.median(seconds) * 1000.0


def add_timing_arguments(parser: argparse.ArgumentParser, *, unit: str = "runs per variant",
                         seed_of: str = "the random token ids") -> None:
    """Add the options every timed model benchmark takes: ``--repeats``, ``--warmup``, ``--threads``, ``--seed``
    and ``--json`` (``unit`` names what is timed, ``seed_of`` what the seed draws)."""
    parser.add_argument("--repeats", type=int, default=5, help=f"timed {unit}, median taken (default: 5, at least 5)")
    parser.add_argument("--warmup", type=int, default=1, help=f"untimed {unit} first (default: 1)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default: 2)")
    parser.add_argument("--seed", type=int, default=0, help=f"seed of {seed_of} (default: 0)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
