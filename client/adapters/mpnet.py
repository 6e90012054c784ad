"""MPNet: BERT-like bidirectional self-attention plus a relative position bias on the scores.

The wrapped module is ``encoder.layer[i].attention.attn`` (``MPNetSelfAttention``:
``q``, ``k``, ``v`` and the output projection ``o`` inside it; the residual and
``LayerNorm`` run outside it for every row). Before the softmax every layer adds
the encoder's relative position bias, ``(H, L, L)``, to the scaled scores
(``MPNetEncoder.compute_position_bias``: one table for every layer, a function of
``j - i`` only, so a row's bias is the same padded or packed). Capture takes the
map after the bias and a replayed map holds it, so replay adds nothing; a packed
forward computes the bias per run length. Positions are numbered from the pad id
+ 1, as RoBERTa's. Bidirectional maps are only valid at their exact length, so no
crop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, cast

import torch
from torch import nn

from attnstore.projector.embedding_layer import EmbeddingLayer
from attnstore_client.adapters.base import Adapter
from attnstore_client.adapters.batch import Batch
from attnstore_client.adapters.bert import absolute_embedding_layer
from attnstore_client.adapters.packed import PackedBatch
from attnstore_client.models import LoadedModel

_LAYOUT_ATTRIBUTES = ("q", "k", "v", "o")


# nn.Module types every submodule as ``Tensor | Module``; these protocols name the
# parts of the transformers modules used here (``__init__`` checks the attention's).


class _MPNetSelfAttention(Protocol):
    q: nn.Module
    k: nn.Module
    v: nn.Module
    o: nn.Module


class _MPNetLayer(Protocol):
    intermediate: nn.Module  # MPNetIntermediate: ``dense`` then ``intermediate_act_fn``

    def __call__(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_bias: torch.Tensor | None) -> tuple[torch.Tensor, ...]: ...


class _MPNetEncoder(Protocol):
    layer: Sequence[_MPNetLayer]  # an nn.ModuleList

    def compute_position_bias(self, x: torch.Tensor) -> torch.Tensor: ...


class _MPNetModel(Protocol):
    embeddings: nn.Module
    encoder: _MPNetEncoder


def _attention(module: nn.Module) -> _MPNetSelfAttention:
    return cast(_MPNetSelfAttention, module)


class MPNetAdapter(Adapter):
    """Capture and replay for MPNet encoders."""

    family = "bert"
    causal = False
    attention_path = "attention.attn"

    def __init__(self, loaded: LoadedModel) -> None:
        super().__init__(loaded)
        missing = [name for name in _LAYOUT_ATTRIBUTES if not hasattr(self._modules[0], name)]
        if not hasattr(self.model.encoder, "compute_position_bias"):
            missing.append("encoder.compute_position_bias")
        self._require_layout(missing, "MPNet's attention layout", "MPNetSelfAttention")

    @property
    def _encoder(self) -> _MPNetModel:
        return cast(_MPNetModel, self.model)

    def _blocks(self) -> Sequence[nn.Module]:
        return cast("Sequence[nn.Module]", self._encoder.encoder.layer)

    def _run(self, batch: Batch) -> torch.Tensor:
        output = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        return output.last_hidden_state  # (B, P, hidden)

    def _embed(self, batch: Batch) -> torch.Tensor:
        return self._encoder.embeddings(input_ids=batch.input_ids)  # (B, P, hidden)

    def embedding_layer(self) -> EmbeddingLayer:
        """``embeddings`` as ``_embed`` runs it (``bert.absolute_embedding_layer``)."""
        return absolute_embedding_layer(self._encoder.embeddings)

    def _run_packed(self, batch: PackedBatch) -> torch.Tensor:
        # The layers called one by one: no attention mask and no bias to build (each run of rows attends by itself,
        # with its own length's bias, ``_score_bias``).
        embeddings = self._encoder.embeddings
        positions = batch.position_ids[None] + getattr(embeddings, "padding_idx", -1) + 1  # (1, T)
        hidden = embeddings(input_ids=batch.input_ids[None], position_ids=positions)  # (1, T, hidden)
        for layer in self._encoder.encoder.layer:
            hidden = layer(hidden, None, None)[0]  # (1, T, hidden)
        return hidden[0]  # (T, hidden)

    def _queries_keys(
        self, module: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict, tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attention = _attention(module)
        if tokens is not None:
            hidden = hidden.index_select(1, tokens)  # (B, N, hidden)
        batch_size, length, _ = hidden.shape
        shape = (batch_size, length, self.num_heads, self.head_dim)
        query = attention.q(hidden).view(shape).transpose(1, 2)  # (B, H, N, d)
        key = attention.k(hidden).view(shape).transpose(1, 2)  # (B, H, N, d)
        return query, key

    def _score_bias(self, module: nn.Module, length: int, device: torch.device) -> torch.Tensor:
        # The encoder's own computation (its bucketing included), on a placeholder of the row's length.
        placeholder = torch.empty((1, length, 0), device=device)
        return self._encoder.encoder.compute_position_bias(placeholder)[0]  # (H, L, L)

    def _values(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return _attention(module).v(hidden)  # (B, P, H*d)

    def _project_out(self, module: nn.Module, context: torch.Tensor) -> torch.Tensor:
        return _attention(module).o(context)  # (..., T, hidden)

    def _fusable(self) -> Mapping[nn.Module, nn.Linear]:
        # MPNetIntermediate: dense, then the activation.
        return {layer.intermediate: cast(nn.Linear, layer.intermediate.dense) for layer in self._encoder.encoder.layer}
