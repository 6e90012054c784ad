"""The feature projector, as the client and the tools use it, and the embedding layer that goes with it.

One implementation serves clients and daemons (a daemon derives written-back
rows' features with it), so the projector lives in
``attnstore.protocol.features.projector``; this module is its name on the
client's side, and takes a model's embedding stage out of a loaded model for
whoever installs a projector (``embedding_layer_of``).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from attnstore.errors import UnsupportedModelError
from attnstore.protocol.features.embedding_layer import EmbeddingLayer
from attnstore.protocol.features.projector import FORMAT, Calibration, Projector, ProjectorConfig

__all__ = ["FORMAT", "Calibration", "EmbeddingLayer", "Projector", "ProjectorConfig", "embedding_layer_of"]


def embedding_layer_of(model: nn.Module) -> EmbeddingLayer:
    """The embedding stage of an adapter's model (``Adapter.model``), as ``Adapter.feature_source`` runs it.

    Raises:
        UnsupportedModelError: the model is neither BERT-like (``embeddings``) nor Llama-like (``embed_tokens``).
    """
    embeddings = getattr(model, "embeddings", None)
    if embeddings is not None and hasattr(embeddings, "word_embeddings"):
        norm = embeddings.LayerNorm
        padding_idx = getattr(embeddings, "padding_idx", None)  # RoBERTa's numbering of positions
        types = getattr(embeddings, "token_type_embeddings", None)  # none in DistilBERT and MPNet: adds nothing
        token_type = types.weight[0] if types is not None else torch.zeros_like(norm.weight)
        return EmbeddingLayer(
            "bert", embeddings.word_embeddings.weight, norm.weight, float(norm.eps),
            positions=embeddings.position_embeddings.weight, token_type=token_type,
            norm_bias=norm.bias, padding_idx=None if padding_idx is None else int(padding_idx),
        )
    tokens = getattr(model, "embed_tokens", None)
    if tokens is not None:
        rms_norm: Any = cast(Any, model).layers[0].input_layernorm  # transformers' RMSNorm (no common type)
        eps = rms_norm.variance_epsilon if hasattr(rms_norm, "variance_epsilon") else rms_norm.eps
        return EmbeddingLayer("llama", tokens.weight, rms_norm.weight, float(eps))
    raise UnsupportedModelError(
        f"{type(model).__name__} has neither BERT's embeddings nor Llama's embed_tokens: its embedding layer"
        " cannot be stored for the daemon (supported: BERT, RoBERTa, Llama-like)"
    )
