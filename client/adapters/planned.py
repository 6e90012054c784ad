"""Planned forwards: a ``LayerPlan`` decides at every layer which rows replay which maps.

What the layer-sharing and per-layer-search baselines of ``attnstore eval``
(LazyFormer, SAN, AttnCache-f) run on: at each layer the plan sees the attention
input and names the rows that replay and their maps; the other rows compute,
and if the plan keeps the layer, their maps are computed in fp32 at each row's
true length (as ``Adapter.capture`` does), handed to the plan and applied
through the hit path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from attnstore.errors import MapShapeError
from attnstore_client.adapters.layer_plan import LayerPlan
from attnstore_client.adapters.replay import check_layer_maps
from attnstore_client.adapters.rows import merge_rows, select_rows

if TYPE_CHECKING:
    from attnstore_client.adapters.hooks import AttentionHooks


def attend_planned(
    adapter: AttentionHooks,
    layer: int,
    module: nn.Module,
    original: Any,
    plan: LayerPlan,
    lengths: Sequence[int],
    hidden: torch.Tensor,
    args: tuple,
    kwargs: dict,
) -> tuple:
    """One layer of a planned forward: the plan's rows replay, the others compute (and maybe keep)."""
    batch_size = hidden.shape[0]
    replay = {
        row: _plan_maps(adapter, maps, row, layer, lengths, hidden.dtype)
        for row, maps in plan.replay(layer, hidden, lengths).items()
    }  # hit row -> (H, L, L)
    computing = [row for row in range(batch_size) if row not in replay]
    if computing and plan.keeps(layer):
        index = torch.tensor(computing)
        own = len(computing) == batch_size
        probs = adapter._attention_probs(
            module,
            hidden if own else hidden.index_select(0, index),  # (B_comp, P, hidden)
            [lengths[row] for row in computing],
            args if own else select_rows(args, index, batch_size),
            kwargs if own else select_rows(kwargs, index, batch_size),
        )
        kept = dict(zip(computing, probs, strict=True))  # row -> (H, L, L) fp32
        plan.keep(layer, kept)
        replay.update({row: probs.to(hidden.dtype) for row, probs in kept.items()})
        computing = []
    if not replay:
        return original(*args, **kwargs)
    hits = sorted(replay)
    maps = [replay[row] for row in hits]  # per hit row (H, L, L)
    if not computing:
        return adapter._replay_rows(module, hidden, maps, lengths), None
    hit_index, miss_index = torch.tensor(hits), torch.tensor(computing)
    missed = original(*select_rows(args, miss_index, batch_size), **select_rows(kwargs, miss_index, batch_size))
    missed = missed[0]  # (B_miss, P, out)
    hit_lengths = [lengths[row] for row in hits]
    replayed = adapter._replay_rows(module, hidden.index_select(0, hit_index), maps, hit_lengths)  # (B_hit, P, out)
    return merge_rows(batch_size, hit_index, replayed, miss_index, missed), None


def _plan_maps(
    adapter: AttentionHooks, maps: torch.Tensor, row: int, layer: int, lengths: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """Check a plan's maps for one row and layer; return them cropped to ``(H, L, L)`` in ``dtype``."""
    if not isinstance(row, int) or not 0 <= row < len(lengths):
        raise MapShapeError(
            f"layer {layer}: the plan replays row {row!r}, not a row of this batch (0..{len(lengths) - 1})"
        )
    length = lengths[row]
    one = check_layer_maps(maps, row, layer, length, heads=adapter.num_heads, causal=adapter.causal)  # (H, L', L')
    return one[:, :length, :length].to(dtype)  # (H, L, L)
