"""``--max-batch-tokens`` by default: the smallest forward whose fixed cost is a few percent of its time."""

from __future__ import annotations

from attnstore_client.tiers.cost_model import ForwardCost
from attnstore_node.budget import FALLBACK_TOKENS, FIXED_SHARE, MAX_TOKENS, MIN_TOKENS, batch_token_budget


def test_before_a_fit_the_budget_is_the_fallback() -> None:
    assert batch_token_budget(None, 30.0) == FALLBACK_TOKENS
    assert batch_token_budget(ForwardCost(0.01, 0.0, 0.0), 30.0) == FALLBACK_TOKENS


def test_the_budget_keeps_the_fixed_cost_at_the_share_and_counts_attention_per_row_length() -> None:
    cost = ForwardCost(fixed=0.01, per_token=1e-5, per_token_position=1e-7)
    tokens = batch_token_budget(cost, 20.0)
    seconds = cost.fixed + tokens * (cost.per_token + cost.per_token_position * 20.0)
    assert abs(cost.fixed / seconds - FIXED_SHARE) < 1e-3
    assert batch_token_budget(cost, 200.0) < tokens  # longer rows: more work per token, fewer tokens needed


def test_the_budget_stays_within_its_bounds() -> None:
    assert batch_token_budget(ForwardCost(1e-9, 1e-3, 0.0), 10.0) == MIN_TOKENS
    assert batch_token_budget(ForwardCost(10.0, 1e-9, 0.0), 10.0) == MAX_TOKENS
