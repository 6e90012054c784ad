"""The model's embedding stage, kept with a namespace's projector so a daemon derives features from tokens.

A row's feature is the projector over its *feature source*: token (+position/type)
embeddings and the first norm, the stage the client's adapter runs
(``Adapter.feature_source``) and hands over as tensors (``Adapter.embedding_layer``):
which tensors a family's model holds them in is the adapter's business; here is
only the arithmetic of each kind (``EmbeddingLayer.kind``). That stage needs only these
few tensors (MiniLM: ~47 MB in fp32), so whoever installs a projector stores
them in its blob (tensors under ``embedding_layer.``, a record in the metadata)
and the daemon computes a written-back row's feature itself: a write token can
then not choose where its row lands in the map index.

The tensors are kept in fp32 whatever the model's dtype, and the arithmetic
follows transformers' modules step by step (the same adds in the same order),
so a derived feature equals the client's to float rounding.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import safetensors.torch
import torch
import torch.nn.functional as F

from attnstore.errors import FeatureSourceError, FormatVersionError, MapShapeError
from attnstore.projector.blob import EMBEDDING_LAYER_METADATA_KEY, EMBEDDING_LAYER_PREFIX, projector_metadata
from attnstore.projector.network import Projector

FORMAT = "attnstore.embedding_layer/1"
EmbeddingKind = Literal["bert", "llama", "gemma3", "modernbert"]
_KINDS: tuple[EmbeddingKind, ...] = ("bert", "llama", "gemma3", "modernbert")
_TENSORS = ("tokens", "positions", "token_type", "norm_weight", "norm_bias")


@dataclass(frozen=True, eq=False)
class EmbeddingLayer:
    """One model's embedding stage, fp32 on the CPU.

    Attributes:
        kind: ``bert`` (token, absolute position and token type embeddings, then a LayerNorm: BERT and the
            encoders that copy it), ``llama`` (token embeddings, then an RMSNorm), ``gemma3`` (token embeddings
            times ``embed_scale``, then an RMSNorm scaling by ``1 + weight``) or ``modernbert`` (token embeddings,
            then a LayerNorm; no position or token type embeddings: its positions are rotary, in the attention).
        tokens: ``(vocab, hidden)`` token embeddings.
        norm_weight: ``(hidden,)`` the first norm's weight.
        eps: the first norm's epsilon.
        positions: ``(max_positions, hidden)`` absolute position embeddings (bert only).
        token_type: ``(hidden,)`` the embedding of token type 0 (bert only; every row is one segment).
        norm_bias: ``(hidden,)`` the LayerNorm's bias (bert; modernbert where its LayerNorm has one).
        padding_idx: RoBERTa numbers positions from ``padding_idx + 1`` skipping pad tokens; None: from 0 (BERT).
        embed_scale: what the token embeddings are multiplied by (gemma3 only: ``sqrt(hidden)`` in the model's dtype).
    """

    kind: EmbeddingKind
    tokens: torch.Tensor
    norm_weight: torch.Tensor
    eps: float
    positions: torch.Tensor | None = None
    token_type: torch.Tensor | None = None
    norm_bias: torch.Tensor | None = None
    padding_idx: int | None = None
    embed_scale: float | None = None

    @torch.no_grad()
    def feature_source(self, token_ids: Sequence[int] | np.ndarray) -> torch.Tensor:
        """One row's input embedding, ``(L, hidden)`` fp32, as the model's own embedding stage computes it.

        Raises:
            MapShapeError: no tokens, a token id outside the vocabulary, or more tokens than positions.
        """
        ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))  # (L,)
        if ids.ndim != 1 or len(ids) == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.tokens.shape[0]:
            raise MapShapeError(f"EmbeddingLayer.feature_source(): token ids must be one non-empty row inside the"
                                f" vocabulary of {self.tokens.shape[0]}, got shape {tuple(ids.shape)}")
        embedded = F.embedding(ids, self.tokens)  # (L, hidden)
        if self.kind == "gemma3":
            assert self.embed_scale is not None  # checked when loaded
            # Gemma3TextScaledWordEmbedding, then Gemma3RMSNorm: in fp32, x * rsqrt(mean(x^2) + eps) * (1 + weight).
            embedded = embedded * torch.tensor(self.embed_scale, dtype=embedded.dtype)
            variance = embedded.pow(2).mean(-1, keepdim=True)  # (L, 1)
            return embedded * torch.rsqrt(variance + self.eps) * (1.0 + self.norm_weight)
        if self.kind == "modernbert":
            # ModernBertEmbeddings: the LayerNorm of the token embeddings alone.
            return F.layer_norm(embedded, (embedded.shape[-1],), self.norm_weight, self.norm_bias, self.eps)
        if self.kind == "llama":
            # LlamaRMSNorm: in fp32, x * rsqrt(mean(x^2) + eps), then the weight.
            variance = embedded.pow(2).mean(-1, keepdim=True)  # (L, 1)
            return self.norm_weight * (embedded * torch.rsqrt(variance + self.eps))
        assert self.positions is not None and self.token_type is not None  # checked when loaded
        if self.padding_idx is None:
            position_ids = torch.arange(len(ids))  # (L,)
        else:  # RoBERTa: create_position_ids_from_input_ids
            mask = (ids != self.padding_idx).long()  # (L,)
            position_ids = torch.cumsum(mask, dim=0) * mask + self.padding_idx
        if int(position_ids.max()) >= self.positions.shape[0]:
            raise MapShapeError(f"EmbeddingLayer.feature_source(): {len(ids)} tokens is over the model's"
                                f" {self.positions.shape[0]} positions")
        embedded = embedded + self.token_type  # BertEmbeddings: inputs + token types, then positions
        embedded = embedded + F.embedding(position_ids, self.positions)  # (L, hidden)
        return F.layer_norm(embedded, (embedded.shape[-1],), self.norm_weight, self.norm_bias, self.eps)

    def attach_to(self, projector_blob: bytes) -> bytes:
        """``projector_blob`` with this layer in it: what is stored as the namespace's projector.

        Raises:
            FormatVersionError: the blob is not safetensors bytes.
        """
        metadata = _metadata(projector_blob)
        tensors = {name: t for name, t in safetensors.torch.load(bytes(projector_blob)).items()
                   if not name.startswith(EMBEDDING_LAYER_PREFIX)}
        for name in _TENSORS:
            value = getattr(self, name)
            if value is not None:
                tensors[EMBEDDING_LAYER_PREFIX + name] = value.detach().to("cpu", torch.float32).contiguous()
        metadata[EMBEDDING_LAYER_METADATA_KEY] = json.dumps(
            {"format": FORMAT, "kind": self.kind, "eps": self.eps, "padding_idx": self.padding_idx,
             **({} if self.embed_scale is None else {"embed_scale": self.embed_scale})}
        )
        return safetensors.torch.save(tensors, metadata=metadata)

    @classmethod
    def from_projector_blob(cls, blob: bytes) -> EmbeddingLayer | None:
        """The layer a stored projector blob carries; None when it carries none.

        Raises:
            FormatVersionError: not safetensors bytes, an unknown format, or a malformed layer.
        """
        text = _metadata(blob).get(EMBEDDING_LAYER_METADATA_KEY)
        if text is None:
            return None
        record = json.loads(text)
        if record.get("format") != FORMAT or record.get("kind") not in _KINDS:
            raise FormatVersionError(f"embedding layer: format {record.get('format')!r} of kind"
                                     f" {record.get('kind')!r}; this code reads {FORMAT!r} of kinds {list(_KINDS)}")
        if record["kind"] == "gemma3" and record.get("embed_scale") is None:
            raise FormatVersionError("embedding layer of kind 'gemma3' lacks its embed_scale")
        loaded = {name[len(EMBEDDING_LAYER_PREFIX):]: t for name, t in safetensors.torch.load(bytes(blob)).items()
                  if name.startswith(EMBEDDING_LAYER_PREFIX)}
        needed = ("tokens", "norm_weight") + (("positions", "token_type", "norm_bias") if record["kind"] == "bert"
                                               else ())
        missing = [name for name in needed if name not in loaded]
        if missing:
            raise FormatVersionError(f"embedding layer of kind {record['kind']!r} lacks tensors {missing}")
        scale = record.get("embed_scale")
        return cls(record["kind"], eps=float(record["eps"]), padding_idx=record.get("padding_idx"),
                   embed_scale=None if scale is None else float(scale),
                   **{name: t.float() for name, t in loaded.items() if name in _TENSORS})


@dataclass(frozen=True, eq=False)
class FeatureDeriver:
    """A namespace's projector and embedding layer: a row's feature from its token ids alone."""

    projector: Projector
    layer: EmbeddingLayer

    @classmethod
    def from_projector_blob(cls, blob: bytes) -> FeatureDeriver | None:
        """The deriver of a stored projector blob; None when it carries no embedding layer.

        Raises:
            FormatVersionError: the blob or its layer is malformed.
        """
        layer = EmbeddingLayer.from_projector_blob(blob)
        if layer is None:
            return None
        projector = Projector.from_safetensors_bytes(blob)
        if layer.tokens.shape[1] != projector.config.hidden:
            raise FormatVersionError(f"embedding layer of width {layer.tokens.shape[1]} for a projector of"
                                     f" hidden size {projector.config.hidden}")
        return cls(projector, layer)

    def features(self, rows: Sequence[Sequence[int] | np.ndarray]) -> np.ndarray:
        """``(n, dim)`` float32: each row's feature, ``projector.project(feature_source(tokens))``.

        Raises:
            MapShapeError: a row the layer cannot embed (see ``EmbeddingLayer.feature_source``).
        """
        sources = [self.layer.feature_source(tokens) for tokens in rows]  # each (L, hidden)
        try:
            return self.projector.project(sources)  # (n, dim)
        except FeatureSourceError as exc:
            raise MapShapeError(f"a written-back row's feature cannot be derived: {exc}") from None


def _metadata(blob: bytes) -> dict[str, str]:
    try:
        return projector_metadata(blob)
    except Exception as exc:  # WireFormatError: not safetensors
        raise FormatVersionError(f"embedding layer: {exc}") from None
