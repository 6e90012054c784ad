"""What a namespace records of its model: the layout of a namespace made for it, its token limits, and the
layouts of its prefix blocks and chunks (causal models: recorded at creation, never chosen by a writer)."""

from __future__ import annotations

from attnstore.protocol.chunks import ChunkDtype, ChunkLayout
from attnstore.protocol.prefix import DEFAULT_BLOCK_SIZE, PrefixLayout
from attnstore.protocol.records import Codec, NamespaceLayout, TokenLimits
from attnstore_client.adapters import adapter_for
from attnstore_client.models import LoadedModel
from attnstore_client.projector import ProjectorConfig
from attnstore_client.tiers.chunks.store_source import model_chunk_layout
from attnstore_client.tiers.prefix import prefix_layout_of
from attnstore_client.tiers.prefix.shared import shareable


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


def kv_layouts(
    loaded: LoadedModel, *, block_size: int = DEFAULT_BLOCK_SIZE, chunk_dtype: ChunkDtype = "float16"
) -> tuple[PrefixLayout | None, ChunkLayout | None]:
    """The prefix and chunk layouts of ``loaded``'s namespace: blocks of ``block_size`` tokens in the model's
    compute dtype, chunks in ``chunk_dtype`` (the chunk tier's default); ``(None, None)`` for a model whose
    prefixes cannot be reused (bidirectional, or a sliding window)."""
    adapter = adapter_for(loaded)
    if not shareable(adapter):
        return None, None
    return prefix_layout_of(adapter, block_size=block_size), model_chunk_layout(adapter, chunk_dtype)
