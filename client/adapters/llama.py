"""Llama-like decoders (Llama, Mistral, Qwen2): q/k/v/o projections, RoPE, GQA, causal.

The three share one attention layout: ``q_proj``/``k_proj``/``v_proj``/``o_proj``,
rotary embeddings applied to q and k by their modeling module's
``apply_rotary_pos_emb``, ``num_key_value_groups`` query heads per KV head, and an
optional sliding window. Batches are right-padded (see ``attnstore_client.adapters.batch``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Protocol, cast

import torch
from torch import nn

from attnstore.errors import UnsupportedModelError
from attnstore_client.adapters.base import Adapter
from attnstore_client.adapters.batch import Batch
from attnstore_client.adapters.packed import PackedBatch
from attnstore_client.models import LoadedModel

_LAYOUT_ATTRIBUTES = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")


# nn.Module types every submodule as ``Tensor | Module``; these protocols name the
# parts of the transformers modules used here (``__init__`` checks the attention's).


class _LlamaAttention(Protocol):
    """LlamaAttention, MistralAttention, Qwen2Attention."""

    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    scaling: float


class _LlamaLayer(Protocol):
    """LlamaDecoderLayer and its Mistral and Qwen2 copies."""

    self_attn: nn.Module
    input_layernorm: nn.Module

    def __call__(self, hidden_states: torch.Tensor, **kwargs: object) -> torch.Tensor: ...


class _LlamaModel(Protocol):
    """LlamaModel, MistralModel, Qwen2Model."""

    embed_tokens: nn.Module
    layers: Sequence[_LlamaLayer]  # an nn.ModuleList
    rotary_emb: nn.Module
    norm: nn.Module


def _attention(module: nn.Module) -> _LlamaAttention:
    return cast(_LlamaAttention, module)


class LlamaAdapter(Adapter):
    """Capture and replay for Llama, Mistral and Qwen2 decoders."""

    family = "llama"
    causal = True
    attention_path = "self_attn"

    def __init__(self, loaded: LoadedModel) -> None:
        super().__init__(loaded)
        first = self._modules[0]
        missing = [name for name in _LAYOUT_ATTRIBUTES if not hasattr(first, name)]
        rotary = getattr(importlib.import_module(type(first).__module__), "apply_rotary_pos_emb", None)
        if missing or rotary is None:
            raise UnsupportedModelError(
                f"{type(first).__name__} lacks the Llama attention layout "
                f"(missing {missing or ['apply_rotary_pos_emb']}); supported: Llama, Mistral, Qwen2"
            )
        self._rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]] = rotary

    @property
    def _decoder(self) -> _LlamaModel:
        return cast(_LlamaModel, self.model)

    def _blocks(self) -> Sequence[nn.Module]:
        return cast("Sequence[nn.Module]", self._decoder.layers)

    def _embed(self, batch: Batch) -> torch.Tensor:
        embedded = self._decoder.embed_tokens(batch.input_ids)  # (B, P, hidden)
        return self._decoder.layers[0].input_layernorm(embedded)  # (B, P, hidden)

    def _run_packed(self, batch: PackedBatch) -> torch.Tensor:
        # The layers called one by one: no causal mask to build (each run of rows attends by itself).
        decoder = self._decoder
        positions = batch.position_ids[None]  # (1, T)
        hidden = decoder.embed_tokens(batch.input_ids[None])  # (1, T, hidden)
        rotary = decoder.rotary_emb(hidden, position_ids=positions)  # cos, sin: (1, T, d) each
        for layer in decoder.layers[: self.num_layers]:
            hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        return decoder.norm(hidden)[0]  # (T, hidden)

    def _queries_keys(
        self, module: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict, tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attention = _attention(module)
        cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]  # (1|B, T', d) each
        if tokens is None:
            cos, sin = cos[:, : hidden.shape[1]], sin[:, : hidden.shape[1]]  # (1|B, T, d) each
        else:
            hidden = hidden.index_select(1, tokens)  # (B, N, hidden)
            cos, sin = cos.index_select(1, tokens), sin.index_select(1, tokens)  # (1|B, N, d) each
        batch_size, length, _ = hidden.shape
        query = attention.q_proj(hidden).view(batch_size, length, self.num_heads, self.head_dim)  # (B, N, H, d)
        key = attention.k_proj(hidden).view(batch_size, length, self.num_kv_heads, self.head_dim)  # (B, N, KVH, d)
        query, key = self.norm_heads(module, query, key)
        return self._rotary(query.transpose(1, 2), key.transpose(1, 2), cos, sin)  # (B, H, N, d), (B, KVH, N, d)

    def norm_heads(
        self, module: nn.Module, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's projected queries ``(..., H, d)`` and keys ``(..., KVH, d)`` as its attention rotates them: as
        projected here; Qwen3 normalises each head first (``adapters.qwen3``). Per token, so keys stored after it (the
        chunk tier's, before RoPE) stay valid wherever they are rotated to."""
        return query, key

    def _values(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return _attention(module).v_proj(hidden)  # (B, P, KVH*d)

    def _project_out(self, module: nn.Module, context: torch.Tensor) -> torch.Tensor:
        return _attention(module).o_proj(context)  # (B, P, hidden)

    def _sliding_window(self, module: nn.Module) -> int | None:
        # Qwen2 sets it per layer on the module; Mistral reads it from the config.
        owner = module if hasattr(module, "sliding_window") else self.model.config
        return getattr(owner, "sliding_window", None)

