"""The one attention function of every family: queries and keys in, the attention map or the context out.

A family gives a layer's queries ``(B, H, T, d)`` and keys ``(B, KVH, T, d)``
(position-encoded, ``Adapter._queries_keys``); everything after them is here, the
same for padded and packed rows:

- the explicit softmax (``attention_probs``): the map itself, fp32, where it is
  captured, kept for write-back or applied through the hit path;
- the fast path (``attention`` without ``explicit``): torch's fused
  ``scaled_dot_product_attention``, which never exposes the map.

Query heads of one KV group are adjacent (query head ``h`` reads KV head
``h // G``), as in the models' own GQA: queries fold into ``(B, KVH, G*T, d)`` so
one matmul serves every query head of a group without repeating the keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional


def allowed_keys(length: int, window: int | None, *, causal: bool = True) -> torch.Tensor:
    """``(L, L)`` bool: query i may attend key j: j <= i when causal, and within the window if any (``|i - j| <
    window``: the last ``window`` keys of a causal query, both sides of a bidirectional one, as Gemma 3's)."""
    query = torch.arange(length)[:, None]
    key = torch.arange(length)[None, :]
    allowed = key <= query if causal else torch.ones((length, length), dtype=torch.bool)
    if window is not None:
        allowed &= (query - key).abs() < window
    return allowed


def attention_probs(
    query: torch.Tensor, key: torch.Tensor, *, scaling: float, causal: bool, window: int | None = None,
    lengths: Sequence[int] | None = None, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention probabilities, the explicit softmax: ``(B, H, T, T)`` fp32.

    Args:
        query: ``(B, H, T, d)``.
        key: ``(B, KVH, T, d)``.
        scaling: the module's score scale (``d ** -0.5`` for most).
        causal: mask later keys.
        window: the layer's sliding window (``allowed_keys``), None for full attention.
        lengths: the true lengths of right-padded rows: pad keys get no weight from true queries. Unused when
            causal: a pad key never precedes a true query, so the causal mask alone keeps every row's ``L x L``
            block exact.
        bias: ``(H, T, T)`` added to the scaled scores before the softmax (a relative position
            bias, ``Adapter._score_bias``), or None.

    Returns:
        Row ``b``'s top-left ``L x L`` block is its map; the rest (pad queries) holds no meaning.
    """
    batch, heads, length, head_dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, -1, head_dim)  # (B, KVH, G*T, d)
    scores = torch.matmul(grouped, key.transpose(2, 3)).view(batch, heads, length, length) * scaling  # (B, H, T, T)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)  # (B, H, T, T)
    if causal or window is not None and window < length:
        scores = scores.masked_fill(~allowed_keys(length, window, causal=causal).to(scores.device), float("-inf"))
    if not causal and lengths is not None and min(lengths) < length:
        pad = torch.arange(length)[None, :] >= torch.tensor(lengths)[:, None]  # (B, T) pad positions
        # Only true queries drop the pad keys: a pad query keeps its window's pad keys (never a row of -inf).
        dropped = pad[:, None, :] & ~pad[:, :, None]  # (B, T, T): true query, pad key
        scores = scores.masked_fill(dropped[:, None].to(scores.device), float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32)  # (B, H, T, T)


def attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scaling: float, causal: bool,
    window: int | None = None, explicit: bool = False, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention of rows of one length, none padded: ``(B, H, T, d)`` context, and its map if explicit.

    Args:
        query: ``(B, H, T, d)``.
        key, value: ``(B, KVH, T, d)`` each.
        scaling, causal, window, bias: as ``attention_probs``.
        explicit: compute the map (``attention_probs``, fp32) and apply it; else the fused kernel.

    Returns:
        The context ``(B, H, T, d)`` in the queries' dtype, and the map ``(B, H, T, T)`` fp32 (None unless explicit).
    """
    batch, heads, length, head_dim = query.shape
    kv_heads = key.shape[1]
    if not explicit:  # fast path: fused, no map
        if bias is not None:  # a float mask is added to the scaled scores, as the bias is
            mask = bias.to(query.dtype)  # (H, T, T)
            if causal or window is not None:
                mask = mask.masked_fill(~allowed_keys(length, window, causal=causal).to(query.device), float("-inf"))
            return functional.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, scale=scaling, enable_gqa=kv_heads < heads), None
        if window is not None and window < length:
            mask = allowed_keys(length, window, causal=causal).to(query.device)  # (T, T)
            return functional.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, scale=scaling, enable_gqa=kv_heads < heads), None
        return functional.scaled_dot_product_attention(
            query, key, value, is_causal=causal, scale=scaling, enable_gqa=kv_heads < heads), None
    probs = attention_probs(query, key, scaling=scaling, causal=causal, window=window, bias=bias)  # (B, H, T, T) fp32
    grouped = probs.to(value.dtype).view(batch, kv_heads, -1, length)  # (B, KVH, G*T, T)
    context = torch.matmul(grouped, value).view(batch, heads, length, head_dim)  # (B, H, T, d)
    return context, probs
