"""Llama-like decoders (Llama, Mistral, Qwen2): q/k/v/o projections, RoPE, GQA, causal.

The three share one attention layout: ``q_proj``/``k_proj``/``v_proj``/``o_proj``,
rotary embeddings applied to q and k by their modeling module's
``apply_rotary_pos_emb``, ``num_key_value_groups`` query heads per KV head, and an
optional sliding window. Batches are right-padded (see ``attnstore_client.adapters.batch``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
from torch import nn

from attnstore.errors import UnsupportedModelError
from attnstore.projector.embedding_layer import EmbeddingLayer
from attnstore_client.adapters.base import Adapter
from attnstore_client.adapters.batch import Batch
from attnstore_client.adapters.capabilities import FULL, Capabilities
from attnstore_client.adapters.packed import PackedBatch
from attnstore_client.adapters.steps import DecoderSteps
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
    post_attention_layernorm: nn.Module
    mlp: nn.Module

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
        rotary: Any = getattr(importlib.import_module(type(first).__module__), "apply_rotary_pos_emb", None)
        self._require_layout(missing + ["apply_rotary_pos_emb"] * (rotary is None), "the Llama attention layout",
                             "Llama, Mistral, Qwen2")
        self._rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]] = rotary
        config = self.model.config
        # Mistral's window is the config's; Qwen2 and Qwen3 set one only with use_sliding_window.
        self._windowed = bool(getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))

    @property
    def capabilities(self) -> Capabilities:
        """Everything, except sharing keys and values under a sliding window: a suffix cannot run on a whole
        prefix's keys and values when its layers see only the last ``window`` of them."""
        if self._windowed:
            return Capabilities(can_share_kv=False, missing="sliding-window attention: a suffix cannot run on a whole"
                                " prefix's keys and values")
        return FULL

    def embedding_layer(self) -> EmbeddingLayer:
        """``embed_tokens`` and layer 0's ``input_layernorm`` (an RMSNorm), as ``_embed`` runs them."""
        rms_norm: Any = self._decoder.layers[0].input_layernorm  # transformers' RMSNorms (no common type)
        eps = rms_norm.variance_epsilon if hasattr(rms_norm, "variance_epsilon") else rms_norm.eps
        tokens: Any = self._decoder.embed_tokens
        return EmbeddingLayer("llama", tokens.weight, rms_norm.weight, float(eps))

    def decoder_steps(self) -> DecoderSteps:
        """The decoder's layers in steps (``adapters.steps``), for the chunk tier's fused forward.

        Raises:
            UnsupportedModelError: a sliding window (``capabilities``).
        """
        if self._windowed:
            raise UnsupportedModelError(f"the chunk tier's fused forward needs a model without a sliding window;"
                                        f" {self.loaded.name!r} has one")
        return _LlamaSteps(self)

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



class _LlamaSteps(DecoderSteps):
    """``LlamaAdapter``'s decoder in steps: RMSNorm, q/k/v projections (and the family's head norms), RoPE by the
    modeling module's own ``apply_rotary_pos_emb``, ``o_proj``, the MLP after its norm, the final norm."""

    def __init__(self, adapter: LlamaAdapter) -> None:
        super().__init__(adapter.num_layers, adapter.num_heads, adapter.num_kv_heads, adapter.head_dim,
                         float(_attention(adapter.attention_modules[0]).scaling))
        self._adapter = adapter
        self._decoder = adapter._decoder
        self._layers = list(self._decoder.layers[: adapter.num_layers])

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._decoder.embed_tokens(ids)  # (N, hidden)

    def rotations(self, length: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.zeros((1, 1), dtype=dtype, device=device)  # the tables take their dtype and device from it
        return self._decoder.rotary_emb(probe, torch.arange(length, device=device)[None])  # (1, L, d) each

    def rotate(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._adapter._rotary(query, key, cos, sin)

    def queries_keys_values(
        self, layer: int, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        block = self._layers[layer]
        attention = _attention(block.self_attn)
        normed = block.input_layernorm(hidden)  # (N, hidden)
        count = normed.shape[0]
        query = attention.q_proj(normed).view(count, self.heads, self.head_dim)  # (N, H, d)
        key = attention.k_proj(normed).view(count, self.kv_heads, self.head_dim)  # (N, KVH, d)
        query, key = self._adapter.norm_heads(block.self_attn, query, key)  # Qwen3's norms: the keys as stored
        value = attention.v_proj(normed).view(count, self.kv_heads, self.head_dim)  # (N, KVH, d)
        return query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)  # (H|KVH, N, d)

    def finish_layer(self, layer: int, hidden: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        block = self._layers[layer]
        hidden = hidden + _attention(block.self_attn).o_proj(context)  # (N, hidden)
        return hidden + block.mlp(block.post_attention_layernorm(hidden))  # (N, hidden)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._decoder.norm(hidden)  # (N, hidden)
