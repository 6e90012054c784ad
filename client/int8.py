"""int8 computing: the model with the linear layers a namespace's int8 plan names dynamically quantised.

``int8=True`` (``CacheSettings``) has the compute tier run the rows no tier served on this model
(``tiers.compute``): the plan (``attnstore.projector.int8_plan``) was chosen when the namespace was built so
that its rows keep cosine >= 0.99 to the fp32 model's. Every layer it does not name stays fp32 and is shared
with the fp32 model, not copied: the quantised model costs only its int8 weights. Quantisation is PyTorch's
dynamic int8 (``torch.ao.quantization.quantize_dynamic``, weights per output channel, activations per call:
the kind sentence-transformers' int8 export runs on ONNX Runtime), on the same packed forwards as fp32 rows.
"""

from __future__ import annotations

import copy
import itertools
import threading
import warnings
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn
from transformers import PreTrainedModel

from attnstore.errors import ConfigError
from attnstore.projector.int8_plan import Int8Plan
from attnstore_client.adapters import adapter_for
from attnstore_client.adapters.base import Adapter
from attnstore_client.models import LoadedModel


def int8_candidates(adapter: Adapter) -> list[str]:
    """The names (in ``adapter.model``) of the linear layers inside its transformer blocks, in order."""
    inside = {id(module) for block in adapter.blocks for module in block.modules()}
    return [name for name, module in adapter.model.named_modules()
            if isinstance(module, nn.Linear) and id(module) in inside]


def linear_flops(model: nn.Module, names: Sequence[str]) -> int:
    """Multiply-adds per token of the linear layers ``names`` of ``model``."""
    modules = dict(model.named_modules())
    return sum(modules[name].in_features * modules[name].out_features for name in names)


def quantized_linear(linear: nn.Linear) -> nn.Module:
    """``linear`` dynamically quantised to int8: weights per output channel, activations per call."""
    with warnings.catch_warnings():
        # PyTorch deprecates its eager quantisation for torchao; the pinned torch has it and runs it.
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        warnings.filterwarnings("ignore", message="torch.ao.quantization is deprecated", category=DeprecationWarning)
        wrapper = nn.Sequential(copy.deepcopy(linear))
        torch.ao.quantization.quantize_dynamic(
            wrapper, {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True,
        )
    return wrapper[0]


def quantized_model(model: nn.Module, linears: Sequence[str]) -> nn.Module:
    """A copy of ``model`` (CPU, fp32) whose linear layers ``linears`` are dynamically quantised to int8.

    Every tensor is ``model``'s own, shared: the copy holds only the int8 weights.

    Raises:
        ConfigError: a name that is not a linear layer of ``model``.
    """
    modules = dict(model.named_modules())
    unknown = sorted(name for name in set(linears) if not isinstance(modules.get(name), nn.Linear))
    if unknown:
        raise ConfigError(f"int8 plan: {unknown} are not linear layers of {type(model).__name__}")
    shared: dict[int, object] = {id(tensor): tensor for tensor in itertools.chain(model.parameters(), model.buffers())}
    quantized = copy.deepcopy(model, memo=shared)
    for module in quantized.modules():  # a forward a oneDNN install left on the original is not the copy's
        module.__dict__.pop("forward", None)
    for name in linears:
        quantized.set_submodule(name, quantized_linear(cast(nn.Linear, modules[name])))
    return quantized.eval()


class Int8Models:
    """The int8 adapter of each plan a cache meets, made on first use and kept (a namespace's plan rarely
    changes: only a rebuild replaces it). Thread-safe."""

    def __init__(self, loaded: LoadedModel) -> None:
        self._loaded = loaded
        self._lock = threading.Lock()
        self._adapters: dict[tuple[str, ...], Adapter] = {}

    def adapter(self, plan: Int8Plan) -> Adapter:
        """The adapter of the model with ``plan``'s linear layers in int8.

        Raises:
            ConfigError: the model is not on the CPU (int8 kernels are CPU kernels), or the plan names a layer
                the model does not have (a plan built for another model).
        """
        with self._lock:
            adapter = self._adapters.get(plan.linears)
            if adapter is None:
                model = self._loaded.model
                device = next(model.parameters()).device
                if device.type != "cpu":
                    raise ConfigError(f"int8=True runs on the CPU (its kernels are CPU kernels); the model is on"
                                      f" {device}")
                quantized = cast(PreTrainedModel, quantized_model(model, plan.linears))  # a copy of one
                int8 = LoadedModel(self._loaded.name, quantized, self._loaded.tokenizer, self._loaded.lm_head)
                adapter = self._adapters[plan.linears] = adapter_for(int8)
            return adapter
