"""``--max-batch-tokens`` when not given: the smallest forward whose fixed cost is a small share of its time.

The client's cost model fits every forward it times (packed ones included) as
``seconds ~ fixed + per_token * tokens + per_token_position * pairs``
(``CostModel.forward_cost``). A forward of ``T`` tokens in rows of mean length
``L`` costs ``fixed + T * (per_token + per_token_position * L)``; the budget is the
smallest ``T`` whose fixed share is at most ``FIXED_SHARE``: larger forwards
gain little throughput and hold every request of theirs back longer. Measured
by ``attnstore bench node`` (all-MiniLM-L6-v2, log lines, 1 or 2 CPU threads) the
budget lands between 2,300 and 7,600 tokens; on a GPU, where the fixed cost is
most of a small forward, it grows, up to ``MAX_TOKENS``.
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
