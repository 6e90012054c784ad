"""ModernBERT (gte-modernbert, modernbert-embed and other ModernBERT-based embedders): a bidirectional encoder with
a fused q/k/v projection, rotary positions and alternating global and local (sliding-window) attention.

What is particular, as transformers' ``ModernBertModel`` has it:

- The wrapped module is ``layers[i].attn`` (``ModernBertAttention``): one linear layer ``Wqkv`` gives the queries,
  keys and values (``(3, H, d)`` per token, in that order) and the output projection ``Wo`` runs inside the
  module. The hit path computes only the value third of ``Wqkv``, the computing rows of a packed forward only
  its query and key thirds.
- Positions are only in the rotary embeddings applied to queries and keys (the module's ``position_embeddings``),
  with one table per layer type: global layers rotate with ``global_rope_theta`` (160,000), local ones with
  ``local_rope_theta`` (10,000). A packed forward builds both tables from each row's own positions.
- Global (``full_attention``) and local (``sliding_attention``) layers alternate (``layer_types``, from
  ``global_attn_every_n_layers``); a local query attends the keys within ``local_attention // 2`` tokens on either
  side (``config.sliding_window``). The window is the layer's ``_sliding_window``, which the one attention function
  applies on both sides of a bidirectional query (``attention.allowed_keys``, as for EmbeddingGemma): a captured map
  is zero outside it, a replayed map holds it already (replay is exact), a packed run masks its rows with it.
- The embeddings are ``tok_embeddings`` then a LayerNorm (bias-free by default, ``norm_bias``), with no position
  or token type embeddings (``embedding_layer``); layer 0's ``attn_norm`` is the identity; ``final_norm`` follows
  the last layer. transformers 5 runs the model padded, with a mask per layer type; the unpadding it used to do
  for FlashAttention is a packed forward here.

A layer of a type other than those two takes no map: such a model runs its own forward only, and ``capabilities``
says which layers (the cache logs it once at load); capture, replay and packed forwards are refused, never run
without the layer's own attention. Bidirectional maps are only valid at their exact length, so no crop.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, cast

import torch
from torch import nn
from torch.nn import functional

from attnstore.errors import UnsupportedModelError
from attnstore.projector.embedding_layer import EmbeddingLayer
from attnstore_client.adapters.base import Adapter, Capture, LayerCall
from attnstore_client.adapters.batch import Batch
from attnstore_client.adapters.capabilities import FULL, Capabilities
from attnstore_client.adapters.packed import PackedBatch
from attnstore_client.adapters.padded import Keeping
from attnstore_client.adapters.replay import ReplayMaps
from attnstore_client.models import LoadedModel

_LAYOUT_ATTRIBUTES = ("Wqkv", "Wo")
GLOBAL, LOCAL = "full_attention", "sliding_attention"  # the layer types a ModernBERT layer takes a map in


# nn.Module types every submodule as ``Tensor | Module``; these protocols name the
# parts of the transformers modules used here (``__init__`` checks the attention's).


class _ModernBertAttention(Protocol):
    Wqkv: nn.Linear
    Wo: nn.Module


class _ModernBertLayer(Protocol):
    attention_type: str

    def __call__(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor: ...


class _ModernBertEmbeddings(Protocol):
    tok_embeddings: nn.Embedding
    norm: nn.LayerNorm

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor: ...


class _ModernBertModel(Protocol):
    embeddings: _ModernBertEmbeddings
    layers: Sequence[_ModernBertLayer]  # an nn.ModuleList
    rotary_emb: Callable[[torch.Tensor, torch.Tensor, str], tuple[torch.Tensor, torch.Tensor]]
    final_norm: nn.Module


def _attention(module: nn.Module) -> _ModernBertAttention:
    return cast(_ModernBertAttention, module)


class ModernBertAdapter(Adapter):
    """Capture and replay for ModernBERT encoders."""

    family = "bert"
    causal = False
    attention_path = "attn"

    def __init__(self, loaded: LoadedModel) -> None:
        super().__init__(loaded)
        first = self._modules[0]
        missing = [name for name in _LAYOUT_ATTRIBUTES if not isinstance(getattr(first, name, None), nn.Module)]
        rotary: Any = getattr(importlib.import_module(type(first).__module__), "apply_rotary_pos_emb", None)
        self._require_layout(missing + ["apply_rotary_pos_emb"] * (rotary is None), "ModernBERT's attention layout",
                             "ModernBertAttention")
        self._rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]] = rotary
        config = self.model.config
        types = list(config.layer_types)
        # Per layer, its window's reach on either side (``|i - j| <= reach``); None for a global layer.
        self._reach = {module: config.sliding_window if kind == LOCAL else None
                       for module, kind in zip(self._modules, types, strict=True)}
        unknown = {layer: kind for layer, kind in enumerate(types) if kind not in (GLOBAL, LOCAL)}
        self._capabilities = FULL if not unknown else Capabilities(
            can_replay=False, can_pack=False, can_share_kv=False,
            missing=f"ModernBERT layers {sorted(unknown)} of attention type {sorted(set(unknown.values()))} take no"
            f" map (known: {GLOBAL!r}, {LOCAL!r}): map replay and packed forwards need every layer's",
        )

    @property
    def capabilities(self) -> Capabilities:
        """Every capability, unless a layer is of a type the adapter does not know (``missing`` names it); a
        bidirectional model's tiers have no prefix or chunk tier whatever this says (``tiers.available``)."""
        return self._capabilities

    @property
    def _encoder(self) -> _ModernBertModel:
        return cast(_ModernBertModel, self.model)

    def _blocks(self) -> Sequence[nn.Module]:
        return cast("Sequence[nn.Module]", self._encoder.layers)

    def _run(self, batch: Batch) -> torch.Tensor:
        # ModernBertModel takes no ``use_cache`` (it would reach the attention kernel's keywords).
        output = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        return output.last_hidden_state  # (B, P, hidden)

    def _embed(self, batch: Batch) -> torch.Tensor:
        return self._encoder.embeddings(input_ids=batch.input_ids)  # (B, P, hidden)

    def embedding_layer(self) -> EmbeddingLayer:
        """``tok_embeddings`` then ``embeddings.norm`` (a LayerNorm, its bias None when the model has none), as
        ``_embed`` runs them: no positions (those are rotary) and no token types."""
        embeddings = self._encoder.embeddings
        norm = embeddings.norm
        return EmbeddingLayer("modernbert", embeddings.tok_embeddings.weight, norm.weight, float(norm.eps),
                              norm_bias=norm.bias)

    def _run_packed(self, batch: PackedBatch) -> torch.Tensor:
        # The layers called one by one: no attention mask to build (each run of rows attends by itself, within a
        # local layer's window, ``_sliding_window``); the rotary tables of each layer type from the rows' own positions.
        encoder = self._encoder
        positions = batch.position_ids[None]  # (1, T)
        hidden = encoder.embeddings(input_ids=batch.input_ids[None])  # (1, T, hidden)
        rotary = {kind: encoder.rotary_emb(hidden, positions, kind)
                  for kind in {layer.attention_type for layer in encoder.layers}}  # cos, sin: (1, T, d) each
        for layer in encoder.layers:
            hidden = layer(hidden, attention_mask=None, position_embeddings=rotary[layer.attention_type])
        return encoder.final_norm(hidden)[0]  # (T, hidden)

    def _queries_keys(
        self, module: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict, tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fused = _attention(module).Wqkv
        cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]  # (1|B, T', d) each
        if tokens is None:
            cos, sin = cos[:, : hidden.shape[1]], sin[:, : hidden.shape[1]]  # (1|B, T, d) each
        else:
            hidden = hidden.index_select(1, tokens)  # (B, N, hidden)
            cos, sin = cos.index_select(1, tokens), sin.index_select(1, tokens)  # (1|B, N, d) each
        batch_size, length, _ = hidden.shape
        width = self.num_heads * self.head_dim
        bias = None if fused.bias is None else fused.bias[: 2 * width]
        projected = functional.linear(hidden, fused.weight[: 2 * width], bias)  # (B, N, 2*H*d): queries, keys
        query, key = projected.view(batch_size, length, 2, self.num_heads, self.head_dim).unbind(2)  # (B, N, H, d)
        return self._rotary(query.transpose(1, 2), key.transpose(1, 2), cos, sin)  # (B, H, N, d) each

    def _values(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        fused = _attention(module).Wqkv
        width = self.num_heads * self.head_dim
        bias = None if fused.bias is None else fused.bias[2 * width :]
        return functional.linear(hidden, fused.weight[2 * width :], bias)  # (..., T, H*d)

    def _project_out(self, module: nn.Module, context: torch.Tensor) -> torch.Tensor:
        return _attention(module).Wo(context)  # (..., T, hidden)

    def _sliding_window(self, module: nn.Module) -> int | None:
        # A local layer's keys within its reach on either side (``attention.allowed_keys``: ``|i - j| < window``).
        reach = self._reach[module]
        return None if reach is None else reach + 1

    def _fusable(self) -> Mapping[nn.Module, nn.Linear]:
        return {}  # ModernBertMLP gates its activation (``act(input) * gate``): nothing oneDNN fuses

    # --- a layer that takes no map ------------------------------------------------------

    def capture(self, batch: Batch) -> Capture:
        self._refuse_unless(self._capabilities.can_replay, "map capture")
        return super().capture(batch)

    def _forward(self, batch: Batch, replay: dict[int, ReplayMaps], keeping: Keeping | None = None) -> torch.Tensor:
        if replay or keeping is not None:
            self._refuse_unless(self._capabilities.can_replay, "map replay and capture")
        return super()._forward(batch, replay, keeping)

    def forward_packed(
        self, batch: PackedBatch, replay: Mapping[int, ReplayMaps] | None = None, keep: Sequence[int] = ()
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        self._refuse_unless(self._capabilities.can_pack, "packed forwards")
        return super().forward_packed(batch, replay, keep)

    def forward_patched(self, batch: Batch, call: LayerCall) -> torch.Tensor:
        self._refuse_unless(self._capabilities.can_replay, "patched forwards")
        return super().forward_patched(batch, call)

    def _refuse_unless(self, able: bool, what: str) -> None:
        if not able:
            raise UnsupportedModelError(f"{what} of {self.loaded.name!r}: {self._capabilities.missing}")
