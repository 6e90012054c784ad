"""What a namespace records of its model: the layout of a namespace made for it, and its token limits."""

from __future__ import annotations

from attnstore.protocol.records import Codec, NamespaceLayout, TokenLimits
from attnstore_client.adapters import adapter_for
from attnstore_client.models import LoadedModel
from attnstore_client.projector import ProjectorConfig


def token_limits(loaded: LoadedModel) -> TokenLimits:
    """What the daemon checks written-back rows of ``loaded``'s namespace against: ids below the larger of the
    model's and the tokenizer's vocabulary (added tokens count), lengths within the model's positions."""
    config = loaded.model.config
    vocab = max(int(config.vocab_size), len(loaded.tokenizer))
    return TokenLimits(vocab_size=vocab, max_length=int(config.max_position_embeddings))


def exact_tier_layout(loaded: LoadedModel, codec: Codec = "fp16") -> NamespaceLayout:
    """The layout of ``loaded``'s namespace, with the default projector's feature size (for a later projector)."""
    adapter = adapter_for(loaded)
    return NamespaceLayout(
        layers=adapter.num_layers, heads=adapter.num_heads, causal=adapter.causal, hidden=adapter.hidden_size,
        feature_dim=ProjectorConfig(hidden=adapter.hidden_size).dim, codec=codec,
    )
