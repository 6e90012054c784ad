"""Model adapters: capture and replay of attention maps, one class per attention family; any other model through
its own forward (``generic``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from attnstore_client.adapters.base import Adapter, Capture
from attnstore_client.adapters.bert import BertAdapter
from attnstore_client.adapters.capabilities import Capabilities
from attnstore_client.adapters.distilbert import DistilBertAdapter
from attnstore_client.adapters.gemma3 import BidirectionalGemma3Adapter, Gemma3Adapter, gemma3_adapter
from attnstore_client.adapters.generic import GenericAdapter, GenericDecoderAdapter
from attnstore_client.adapters.llama import LlamaAdapter
from attnstore_client.adapters.modernbert import ModernBertAdapter
from attnstore_client.adapters.mpnet import MPNetAdapter
from attnstore_client.adapters.qwen3 import Qwen3Adapter
from attnstore_client.models import LoadedModel, is_causal

__all__ = [
    "Adapter", "BertAdapter", "BidirectionalGemma3Adapter", "Capabilities", "Capture", "DistilBertAdapter",
    "Gemma3Adapter", "GenericAdapter", "GenericDecoderAdapter", "LlamaAdapter", "MPNetAdapter", "ModernBertAdapter",
    "Qwen3Adapter", "adapter_for",
]

# model_type -> its family's adapter (or what chooses it from the config), as text-embeddings-inference's backends
# are keyed; the same keys as ``models.SUPPORTED_MODEL_TYPES`` (what loads as a family's model), which a test holds.
_ADAPTERS: Mapping[str, Callable[[LoadedModel], Adapter]] = MappingProxyType({
    "llama": LlamaAdapter,
    "mistral": LlamaAdapter,
    "qwen2": LlamaAdapter,
    "qwen3": Qwen3Adapter,  # Llama's layout plus per-head query and key norms
    "gemma3_text": gemma3_adapter,  # Qwen3's plus sliding layers, scaled embeddings; bidirectional for EmbeddingGemma
    "bert": BertAdapter,
    "roberta": BertAdapter,
    "xlm-roberta": BertAdapter,  # RoBERTa's modules; positions from the pad id
    "distilbert": DistilBertAdapter,
    "mpnet": MPNetAdapter,
    "modernbert": ModernBertAdapter,  # fused Wqkv, rotary positions, global and sliding-window layers
})


def adapter_for(loaded: LoadedModel) -> Adapter:
    """Return the adapter for a loaded model, chosen by its architecture: its family's, else the model's own forward
    (``GenericAdapter``, or ``GenericDecoderAdapter`` for a causal model), whose ``capabilities`` say what is off.

    Raises:
        UnsupportedModelError: a family's model whose modules are not laid out as the family's adapter expects.
    """
    config = loaded.model.config
    adapter = _ADAPTERS.get(config.model_type)
    if adapter is None:
        return GenericDecoderAdapter(loaded) if is_causal(config) else GenericAdapter(loaded)
    return adapter(loaded)
