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

from attnstore_client.call.settings import ChunkSettings


def chosen_count(ratio: float, candidates: int) -> int:
    """How many of ``candidates`` stored chunk tokens a ratio computes again (rounded half up)."""
    return min(candidates, int(ratio * candidates + 0.5))


def select_tokens(
    settings: ChunkSettings, always: torch.Tensor, question: int, index: torch.Tensor, query: torch.Tensor,
    keys: torch.Tensor, fresh_values: torch.Tensor, stored_values: torch.Tensor, scaling: float,
) -> torch.Tensor:
    """Which of a row's active tokens stay active past the selection layer.

    Args:
        settings: the method and the ratio.
        always: ``(n,)`` bool: the active tokens computed at every layer (never candidates).
        question: tokens of the question, the row's last active ones.
        index: positions of the row's active tokens ``(n,)``, in order.
        query: their rotated queries ``(H, n, d)``.
        keys: the row's fused keys at this layer, rotated ``(KVH, L, d)``.
        fresh_values, stored_values: their values computed here and as stored ``(KVH, n, d)``.
        scaling: the attention's scale.

    Returns:
        ``(n,)`` bool: the tokens computed always, and the chosen share of the others.
    """
    candidates = (~always).nonzero().flatten()  # (c,)
    count = chosen_count(settings.ratio, int(candidates.shape[0]))
    keep = always.clone()
    if count == 0:
        return keep
    if settings.method == "a3":
        scores = _question_attention(query[:, -question:], keys, index[-question:], scaling)[index]  # (n,)
    else:
        scores = (fresh_values - stored_values).float().pow(2).sum(dim=(0, 2))  # (n,)
    best = scores[candidates].topk(count).indices  # (count,)
    keep[candidates[best]] = True
    return keep


def _question_attention(query: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, scaling: float
                        ) -> torch.Tensor:
    """The attention the question's queries ``(H, q, d)`` pay every key ``(KVH, L, d)``, summed: ``(L,)``."""
    heads, kv_heads = query.shape[0], keys.shape[0]
    expanded = keys.repeat_interleave(heads // kv_heads, dim=0)  # (H, L, d)
    scores = torch.matmul(query, expanded.transpose(1, 2)).float() * scaling  # (H, q, L)
    allowed = torch.arange(keys.shape[1], device=keys.device)[None, :] <= positions[:, None]  # (q, L)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1).sum(dim=(0, 1))  # (L,)
