"""BERT-like encoders (BERT, RoBERTa): bidirectional self-attention, no GQA.

The wrapped module is ``layer.attention.self`` (``BertSelfAttention`` /
``RobertaSelfAttention``), which returns the attention context; the output
projection (``BertSelfOutput.dense``) runs outside it for every row. Bidirectional
maps are only valid at their exact length, so no crop.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol, cast

import torch
from torch import nn

from attnstore.errors import UnsupportedModelError
from attnstore_client.adapters.base import Adapter
from attnstore_client.adapters.batch import Batch
from attnstore_client.adapters.packed import PackedBatch, tokens_of
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


class BertAdapter(Adapter):
    """Capture and replay for BERT and RoBERTa encoders."""

    family = "bert"
    causal = False

    def __init__(self, loaded: LoadedModel) -> None:
        config = loaded.model.config
        if getattr(config, "is_decoder", False):
            raise UnsupportedModelError(
                f"{config.model_type} configured as a decoder (is_decoder=True); supported: bidirectional encoders"
            )
        super().__init__(loaded)
        missing = [name for name in _LAYOUT_ATTRIBUTES if not hasattr(self._modules[0], name)]
        if missing:
            raise UnsupportedModelError(
                f"{type(self._modules[0]).__name__} lacks the BERT attention layout (missing {missing}); "
                "supported: BERT, RoBERTa"
            )

    @property
    def _encoder(self) -> _BertModel:
        return cast(_BertModel, self.model)

    def _blocks(self) -> Sequence[nn.Module]:
        return cast("Sequence[nn.Module]", self._encoder.encoder.layer)

    def _attention_modules(self) -> Sequence[nn.Module]:
        return [layer.attention.self for layer in self._encoder.encoder.layer]

    def _embed(self, batch: Batch) -> torch.Tensor:
        return self._encoder.embeddings(input_ids=batch.input_ids)  # (B, P, hidden)

    def _run(self, batch: Batch) -> torch.Tensor:
        output = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        return output.last_hidden_state  # (B, P, hidden)

    def _run_packed(self, batch: PackedBatch) -> torch.Tensor:
        # The layers called one by one: no attention mask to build (each run of rows attends by itself).
        embeddings = self._encoder.embeddings
        # RoBERTa numbers positions from its pad id + 1 (what it derives from unpadded input ids).
        first = getattr(embeddings, "padding_idx", -1) + 1
        positions = batch.position_ids[None] + first  # (1, T)
        hidden = embeddings(input_ids=batch.input_ids[None], position_ids=positions)  # (1, T, hidden)
        for layer in self._encoder.encoder.layer:
            hidden = layer(hidden, None)  # (1, T, hidden)
        return hidden[0]  # (T, hidden)

    def _packed_queries_keys(
        self, module: nn.Module, hidden: torch.Tensor, index: torch.Tensor | None, args: tuple, kwargs: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attention = _attention(module)
        tokens = tokens_of(hidden, index)  # (N, hidden)
        shape = (tokens.shape[0], self.num_heads, self.head_dim)
        return attention.query(tokens).view(shape), attention.key(tokens).view(shape)  # (N, H, d) each

    def _fusable(self) -> Mapping[nn.Module, nn.Linear]:
        # BertIntermediate: dense, then the activation.
        return {layer.intermediate: cast(nn.Linear, layer.intermediate.dense) for layer in self._encoder.encoder.layer}

    def _values(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return _attention(module).value(hidden)  # (B, P, H*d)

    def _project_out(self, module: nn.Module, context: torch.Tensor) -> torch.Tensor:
        return context  # (B, P, H*d): BertSelfOutput.dense follows outside the wrapped module

    def _attention_probs(
        self, module: nn.Module, hidden: torch.Tensor, lengths: Sequence[int], args: tuple, kwargs: dict
    ) -> Iterator[torch.Tensor]:
        attention = _attention(module)
        batch_size, padded, _ = hidden.shape
        shape = (batch_size, padded, self.num_heads, self.head_dim)
        query = attention.query(hidden).view(shape).transpose(1, 2)  # (B, H, P, d)
        key = attention.key(hidden).view(shape).transpose(1, 2)  # (B, H, P, d)
        for row, length in enumerate(lengths):
            # Slicing to the true length drops the pad keys the model's mask would hide.
            scores = torch.matmul(query[row, :, :length], key[row, :, :length].transpose(1, 2))  # (H, L, L)
            yield torch.softmax(scores * attention.scaling, dim=-1, dtype=torch.float32)  # (H, L, L)

    def _padded_probs(
        self, module: nn.Module, hidden: torch.Tensor, lengths: Sequence[int], args: tuple, kwargs: dict
    ) -> torch.Tensor:
        attention = _attention(module)
        batch_size, padded, _ = hidden.shape
        shape = (batch_size, padded, self.num_heads, self.head_dim)
        query = attention.query(hidden).view(shape).transpose(1, 2)  # (B, H, P, d)
        key = attention.key(hidden).view(shape).transpose(1, 2)  # (B, H, P, d)
        scores = torch.matmul(query, key.transpose(2, 3)) * attention.scaling  # (B, H, P, P)
        pad = torch.arange(padded)[None, :] >= torch.tensor(lengths)[:, None]  # (B, P) pad keys
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        return torch.softmax(scores, dim=-1, dtype=torch.float32)  # (B, H, P, P)
