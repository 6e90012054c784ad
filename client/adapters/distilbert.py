"""DistilBERT: BERT's bidirectional self-attention under other module names, and no token types.

The wrapped module is ``transformer.layer[i].attention`` (``DistilBertSelfAttention``:
``q_lin``, ``k_lin``, ``v_lin`` and the output projection ``out_lin`` inside it;
the residual and ``sa_layer_norm`` run outside it for every row). Positions are
numbered from 0 whatever the attention mask (the embeddings take no pad id), and
there are no token type embeddings. Bidirectional maps are only valid at their
exact length, so no crop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

import torch
from torch import nn

from attnstore.projector.embedding_layer import EmbeddingLayer
from attnstore_client.adapters.base import Adapter
from attnstore_client.adapters.batch import Batch
from attnstore_client.adapters.bert import absolute_embedding_layer
from attnstore_client.adapters.packed import PackedBatch
from attnstore_client.models import LoadedModel

_LAYOUT_ATTRIBUTES = ("q_lin", "k_lin", "v_lin", "out_lin")


# nn.Module types every submodule as ``Tensor | Module``; these protocols name the
# parts of the transformers modules used here (``__init__`` checks the attention's).


class _DistilBertSelfAttention(Protocol):
    q_lin: nn.Module
    k_lin: nn.Module
    v_lin: nn.Module
    out_lin: nn.Module


class _TransformerBlock(Protocol):
    def __call__(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor: ...


class _Transformer(Protocol):
    layer: Sequence[_TransformerBlock]  # an nn.ModuleList


class _DistilBertModel(Protocol):
    embeddings: nn.Module
    transformer: _Transformer


def _attention(module: nn.Module) -> _DistilBertSelfAttention:
    return cast(_DistilBertSelfAttention, module)


class DistilBertAdapter(Adapter):
    """Capture and replay for DistilBERT encoders."""

    family = "bert"
    causal = False
    attention_path = "attention"

    def __init__(self, loaded: LoadedModel) -> None:
        super().__init__(loaded)
        self._require_layout([name for name in _LAYOUT_ATTRIBUTES if not hasattr(self._modules[0], name)],
                             "DistilBERT's attention layout", "DistilBertSelfAttention")

    @property
    def _encoder(self) -> _DistilBertModel:
        return cast(_DistilBertModel, self.model)

    def _blocks(self) -> Sequence[nn.Module]:
        return cast("Sequence[nn.Module]", self._encoder.transformer.layer)

    def _run(self, batch: Batch) -> torch.Tensor:
        # DistilBertModel takes no ``use_cache`` (it would reach the attention kernel's keywords).
        output = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        return output.last_hidden_state  # (B, P, hidden)

    def _embed(self, batch: Batch) -> torch.Tensor:
        return self._encoder.embeddings(input_ids=batch.input_ids)  # (B, P, hidden)

    def embedding_layer(self) -> EmbeddingLayer:
        """``embeddings`` as ``_embed`` runs it (``bert.absolute_embedding_layer``)."""
        return absolute_embedding_layer(self._encoder.embeddings)

    def _run_packed(self, batch: PackedBatch) -> torch.Tensor:
        # The blocks called one by one: no attention mask to build (each run of rows attends by itself).
        hidden = self._encoder.embeddings(input_ids=batch.input_ids[None],
                                          position_ids=batch.position_ids[None])  # (1, T, hidden)
        for block in self._encoder.transformer.layer:
            hidden = block(hidden, None)  # (1, T, hidden)
        return hidden[0]  # (T, hidden)

    def _queries_keys(
        self, module: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict, tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attention = _attention(module)
        if tokens is not None:
            hidden = hidden.index_select(1, tokens)  # (B, N, hidden)
        batch_size, length, _ = hidden.shape
        shape = (batch_size, length, self.num_heads, self.head_dim)
        query = attention.q_lin(hidden).view(shape).transpose(1, 2)  # (B, H, N, d)
        key = attention.k_lin(hidden).view(shape).transpose(1, 2)  # (B, H, N, d)
        return query, key

    def _values(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return _attention(module).v_lin(hidden)  # (B, P, H*d)

    def _project_out(self, module: nn.Module, context: torch.Tensor) -> torch.Tensor:
        return _attention(module).out_lin(context)  # (..., T, hidden)
