"""BERT's module layout (BERT, RoBERTa, XLM-RoBERTa): bidirectional self-attention, no GQA.

The wrapped module is ``layer.attention.self`` (``BertSelfAttention`` /
``RobertaSelfAttention``, ``XLMRobertaSelfAttention``), which returns the attention context; the output
projection (``BertSelfOutput.dense``) runs outside it for every row. Bidirectional
maps are only valid at their exact length, so no crop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

import torch
from torch import nn

from attnstore.errors import UnsupportedModelError
from attnstore.projector.embedding_layer import EmbeddingLayer
from attnstore_client.adapters.base import Adapter
from attnstore_client.adapters.batch import Batch
from attnstore_client.adapters.packed import PackedBatch
from attnstore_client.models import LoadedModel

_LAYOUT_ATTRIBUTES = ("query", "key", "value", "scaling")


# nn.Module types every submodule as ``Tensor | Module``; these protocols name the
# parts of the transformers modules used here (``__init__`` checks the attention's).


class _BertSelfAttention(Protocol):
    """BertSelfAttention, RobertaSelfAttention."""

    query: nn.Module
    key: nn.Module
    value: nn.Module
    scaling: float


class _BertAttention(Protocol):
    """BertAttention, RobertaAttention; ``self`` is the module wrapped."""

    self: nn.Module


class _BertLayer(Protocol):
    """BertLayer, RobertaLayer."""

    attention: _BertAttention
    intermediate: nn.Module  # BertIntermediate: ``dense`` then ``intermediate_act_fn``

    def __call__(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor: ...


class _BertEncoder(Protocol):
    """BertEncoder, RobertaEncoder."""

    layer: Sequence[_BertLayer]  # an nn.ModuleList


class _BertModel(Protocol):
    """BertModel, RobertaModel."""

    embeddings: nn.Module
    encoder: _BertEncoder


def _attention(module: nn.Module) -> _BertSelfAttention:
    return cast(_BertSelfAttention, module)


def absolute_embedding_layer(embeddings: nn.Module) -> EmbeddingLayer:
    """The embedding stage of BERT and the encoders that copy it (RoBERTa, XLM-RoBERTa, DistilBERT, MPNet): word,
    absolute position and (where there are any) token-type embeddings, then a LayerNorm.

    RoBERTa, XLM-RoBERTa and MPNet number positions from their pad id + 1 (``padding_idx``); DistilBERT and MPNet have
    no token types (adding nothing).
    """
    parts: Any = embeddings  # transformers' embedding modules (no common type)
    norm = parts.LayerNorm
    padding_idx = getattr(parts, "padding_idx", None)
    types = getattr(parts, "token_type_embeddings", None)
    token_type = types.weight[0] if types is not None else torch.zeros_like(norm.weight)
    return EmbeddingLayer(
        "bert", parts.word_embeddings.weight, norm.weight, float(norm.eps), positions=parts.position_embeddings.weight,
        token_type=token_type, norm_bias=norm.bias, padding_idx=None if padding_idx is None else int(padding_idx),
    )


class BertAdapter(Adapter):
    """Capture and replay for BERT, RoBERTa and XLM-RoBERTa encoders."""

    family = "bert"
    causal = False
    attention_path = "attention.self"
    takes_token_types = True

    def __init__(self, loaded: LoadedModel) -> None:
        config = loaded.model.config
        if getattr(config, "is_decoder", False):
            raise UnsupportedModelError(
                f"{config.model_type} configured as a decoder (is_decoder=True); supported: bidirectional encoders"
            )
        super().__init__(loaded)
        self._require_layout([name for name in _LAYOUT_ATTRIBUTES if not hasattr(self._modules[0], name)],
                             "the BERT attention layout", "BERT, RoBERTa, XLM-RoBERTa")

    @property
    def _encoder(self) -> _BertModel:
        return cast(_BertModel, self.model)

    def _blocks(self) -> Sequence[nn.Module]:
        return cast("Sequence[nn.Module]", self._encoder.encoder.layer)

    def _embed(self, batch: Batch) -> torch.Tensor:
        # (B, P, hidden); a text pair's token types where it has them (else type 0, as the model takes None)
        return self._encoder.embeddings(input_ids=batch.input_ids, token_type_ids=batch.token_type_ids)

    def embedding_layer(self) -> EmbeddingLayer:
        """``embeddings`` (word, position, token type 0, LayerNorm), as ``_embed`` runs it."""
        return absolute_embedding_layer(self._encoder.embeddings)

    def _run_packed(self, batch: PackedBatch) -> torch.Tensor:
        # The layers called one by one: no attention mask to build (each run of rows attends by itself).
        embeddings = self._encoder.embeddings
        # RoBERTa (and XLM-RoBERTa) numbers positions from its pad id + 1 (what it derives from unpadded input ids).
        first = getattr(embeddings, "padding_idx", -1) + 1
        positions = batch.position_ids[None] + first  # (1, T)
        types = None if batch.token_type_ids is None else batch.token_type_ids[None]  # (1, T)
        hidden = embeddings(input_ids=batch.input_ids[None], position_ids=positions,
                            token_type_ids=types)  # (1, T, hidden)
        for layer in self._encoder.encoder.layer:
            hidden = layer(hidden, None)  # (1, T, hidden)
        return hidden[0]  # (T, hidden)

    def _queries_keys(
        self, module: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict, tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attention = _attention(module)
        if tokens is not None:
            hidden = hidden.index_select(1, tokens)  # (B, N, hidden)
        batch_size, length, _ = hidden.shape
        shape = (batch_size, length, self.num_heads, self.head_dim)
        query = attention.query(hidden).view(shape).transpose(1, 2)  # (B, H, N, d)
        key = attention.key(hidden).view(shape).transpose(1, 2)  # (B, H, N, d)
        return query, key

    def _fusable(self) -> Mapping[nn.Module, nn.Linear]:
        # BertIntermediate: dense, then the activation.
        return {layer.intermediate: cast(nn.Linear, layer.intermediate.dense) for layer in self._encoder.encoder.layer}

    def _values(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return _attention(module).value(hidden)  # (B, P, H*d)
