"""The ways of running a batch that the evaluation harness compares, and how their time is measured.

Every variant takes the same right-padded batch and returns each row's last
hidden states with what serving it took. The plain model (``PlainVariant``, the
model's default ``sdpa`` attention) is the reference; ``CacheVariant`` is
AttnStore's client at one threshold (``output_cache`` is the same client with
map hits switched off: the exact tier alone is a plain output cache keyed by the
exact input); the layer-sharing and per-layer-search baselines live in
``eval_baselines``.

Attention time is measured with forward hooks on the model's attention modules:
the hooks wrap whatever runs inside them (the module's own kernel, or the replay
patch), so the same clock times every variant.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from attnstore_client.adapters import Adapter
from attnstore_client.batch import Batch
from attnstore_client.cache import AttnCache


@dataclass(frozen=True, slots=True)
class BatchRun:
    """One batch through one variant."""

    hidden: list[torch.Tensor]  # per row, (L, hidden) fp32 last hidden states
    retrieval_s: float = 0.0  # projection + lookup + fetch; 0 for methods that retrieve nothing
    # The part of retrieval_s spent inside the attention modules (maps read as each layer
    # reaches them), so attention compute time = attention time - inline_s.
    inline_s: float = 0.0
    exact_hits: int = 0  # rows answered by stored outputs (no forward)
    map_hits: int = 0  # rows that replayed stored maps
    layer_replays: int = 0  # (row, layer) pairs whose maps were not computed (layer-level methods)
    fallbacks: int = 0  # rows the store should have served but could not
    kinds: tuple[str, ...] = ()  # per row, for store-backed variants: "exact", "map", "miss" or "fallback"


class Variant(ABC):
    """A way of running batches that the harness times and scores.

    Attributes:
        name: the method (``full``, ``attncache``, ``output_cache``, ``lazyformer``, ``san``, ``attncache_f``).
        setting: what distinguishes this run of the method (a threshold), None if nothing.
    """

    name: str
    setting: float | None = None

    @abstractmethod
    def run(self, batch: Batch) -> BatchRun:
        """Run one batch; rows come back in batch order."""

    def close(self) -> None:  # noqa: B027 (optional: most variants hold nothing)
        """Release what the variant holds (store connections)."""


class PlainVariant(Variant):
    """The unmodified model: the reference every other variant is compared with."""

    name = "full"

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter

    def run(self, batch: Batch) -> BatchRun:
        out = self.adapter.forward(batch)  # (B, P, hidden)
        return BatchRun(hidden=[out[row, :length] for row, length in enumerate(batch.lengths)])


class CacheVariant(Variant):
    """AttnStore's client at one threshold, or under the namespace's fidelity gate (``threshold`` None).

    ``maps=False`` makes it a plain output cache (exact tier only).
    """

    def __init__(self, cache: AttnCache, threshold: float | None, *, maps: bool = True) -> None:
        self.cache = cache
        self.name = "attncache" if maps else "output_cache"
        # An exact-only cache: distance 0 admits only a feature vector equal to a stored one,
        # i.e. the same tokens, which the exact tier answers first.
        self.setting = threshold if maps else None
        self._threshold = threshold if maps else 0.0

    def run(self, batch: Batch) -> BatchRun:
        if self._threshold is None:
            self.cache.gated = True
        else:
            self.cache.max_distance = self._threshold
        hidden = self.cache.run_batch(batch)
        stats = self.cache.last_stats
        return BatchRun(
            hidden=hidden,
            retrieval_s=stats.projection_s + stats.lookup_s + stats.fetch_s,
            # Embedded stores read each layer's maps when the forward reaches it; a daemon's
            # stream is received beside the forward, which waits inside the attention modules.
            inline_s=stats.fetch_s,
            exact_hits=stats.exact_hits,
            map_hits=stats.map_hits,
            fallbacks=stats.fallback_rows,
            kinds=self.cache.last_row_kinds,
        )


class AttentionTimer:
    """Wall seconds spent inside the given attention modules, summed over calls.

    Use as a context manager; the hooks are removed on exit.
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.seconds = 0.0
        self._modules = list(modules)
        self._started: dict[int, float] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> AttentionTimer:
        for module in self._modules:
            self._handles.append(module.register_forward_pre_hook(self._start))
            self._handles.append(module.register_forward_hook(self._stop))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _start(self, module: nn.Module, args: object) -> None:
        self._started[id(module)] = time.perf_counter()

    def _stop(self, module: nn.Module, args: object, output: object) -> None:
        self.seconds += time.perf_counter() - self._started.pop(id(module))
