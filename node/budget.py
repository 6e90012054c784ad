"""The token budget of the node's forwards: ``--max-batch-tokens``, or when not given the smallest forward whose
fixed cost is a small share of its time.

The client's cost model fits every forward it times (packed ones included) as
``seconds ~ fixed + per_token * tokens + per_token_position * pairs``
(``CostModel.forward_cost``). A forward of ``T`` tokens in rows of mean length
``L`` costs ``fixed + T * (per_token + per_token_position * L)``; the budget is the
smallest ``T`` whose fixed share is at most ``FIXED_SHARE``: larger forwards
gain little throughput and hold every request of theirs back longer. Measured
by ``attnstore bench node`` (all-MiniLM-L6-v2, log lines, 1 or 2 CPU threads) the
budget lands between 2,300 and 7,600 tokens; on a GPU, where the fixed cost is
most of a small forward, it grows, up to ``MAX_TOKENS``. ``L`` is a running mean
of the rows the node's calls held (``TokenBudget``).
"""

from __future__ import annotations

import math

from attnstore_client.tiers.cost_model import ForwardCost

FIXED_SHARE = 0.03  # a forward's fixed cost at most this share of its time
FALLBACK_TOKENS = 2048  # before the fit exists (the node's warm-up times forwards to make one at start)
# Below: forwards too small to batch anything, whatever the fit says. A fit from timings disturbed by other
# processes can find almost no fixed cost; a call would then be cut into many small forwards, each paying
# its per-row attention calls (seen in a bench node run on 2 busy cores: a fit set the budget to 256 tokens).
MIN_TOKENS = 1024
MAX_TOKENS = 32768  # above: a forward's activations and a request's wait grow with no gain left
FIRST_MEAN_LENGTH = 32.0  # tokens per row assumed before the first call (a short sentence)
LENGTH_WEIGHT = 0.2  # weight of the latest call in the running mean row length


def batch_token_budget(cost: ForwardCost | None, mean_length: float) -> int:
    """Tokens per packed forward for rows of ``mean_length`` tokens, by the fit ``cost`` (None: not fitted yet).

    Returns:
        ``FALLBACK_TOKENS`` without a fit or with a fit that has no per-token cost; else the smallest
        token count whose fixed share is at most ``FIXED_SHARE``, within ``[MIN_TOKENS, MAX_TOKENS]``.
    """
    if cost is None:
        return FALLBACK_TOKENS
    per_token = cost.per_token + cost.per_token_position * max(mean_length, 1.0)
    if per_token <= 0:
        return FALLBACK_TOKENS
    tokens = cost.fixed * (1.0 - FIXED_SHARE) / (FIXED_SHARE * per_token)
    return int(min(MAX_TOKENS, max(MIN_TOKENS, math.ceil(tokens))))


class TokenBudget:
    """The node's tokens per packed forward: ``max_batch_tokens`` when given, else ``batch_token_budget`` for the
    running mean length of the rows its calls held.

    Args:
        max_batch_tokens: the ``--max-batch-tokens`` setting (None: chosen from the fit).
    """

    def __init__(self, max_batch_tokens: int | None) -> None:
        self._fixed = max_batch_tokens
        self.mean_length = FIRST_MEAN_LENGTH

    def tokens(self, cost: ForwardCost | None) -> int:
        """Tokens per forward now, by the forward fit ``cost`` (None: not fitted yet)."""
        if self._fixed is not None:
            return self._fixed
        return batch_token_budget(cost, self.mean_length)

    def record(self, rows: int, tokens: int) -> None:
        """A call held ``rows`` rows of ``tokens`` tokens in all (``rows`` >= 1)."""
        self.mean_length += LENGTH_WEIGHT * (tokens / rows - self.mean_length)
