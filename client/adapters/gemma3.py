"""Gemma 3 text models (``gemma3_text``): Gemma 3 instruct models for scoring (causal) and EmbeddingGemma
(bidirectional, under a sentence-transformers pipeline of mean pooling, Dense layers and Normalize).

Gemma 3's attention is Llama's layout (``q_proj``/``k_proj``/``v_proj``/``o_proj``, RoPE by its modeling module's
``apply_rotary_pos_emb``, GQA) with what is particular to it:

- query and key norms: every head goes through ``Gemma3RMSNorm`` over ``head_dim`` (which scales by
  ``1 + weight``) before RoPE, as Qwen3's do; a captured map is taken after them, a replayed one needs neither;
- the score scale is ``query_pre_attn_scalar ** -0.5`` (the module's ``scaling``), not ``head_dim ** -0.5``;
- ``attn_logit_softcapping`` is in the config but Gemma 3's attention never applies it (Gemma 2's did): neither
  does the adapter;
- the word embeddings are scaled by ``sqrt(hidden)`` (``Gemma3TextScaledWordEmbedding``) and every norm is a
  ``Gemma3RMSNorm``: the feature source is layer 0's ``input_layernorm`` of the scaled embeddings, and the
  daemon's copy of it is an ``EmbeddingLayer`` of kind ``gemma3``;
- layers alternate between a sliding window (``layer_types`` ``sliding_attention``, ``sliding_window`` keys) and
  full attention, each kind with its own rotary table (a local base for the sliding layers, the global one for the
  full ones): the decoder hands each layer its own, and a packed forward does too;
- ``use_bidirectional_attention`` (EmbeddingGemma): full layers attend to every key, sliding layers to the keys
  within ``sliding_window`` on either side (``|i - j| < sliding_window``, transformers'
  ``_bidirectional_window_overlay``); ``BidirectionalGemma3Adapter`` is then the adapter, not causal (its maps are
  replayed at their exact length only).

A Gemma 3 model always has sliding-window layers, so it has no shareable prefix, and a bidirectional one's keys
depend on what follows them: the prefix and chunk tiers are absent (``capabilities`` says why).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn, Protocol, cast

import torch
from torch import nn

from attnstore.errors import UnsupportedModelError
from attnstore.projector.embedding_layer import EmbeddingLayer
from attnstore_client.adapters.capabilities import Capabilities
from attnstore_client.adapters.llama import LlamaAdapter
from attnstore_client.adapters.packed import PackedBatch
from attnstore_client.models import LoadedModel

_NORMS = ("q_norm", "k_norm")


class _Gemma3Attention(Protocol):
    """Gemma3Attention's norms (its projections as ``llama._LlamaAttention``)."""

    q_norm: nn.Module  # Gemma3RMSNorm over head_dim
    k_norm: nn.Module


class _Gemma3Rotary(Protocol):
    """Gemma3RotaryEmbedding: one table per layer type."""

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str) -> tuple[torch.Tensor, ...]: ...


def gemma3_adapter(loaded: LoadedModel) -> Gemma3Adapter:
    """The adapter of a Gemma 3 text model: ``BidirectionalGemma3Adapter`` where its config sets
    ``use_bidirectional_attention`` (EmbeddingGemma), else ``Gemma3Adapter``.

    Raises:
        UnsupportedModelError: the model's modules are not laid out as Gemma 3's.
    """
    if getattr(loaded.model.config, "use_bidirectional_attention", False):
        return BidirectionalGemma3Adapter(loaded)
    return Gemma3Adapter(loaded)


class Gemma3Adapter(LlamaAdapter):
    """Capture and replay for causal Gemma 3 decoders: ``LlamaAdapter`` with the query and key norms, per-layer
    rotary tables and windows, and Gemma's embedding stage."""

    def __init__(self, loaded: LoadedModel) -> None:
        super().__init__(loaded)
        first = self._modules[0]
        missing = [name for name in _NORMS if not isinstance(getattr(first, name, None), nn.Module)]
        config = self.model.config
        if not hasattr(config, "layer_types"):
            missing.append("layer_types")
        self._require_layout(missing, "Gemma 3's query and key norms or layer types", "Gemma 3 text models")
        bidirectional = bool(getattr(config, "use_bidirectional_attention", False))
        if bidirectional == self.causal:
            raise UnsupportedModelError(
                f"{type(self).__name__} on a model whose use_bidirectional_attention is {bidirectional}:"
                " gemma3_adapter() chooses the adapter that matches it"
            )
        self._layer_types: tuple[str, ...] = tuple(config.layer_types[: self.num_layers])

    @property
    def capabilities(self) -> Capabilities:
        """Everything but sharing keys and values: Gemma 3 always has sliding-window layers."""
        return Capabilities(can_share_kv=False, missing="sliding-window attention (Gemma 3's sliding layers): a"
                            " suffix cannot run on a whole prefix's keys and values")

    def decoder_steps(self) -> NoReturn:
        """Refused: the chunk tier's fused forward needs a model without a sliding window.

        Raises:
            UnsupportedModelError: always.
        """
        raise UnsupportedModelError(f"the chunk tier's fused forward needs a model without a sliding window;"
                                    f" {self.loaded.name!r} (Gemma 3) has sliding-window layers")

    def embedding_layer(self) -> EmbeddingLayer:
        """``embed_tokens`` (its ``sqrt(hidden)`` scale included) and layer 0's ``input_layernorm`` (Gemma's RMSNorm),
        as ``_embed`` runs them."""
        tokens: Any = self._decoder.embed_tokens  # Gemma3TextScaledWordEmbedding
        norm: Any = self._decoder.layers[0].input_layernorm  # Gemma3RMSNorm
        scale = float(tokens.embed_scale.to(tokens.weight.dtype))  # what its forward multiplies by
        return EmbeddingLayer("gemma3", tokens.weight, norm.weight, float(norm.eps), embed_scale=scale)

    def norm_heads(
        self, module: nn.Module, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's Gemma3RMSNorm over ``d``, as ``Gemma3Attention`` applies it before RoPE: ``(..., H, d)``,
        ``(..., KVH, d)``."""
        attention = cast(_Gemma3Attention, module)
        return attention.q_norm(query), attention.k_norm(key)

    def _run_packed(self, batch: PackedBatch) -> torch.Tensor:
        # The layers called one by one (no mask to build: each run of rows attends by itself), each with the
        # rotary table of its layer type.
        decoder = self._decoder
        positions = batch.position_ids[None]  # (1, T)
        hidden = decoder.embed_tokens(batch.input_ids[None])  # (1, T, hidden), scaled by sqrt(hidden)
        rotary = cast(_Gemma3Rotary, decoder.rotary_emb)
        tables = {kind: rotary(hidden, positions, kind) for kind in set(self._layer_types)}  # cos, sin: (1, T, d)
        layers = cast("Sequence[nn.Module]", decoder.layers)
        for layer, kind in zip(layers[: self.num_layers], self._layer_types, strict=True):
            hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=tables[kind])
        return decoder.norm(hidden)[0]  # (T, hidden)


class BidirectionalGemma3Adapter(Gemma3Adapter):
    """Capture and replay for bidirectional Gemma 3 encoders (EmbeddingGemma): ``Gemma3Adapter`` whose full layers
    attend to every key and sliding layers to the window on both sides; maps are replayed at their exact length."""

    causal = False

    @property
    def capabilities(self) -> Capabilities:
        """Everything but sharing keys and values: a bidirectional model's keys depend on what follows them."""
        return Capabilities(can_share_kv=False, missing="a bidirectional model: a prefix's keys and values depend on"
                            " what follows it")
