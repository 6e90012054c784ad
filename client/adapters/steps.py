"""A causal model's forward one step at a time over a flat set of tokens: what the chunk tier's fused forward runs.

The fused forward (``tiers.chunks.fusion``) computes only some tokens of each
prompt, at their true positions, against keys and values partly stored and
partly fresh. It cannot call a decoder layer as a whole, so it runs each layer's
steps itself; the steps, and every module name they touch, are the family's
(``LlamaAdapter.decoder_steps``). What is the same for every family, the causal
attention of some queries over a row's whole cache, is written once here.

Keys are handed out per token before the rotary embedding and after any per-head
norm (Qwen3's): what a chunk stores is then valid wherever it is rotated to.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch.nn import functional


class DecoderSteps(ABC):
    """One causal decoder's forward in steps; tokens are flat ``(N, ...)`` rows, positions given apart.

    Attributes:
        layers: how many decoder layers the steps run.
        heads, kv_heads, head_dim: the attention's layout.
        scaling: the score scale.
    """

    def __init__(self, layers: int, heads: int, kv_heads: int, head_dim: int, scaling: float) -> None:
        self.layers, self.heads, self.kv_heads, self.head_dim = layers, heads, kv_heads, head_dim
        self.scaling = scaling

    @abstractmethod
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``(N,)`` -> the first layer's input ``(N, hidden)``."""

    @abstractmethod
    def rotations(self, length: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables of positions ``0..length-1``: cos, sin ``(1, length, d)`` each."""

    @abstractmethod
    def rotate(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries ``(..., H, n, d)`` and keys ``(..., KVH, n, d)`` rotated by tables ``(1, n, d)``."""

    @abstractmethod
    def queries_keys_values(
        self, layer: int, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's queries ``(H, N, d)``, keys ``(KVH, N, d)`` (both before the rotary embedding) and values
        ``(KVH, N, d)`` of its input ``(N, hidden)``, the layer's input norm included."""

    @abstractmethod
    def finish_layer(self, layer: int, hidden: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """The layer's output ``(N, hidden)`` from its input and its attention's context ``(N, H*d)``."""

    @abstractmethod
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last hidden states ``(N, hidden)`` from the last layer's output."""

    def attend(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Rotated queries ``(H, n, d)`` at ``positions`` ``(n,)`` over a row's cache ``(KVH, L, d)``, causal by
        position: the context ``(n, H*d)``."""
        allowed = torch.arange(keys.shape[1], device=keys.device)[None, :] <= positions[:, None]  # (n, L)
        out = functional.scaled_dot_product_attention(query[None], keys[None], values[None], attn_mask=allowed,
                                                      scale=self.scaling, enable_gqa=True)  # (1, H, n, d)
        return out[0].transpose(0, 1).reshape(query.shape[1], -1)  # (n, H*d)

    def attention_weights(self, query: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The attention of rotated queries ``(H, n, d)`` at ``positions`` over a row's keys ``(KVH, L, d)``, causal
        by position, fp32 ``(H, n, L)``."""
        expanded = keys.repeat_interleave(self.heads // self.kv_heads, dim=0)  # (H, L, d)
        scores = torch.matmul(query, expanded.transpose(1, 2)).float() * self.scaling  # (H, n, L)
        allowed = torch.arange(keys.shape[1], device=keys.device)[None, :] <= positions[:, None]  # (n, L)
        return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)  # (H, n, L)
