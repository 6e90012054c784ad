"""How a call's rows are cut into forwards: by rows, and packed by a token budget too."""

from __future__ import annotations

import pytest

from attnstore.errors import ConfigError
from attnstore_client.call.rows import Row
from attnstore_client.call.settings import CallSettings
from attnstore_client.tiers.cost_model import CostModel
from attnstore_client.tiers.forwards import cut


def _rows(*lengths: int) -> list[Row]:
    return [Row(i, list(range(1, length + 1)), bytes([i])) for i, length in enumerate(lengths)]


def _sizes(forwards: list[list[Row]]) -> list[list[int]]:
    return [[len(row.tokens) for row in forward] for forward in forwards]


def test_packed_forwards_hold_the_tokens_of_a_padded_batch_or_batch_size_rows_under_a_token_budget() -> None:
    rows = _rows(50, 40, 30, 20, 10, 10, 5)
    # No budget: 3 padded rows of the longest (150 tokens) is the room, filled by the shorter rows.
    assert _sizes(cut(rows, CallSettings("n", 0.0, batch_size=3), CostModel())) == [[50, 40, 30, 20, 10], [10, 5]]
    budget = CallSettings("n", 0.0, batch_size=3, max_batch_tokens=60)
    assert _sizes(cut(rows, budget, CostModel())) == [[50], [40], [30, 20, 10], [10, 5]]
    alone = CallSettings("n", 0.0, batch_size=8, max_batch_tokens=45)
    assert _sizes(cut(rows, alone, CostModel()))[0] == [50]  # a row longer than the budget goes alone


def test_a_token_budget_below_one_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="max_batch_tokens must be >= 1"):
        CallSettings("n", 0.0, max_batch_tokens=0)


def test_forwards_run_side_by_side_share_the_room_in_a_multiple_of_the_workers_of_even_tokens() -> None:
    rows = _rows(60, 50, 40, 30, 30, 20, 20, 20, 10, 10, 5)
    settings = CallSettings("n", 0.0, batch_size=4)  # the room of 4 padded rows of the longest: 240 tokens
    assert _sizes(cut(rows, settings, CostModel())) == [[60, 50, 40, 30, 30, 20], [20, 20, 10, 10, 5]]
    two = cut(rows, settings, CostModel(), side_by_side=2)  # 120 tokens each: 3 forwards, evened into 4
    assert _sizes(two) == [[60, 50], [40], [30, 30, 20], [20, 20, 10, 10, 5]]
    assert [row for forward in two for row in forward] == rows  # every row once, in order
    longest = cut(_rows(212, 40, 30, 20), settings, CostModel(), side_by_side=2)
    assert _sizes(longest) == [[212], [40, 30, 20]]  # a row longer than a share takes more than one
    assert cut(rows[:1], settings, CostModel(), side_by_side=4) == [rows[:1]]


def test_forwards_side_by_side_under_max_batch_tokens_still_hold_at_most_batch_size_rows() -> None:
    rows = _rows(*([100] * 32 + [10] * 96))
    settings = CallSettings("n", 0.0, batch_size=32, max_batch_tokens=8192)
    forwards = cut(rows, settings, CostModel(), side_by_side=2)
    assert max(len(forward) for forward in forwards) <= 32
    assert max(sum(len(row.tokens) for row in forward) for forward in forwards) <= 8192
    assert [row for forward in forwards for row in forward] == rows  # every row once, in order


def test_short_rows_get_room_for_least_tokens_a_forward_each_side_by_side_but_never_past_max_batch_tokens() -> None:
    rows = _rows(*([10] * 100))  # 1,000 tokens; 4 padded rows of them hold 40
    settings = CallSettings("n", 0.0, batch_size=4)
    assert len(cut(rows, settings, CostModel())) == 25
    alone = cut(rows, settings, CostModel(), least_tokens=300)
    assert [sum(_sizes([forward])[0]) for forward in alone] == [300, 300, 300, 100]
    two = cut(rows, settings, CostModel(), side_by_side=2, least_tokens=300)  # 300 each, evened into 4
    assert [sum(_sizes([forward])[0]) for forward in two] == [250, 250, 250, 250]
    assert [row for forward in two for row in forward] == rows
    capped = CallSettings("n", 0.0, batch_size=4, max_batch_tokens=60)
    assert max(sum(_sizes([f])[0]) for f in cut(rows, capped, CostModel(), least_tokens=300)) <= 60
