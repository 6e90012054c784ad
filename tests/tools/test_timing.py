"""``attnstore_tools.timing``: warm-up rounds dropped, timed rounds kept, order, hooks and medians."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from attnstore_tools import timing
from attnstore_tools.timing import Sample, median_ms, time_rounds


class FakeClock:
    """``perf_counter`` that only moves when a call says how long it took."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def call(self, seconds: float, value: object = None) -> object:
        self.now += seconds
        return value


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(timing, "perf_counter", fake)
    return fake


def test_warmup_rounds_are_run_but_dropped_and_the_median_is_of_the_timed_ones(clock: FakeClock) -> None:
    durations = iter([9.0, 9.0, 0.003, 0.001, 0.002, 0.005, 0.004])  # two warm-up calls first
    calls = {"only": lambda: clock.call(next(durations), "out")}
    samples = time_rounds(calls, repeats=5, warmup=2)
    assert [s.seconds for s in samples["only"]] == pytest.approx([0.003, 0.001, 0.002, 0.005, 0.004])
    assert all(s.value == "out" for s in samples["only"])
    assert median_ms(s.seconds for s in samples["only"]) == pytest.approx(3.0)
    assert next(durations, None) is None  # exactly warmup + repeats calls


def test_variants_interleave_per_round_and_rotate_when_asked(clock: FakeClock) -> None:
    order: list[str] = []
    calls = {name: (lambda n=name: order.append(n)) for name in ("a", "b", "c")}
    time_rounds(calls, repeats=2, warmup=1)
    assert order == ["a", "b", "c"] * 3
    order.clear()
    samples = time_rounds(calls, repeats=2, warmup=1, rotate=True)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert list(samples) == ["a", "b", "c"] and all(len(rows) == 2 for rows in samples.values())


def test_each_round_wraps_every_round_untimed_and_after_call_follows_every_call(clock: FakeClock) -> None:
    events: list[str] = []

    @contextmanager
    def each_round() -> Iterator[None]:
        events.append("enter")
        clock.call(100.0)  # set-up time must not reach the samples
        yield
        events.append("exit")

    def variant(name: str, seconds: float) -> Callable[[], None]:
        def call() -> None:
            events.append(name)
            clock.call(seconds)
        return call

    calls = {"x": variant("x", 0.5), "y": variant("y", 0.25)}
    samples = time_rounds(calls, repeats=1, warmup=1, each_round=each_round, after_call=lambda: events.append("tick"))
    assert events == ["enter", "x", "tick", "y", "tick", "exit"] * 2
    assert samples == {"x": [Sample(0.5, None)], "y": [Sample(0.25, None)]}


@pytest.mark.parametrize(("repeats", "warmup"), [(0, 1), (3, -1)])
def test_bad_counts_are_refused_naming_them(repeats: int, warmup: int) -> None:
    with pytest.raises(ValueError, match=f"repeats={repeats}, warmup={warmup}"):
        time_rounds({"a": lambda: None}, repeats=repeats, warmup=warmup)


def test_every_timed_bench_takes_the_same_timing_options_with_the_same_defaults():
    import argparse

    from attnstore_tools.timing import add_timing_arguments

    parser = argparse.ArgumentParser()
    add_timing_arguments(parser, unit="rounds")
    args = parser.parse_args([])
    assert (args.repeats, args.warmup, args.threads, args.seed, args.json) == (5, 1, 2, 0, None)
    assert parser.parse_args(["--repeats", "7", "--json", "out.json"]).json.name == "out.json"
