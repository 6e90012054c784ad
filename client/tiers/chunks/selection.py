"""Which stored chunk tokens a fused forward computes again: a share of them, chosen at the selection layer.

- ``a3`` (A3, "Attention-Aware Accurate KV Cache Fusion"): the tokens the question
  attends to most, its attention summed over heads and question tokens;
- ``cacheblend`` (CacheBlend, Yao et al., EuroSys 2025): the tokens whose values,
  computed afresh with the whole prompt before them, deviate most from the stored ones.

Both are asked at the selection layer, where every token's keys and values have
just been computed with the prompt's true context (``fusion``). The question and
the tokens of chunks the source lacked are never candidates: they are always computed.
"""

from __future__ import annotations

import torch

from attnstore_client.adapters.steps import DecoderSteps
from attnstore_client.call.settings import ChunkSettings


def chosen_count(ratio: float, candidates: int) -> int:
    """How many of ``candidates`` stored chunk tokens a ratio computes again (rounded half up)."""
    return min(candidates, int(ratio * candidates + 0.5))


def select_tokens(
    settings: ChunkSettings, steps: DecoderSteps, always: torch.Tensor, question: int, index: torch.Tensor,
    query: torch.Tensor, keys: torch.Tensor, fresh_values: torch.Tensor, stored_values: torch.Tensor,
) -> torch.Tensor:
    """Which of a row's active tokens stay active past the selection layer.

    Args:
        settings: the method and the ratio.
        steps: the model's forward in steps (its attention: ``DecoderSteps.attention_weights``).
        always: ``(n,)`` bool: the active tokens computed at every layer (never candidates).
        question: tokens of the question, the row's last active ones.
        index: positions of the row's active tokens ``(n,)``, in order.
        query: their rotated queries ``(H, n, d)``.
        keys: the row's fused keys at this layer, rotated ``(KVH, L, d)``.
        fresh_values, stored_values: their values computed here and as stored ``(KVH, n, d)``.

    Returns:
        ``(n,)`` bool: the tokens computed always, and the chosen share of the others.
    """
    candidates = (~always).nonzero().flatten()  # (c,)
    count = chosen_count(settings.ratio, int(candidates.shape[0]))
    keep = always.clone()
    if count == 0:
        return keep
    if settings.method == "a3":
        # The attention the question's queries pay every key, summed over heads and question tokens.
        weights = steps.attention_weights(query[:, -question:], keys, index[-question:])  # (H, q, L)
        scores = weights.sum(dim=(0, 1))[index]  # (n,)
    else:
        scores = (fresh_values - stored_values).float().pow(2).sum(dim=(0, 2))  # (n,)
    best = scores[candidates].topk(count).indices  # (count,)
    keep[candidates[best]] = True
    return keep
