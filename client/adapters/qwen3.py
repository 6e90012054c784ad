"""Qwen3 decoders (Qwen3-Embedding, Qwen3-Reranker, Qwen3 instruct models): Llama's layout plus per-head RMSNorm on
queries and keys.

Qwen3's attention is Llama's (``q_proj``/``k_proj``/``v_proj``/``o_proj``, RoPE, GQA, causal, an explicit
``head_dim``) except that each query and key head goes through an RMSNorm over the head dimension
(``self_attn.q_norm``, ``self_attn.k_norm``) before RoPE. Capture computes its maps from the normed, rotated
queries and keys; replay needs neither. The norm is per token, so keys stored after it (the prefix tier's after
RoPE, the chunk tier's before it) are the keys a forward would hold. Layers with a sliding window
(``use_sliding_window``, ``layer_types``) are honoured per layer as Qwen2's are; such a model has no shareable
prefix (``tiers.prefix.shared.shareable``).
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn

from attnstore_client.adapters.llama import LlamaAdapter
from attnstore_client.models import LoadedModel

_NORMS = ("q_norm", "k_norm")


class _Qwen3Attention(Protocol):
    """Qwen3Attention's norms (its projections as ``llama._LlamaAttention``)."""

    q_norm: nn.Module  # Qwen3RMSNorm over head_dim
    k_norm: nn.Module


class Qwen3Adapter(LlamaAdapter):
    """Capture and replay for Qwen3 decoders: ``LlamaAdapter`` with the query and key norms."""

    def __init__(self, loaded: LoadedModel) -> None:
        super().__init__(loaded)
        first = self._modules[0]
        self._require_layout([name for name in _NORMS if not isinstance(getattr(first, name, None), nn.Module)],
                             "Qwen3's query and key norms", "Qwen3")

    def norm_heads(
        self, module: nn.Module, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's RMSNorm over ``d``, as ``Qwen3Attention`` applies it before RoPE: ``(..., H, d)``,
        ``(..., KVH, d)``."""
        attention = cast(_Qwen3Attention, module)
        return attention.q_norm(query), attention.k_norm(key)
