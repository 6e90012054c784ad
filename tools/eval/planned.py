"""Planned forwards: a ``LayerPlan`` decides at every layer which rows replay which maps.

What the layer-sharing and per-layer-search baselines of ``attnstore eval``
(LazyFormer, SAN, AttnCache-f, ``baselines``) run on. A plan is consulted by the
patched attention forward at every layer, in layer order, for one call: at each
layer it sees the attention input and names the rows that replay and their maps;
the other rows compute, and if the plan keeps the layer, their maps are computed
in fp32 at each row's true length (as ``Adapter.capture`` does), handed to the
plan and applied through the hit path. Layer-sharing methods (LazyFormer, SAN)
keep a computing layer's maps and replay them at the layers after it; per-layer
search methods replay stored maps row by row.

A plan holds the state of one call: make a new one for every forward.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnstore.errors import ConfigError, MapShapeError
from attnstore_client.adapters import Adapter
from attnstore_client.adapters.batch import Batch
from attnstore_client.adapters.replay import check_layer_maps
from attnstore_client.adapters.rows import hidden_states, merge_rows, select_rows


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


def forward_planned(adapter: Adapter, batch: Batch, plan: LayerPlan) -> torch.Tensor:
    """One forward of the whole batch in which ``plan`` decides, layer by layer, which rows replay.

    At each layer the plan sees the attention input and names the rows that
    replay and their maps; the other rows compute. If the plan keeps the
    layer, the computing rows' maps are computed in fp32 at each row's true
    length (as ``capture`` does), handed to ``plan.keep`` and applied through
    the hit path; otherwise those rows go through the module's own forward.

    Args:
        adapter: the model's adapter.
        batch: the right-padded batch.
        plan: the per-layer decisions, for this call only.

    Returns:
        ``(B, P, hidden)`` last hidden states; pad positions hold no meaning.

    Raises:
        MapShapeError: the plan named a row outside the batch, or gave maps of
            the wrong type, dtype, heads or length.
    """
    return adapter.forward_patched(batch, _Planned(plan, batch.lengths))


@dataclass(frozen=True)
class _Planned:
    """The ``LayerCall`` of a planned forward."""

    plan: LayerPlan
    lengths: tuple[int, ...]  # true length of every row

    def attend(
        self, adapter: Adapter, layer: int, module: nn.Module, original: Callable[..., Any], args: tuple, kwargs: dict
    ) -> tuple:
        """One layer of a planned forward: the plan's rows replay, the others compute (and maybe keep)."""
        hidden = hidden_states(args, kwargs)  # (B, P, hidden)
        batch_size, lengths = hidden.shape[0], self.lengths
        replay = {
            row: self._maps(adapter, maps, row, layer, hidden.dtype)
            for row, maps in self.plan.replay(layer, hidden, lengths).items()
        }  # hit row -> (H, L, L)
        computing = [row for row in range(batch_size) if row not in replay]
        if computing and self.plan.keeps(layer):
            index = torch.tensor(computing)
            own = len(computing) == batch_size
            probs = adapter.row_maps(
                module,
                hidden if own else hidden.index_select(0, index),  # (B_comp, P, hidden)
                [lengths[row] for row in computing],
                args if own else select_rows(args, index, batch_size),
                kwargs if own else select_rows(kwargs, index, batch_size),
            )
            kept = dict(zip(computing, probs, strict=True))  # row -> (H, L, L) fp32
            self.plan.keep(layer, kept)
            replay.update({row: probs.to(hidden.dtype) for row, probs in kept.items()})
            computing = []
        if not replay:
            return original(*args, **kwargs)
        hits = sorted(replay)
        maps = [replay[row] for row in hits]  # per hit row (H, L, L)
        if not computing:
            return adapter.replay_rows(module, hidden, maps, lengths), None
        hit_index, miss_index = torch.tensor(hits), torch.tensor(computing)
        missed = original(*select_rows(args, miss_index, batch_size), **select_rows(kwargs, miss_index, batch_size))
        missed = missed[0]  # (B_miss, P, out)
        hit_lengths = [lengths[row] for row in hits]
        replayed = adapter.replay_rows(module, hidden.index_select(0, hit_index), maps, hit_lengths)  # (B_hit, P, out)
        return merge_rows(batch_size, hit_index, replayed, miss_index, missed), None

    def _maps(self, adapter: Adapter, maps: torch.Tensor, row: int, layer: int, dtype: torch.dtype) -> torch.Tensor:
        """Check a plan's maps for one row and layer; return them cropped to ``(H, L, L)`` in ``dtype``."""
        if not isinstance(row, int) or not 0 <= row < len(self.lengths):
            raise MapShapeError(
                f"layer {layer}: the plan replays row {row!r}, not a row of this batch (0..{len(self.lengths) - 1})"
            )
        length = self.lengths[row]
        one = check_layer_maps(maps, row, layer, length, heads=adapter.num_heads, causal=adapter.causal)  # (H, L', L')
        return one[:, :length, :length].to(dtype)  # (H, L, L)
