"""Model adapters: capture and replay of attention maps, one class per attention family."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from attnstore.errors import UnsupportedModelError
from attnstore_client.adapters.base import Adapter, Capture
from attnstore_client.adapters.bert import BertAdapter
from attnstore_client.adapters.llama import LlamaAdapter
from attnstore_client.models import SUPPORTED_MODEL_TYPES, LoadedModel

__all__ = ["Adapter", "BertAdapter", "Capture", "LlamaAdapter", "adapter_for"]

_ADAPTERS: Mapping[str, type[Adapter]] = MappingProxyType({"llama": LlamaAdapter, "bert": BertAdapter})


def adapter_for(loaded: LoadedModel) -> Adapter:
    """Return the adapter for a loaded model, chosen by its architecture.

    Raises:
        UnsupportedModelError: the model type has no adapter; the message lists
            the supported ones.
    """
    model_type = loaded.model.config.model_type
    family = SUPPORTED_MODEL_TYPES.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"no adapter for model type {model_type!r}; supported: {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    return _ADAPTERS[family](loaded)
