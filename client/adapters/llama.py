"""Llama-like decoders (Llama, Mistral, Qwen2): q/k/v/o projections, RoPE, GQA, causal.

The three share one attention layout: ``q_proj``/``k_proj``/``v_proj``/``o_proj``,
rotary embeddings applied to q and k by their modeling module's
``apply_rotary_pos_emb``, ``num_key_value_groups`` query heads per KV head, and an
optional sliding window. Batches are right-padded (see ``attnstore_client.adapters.batch``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, cast

import torch
from torch import nn

from attnstore.errors import UnsupportedModelError
from attnstore_client.adapters.base import Adapter
from attnstore_client.adapters.batch import Batch
from attnstore_client.adapters.packed import PackedBatch, causal_allowed, tokens_of
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

    def _attention_modules(self) -> Sequence[nn.Module]:
        return [layer.self_attn for layer in self._decoder.layers]

    def _embed(self, batch: Batch) -> torch.Tensor:
        embedded = self._decoder.embed_tokens(batch.input_ids)  # (B, P, hidden)
        return self._decoder.layers[0].input_layernorm(embedded)  # (B, P, hidden)

    def _run(self, batch: Batch) -> torch.Tensor:
        output = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        return output.last_hidden_state  # (B, P, hidden)

    def _run_packed(self, batch: PackedBatch) -> torch.Tensor:
        # The layers called one by one: no causal mask to build (each run of rows attends by itself).
        decoder = self._decoder
        positions = batch.position_ids[None]  # (1, T)
        hidden = decoder.embed_tokens(batch.input_ids[None])  # (1, T, hidden)
        rotary = decoder.rotary_emb(hidden, position_ids=positions)  # cos, sin: (1, T, d) each
        for layer in decoder.layers[: self.num_layers]:
            hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        return decoder.norm(hidden)[0]  # (T, hidden)

    def _packed_queries_keys(
        self, module: nn.Module, hidden: torch.Tensor, index: torch.Tensor | None, args: tuple, kwargs: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attention = _attention(module)
        cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]  # (1, T, d) each
        tokens = tokens_of(hidden, index)  # (N, hidden)
        count = tokens.shape[0]
        query = attention.q_proj(tokens).view(count, self.num_heads, self.head_dim).transpose(0, 1)  # (H, N, d)
        key = attention.k_proj(tokens).view(count, self.num_kv_heads, self.head_dim).transpose(0, 1)  # (KVH, N, d)
        cos, sin = tokens_of(cos[0], index)[None], tokens_of(sin[0], index)[None]  # (1, N, d) each
        query, key = self._rotary(query[None], key[None], cos, sin)  # (1, H, N, d), (1, KVH, N, d)
        return query[0].transpose(0, 1), key[0].transpose(0, 1)  # (N, H, d), (N, KVH, d)

    def _values(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return _attention(module).v_proj(hidden)  # (B, P, KVH*d)

    def _project_out(self, module: nn.Module, context: torch.Tensor) -> torch.Tensor:
        return _attention(module).o_proj(context)  # (B, P, hidden)

    def _attention_probs(
        self, module: nn.Module, hidden: torch.Tensor, lengths: Sequence[int], args: tuple, kwargs: dict
    ) -> Iterator[torch.Tensor]:
        attention = _attention(module)
        batch_size, padded, _ = hidden.shape
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
        query = attention.q_proj(hidden).view(batch_size, padded, heads, head_dim).transpose(1, 2)  # (B, H, P, d)
        key = attention.k_proj(hidden).view(batch_size, padded, kv_heads, head_dim).transpose(1, 2)  # (B, KVH, P, d)
        query, key = self._rotary(query, key, cos, sin)
        allowed = causal_allowed(padded, self._sliding_window(module))  # (P, P)
        for row, length in enumerate(lengths):
            grouped = query[row, :, :length].reshape(kv_heads, -1, head_dim)  # (KVH, G*L, d)
            scores = torch.matmul(grouped, key[row, :, :length].transpose(1, 2))  # (KVH, G*L, L)
            scores = scores.view(heads, length, length) * attention.scaling  # (H, L, L)
            scores = scores.masked_fill(~allowed[:length, :length], float("-inf"))
            yield torch.softmax(scores, dim=-1, dtype=torch.float32)  # (H, L, L)

    def _padded_probs(
        self, module: nn.Module, hidden: torch.Tensor, lengths: Sequence[int], args: tuple, kwargs: dict
    ) -> torch.Tensor:
        attention = _attention(module)
        batch_size, padded, _ = hidden.shape
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
        cos, sin = cos[:, :padded], sin[:, :padded]
        query = attention.q_proj(hidden).view(batch_size, padded, heads, head_dim).transpose(1, 2)  # (B, H, P, d)
        key = attention.k_proj(hidden).view(batch_size, padded, kv_heads, head_dim).transpose(1, 2)  # (B, KVH, P, d)
        query, key = self._rotary(query, key, cos, sin)
        grouped = query.reshape(batch_size, kv_heads, -1, head_dim)  # (B, KVH, G*P, d)
        scores = torch.matmul(grouped, key.transpose(2, 3))  # (B, KVH, G*P, P)
        scores = scores.view(batch_size, heads, padded, padded) * attention.scaling  # (B, H, P, P)
        # Causal keys of a row's own tokens only: a pad key never precedes a true query, so the causal mask
        # alone keeps every row's L x L block exact.
        allowed = causal_allowed(padded, self._sliding_window(module))  # (P, P)
        scores = scores.masked_fill(~allowed, float("-inf"))
        return torch.softmax(scores, dim=-1, dtype=torch.float32)  # (B, H, P, P)

    def _sliding_window(self, module: nn.Module) -> int | None:
        # Qwen2 sets it per layer on the module; Mistral reads it from the config.
        owner = module if hasattr(module, "sliding_window") else self.model.config
        return getattr(owner, "sliding_window", None)

