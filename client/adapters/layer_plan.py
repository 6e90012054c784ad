"""Layer plans: per-layer decisions of a planned forward (``Adapter.forward_planned``).

A plan is consulted by the patched attention forward at every layer, in layer
order, for one call. At each layer it says which rows replay which maps (it may
look at the layer's input hidden states to decide) and whether the maps the
other rows compute must be materialised and handed back to it. Layer-sharing
methods (LazyFormer, SAN) keep a computing layer's maps and replay them at the
layers after it; per-layer search methods replay stored maps row by row.

A plan holds the state of one call: make a new one for every forward.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence

import torch

from attnstore.errors import ConfigError


class LayerPlan(ABC):
    """What a planned forward does at each attention layer."""

    @abstractmethod
    def replay(self, layer: int, hidden: torch.Tensor, lengths: Sequence[int]) -> Mapping[int, torch.Tensor]:
        """Choose the rows that replay maps at this layer, and their maps.

        Args:
            layer: the attention layer about to run.
            hidden: ``(B, P, hidden)`` the attention module's input; pad positions hold no meaning.
            lengths: every row's true length.

        Returns:
            Row index -> ``(heads, L', L')`` maps (fp32/fp16/bf16; ``L' >= L`` is
            cropped for causal models). Rows left out compute this layer.
        """

    def keeps(self, layer: int) -> bool:
        """Whether the maps that rows compute at this layer must be handed to ``keep``."""
        return False

    def keep(self, layer: int, maps: Mapping[int, torch.Tensor]) -> None:
        """Receive the maps the computing rows used at this layer.

        Args:
            layer: the layer that computed them.
            maps: row index -> ``(heads, L, L)`` fp32 probabilities at the row's true length.

        Raises:
            NotImplementedError: the plan keeps maps but does not say where to.
        """
        raise NotImplementedError(f"{type(self).__name__}.keeps({layer}) is True but keep() is not implemented")


class SharedMapsPlan(LayerPlan):
    """Layers that reuse the maps an earlier layer computed, for every row.

    Attributes:
        sources: layer -> the earlier layer whose maps it replays; a source layer
            computes its own maps.
        kept: layer -> row -> ``(heads, L, L)`` fp32 maps, for every source layer
            and every layer in ``keep_layers``, filled as the forward runs.
    """

    def __init__(self, sources: Mapping[int, int], *, keep_layers: Iterable[int] = ()) -> None:
        """Plan a forward in which each layer of ``sources`` replays its source's maps.

        Args:
            sources: layer -> source layer, ``source < layer``; a source may not
                itself replay (chains must be resolved to the computing layer).
            keep_layers: further computing layers whose maps to keep (to inspect them).

        Raises:
            ConfigError: a source that is not an earlier, computing layer, or a
                layer to keep that replays.
        """
        for layer, source in sources.items():
            if not 0 <= source < layer or source in sources:
                raise ConfigError(
                    f"SharedMapsPlan: layer {layer} cannot reuse layer {source}; a source must be an earlier "
                    f"layer that computes its own maps (replaying layers: {sorted(sources)})"
                )
        self.sources = dict(sources)
        self._keep = set(sources.values()) | set(keep_layers)
        if self._keep & set(sources):
            raise ConfigError(f"SharedMapsPlan: cannot keep layers {sorted(self._keep & set(sources))}: they replay")
        self.kept: dict[int, dict[int, torch.Tensor]] = {}

    def replay(self, layer: int, hidden: torch.Tensor, lengths: Sequence[int]) -> Mapping[int, torch.Tensor]:
        """Every row replays the source's kept maps at a sharing layer; nothing elsewhere."""
        source = self.sources.get(layer)
        return {} if source is None else self.kept[source]

    def keeps(self, layer: int) -> bool:
        """True for source layers and the layers asked for in ``keep_layers``."""
        return layer in self._keep

    def keep(self, layer: int, maps: Mapping[int, torch.Tensor]) -> None:
        """Store the computed maps under ``kept[layer]``."""
        self.kept.setdefault(layer, {}).update(maps)
