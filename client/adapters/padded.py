"""Padded forwards: what each attention layer does in ``capture``, ``forward`` and ``forward_keeping``.

Each entry point hands the patched layers one record (``Adapter._patched``): ``Capturing`` computes every row's
maps and applies them; ``Replaying`` sends the replaying rows (and, for ``forward_keeping``, the computing rows
with maps of their own, ``Keeping``) through the hit path and the others through the module's own forward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnstore_client.adapters.attention import attention_probs
from attnstore_client.adapters.replay import ReplayMaps, layer_maps
from attnstore_client.adapters.rows import hidden_states, merge_rows, select_rows

if TYPE_CHECKING:
    from torch import nn

    from attnstore_client.adapters.hooks import AttentionHooks


@dataclass(frozen=True)
class Capturing:
    """``capture``: every row computes its maps in fp32 at its true length, keeps them and replays them."""

    lengths: tuple[int, ...]
    captured: list[torch.Tensor]  # per row (layers, H, L, L) fp32, filled layer by layer

    def attend(
        self, adapter: AttentionHooks, layer: int, module: nn.Module, original: Callable[..., Any], args: tuple,
        kwargs: dict,
    ) -> tuple:
        hidden = hidden_states(args, kwargs)  # (B, P, hidden)
        maps = []
        for row, probs in enumerate(adapter.row_maps(module, hidden, self.lengths, args, kwargs)):
            self.captured[row][layer].copy_(probs)  # kept fp32 on the CPU, whatever the model's device and dtype
            maps.append(probs.to(hidden.dtype))  # (H, L, L), replayed where and as the model runs
        return adapter.replay_rows(module, hidden, maps, self.lengths), None


@dataclass(frozen=True)
class Keeping:
    """The computing rows of ``forward_keeping``: one padded softmax a layer gives them their maps to apply."""

    rows: tuple[int, ...]  # every computing row, sorted (one batched softmax costs less than splitting the batch)
    index: torch.Tensor | None  # (B_keep,) long: those rows, only when some rows replay stored maps
    kept: torch.Tensor  # (layers, B_kept, H, P, P) fp16: the maps of the rows asked for, padded
    kept_index: torch.Tensor | None  # (B_kept,) their positions in ``rows``; None: all of ``rows``


@dataclass(frozen=True)
class Replaying:
    """``forward`` and ``forward_keeping``: replaying rows take the hit path, the others the module's own forward."""

    lengths: tuple[int, ...]  # true length of every row
    replay: Mapping[int, ReplayMaps]  # hit row -> its maps
    keeping: Keeping | None  # computing rows that apply maps of their own
    rows: tuple[int, ...]  # sorted hits and kept rows: the rows that take the hit path
    split: tuple[torch.Tensor, torch.Tensor] | None  # (B_rows,), (B_miss,) long, only when some rows miss

    def attend(
        self, adapter: AttentionHooks, layer: int, module: nn.Module, original: Callable[..., Any], args: tuple,
        kwargs: dict,
    ) -> tuple:
        hidden = hidden_states(args, kwargs)  # (B, P, hidden)
        lengths = [self.lengths[row] for row in self.rows]
        if self.split is None:
            maps = self._maps(adapter, layer, module, hidden, args, kwargs)
            return adapter.replay_rows(module, hidden, maps, lengths), None
        hit_index, miss_index = self.split
        batch_size = hidden.shape[0]
        # Misses first: a streaming client's hit maps keep arriving meanwhile.
        # (B_miss, P, out)
        missed = original(*select_rows(args, miss_index, batch_size), **select_rows(kwargs, miss_index, batch_size))[0]
        maps = self._maps(adapter, layer, module, hidden, args, kwargs)
        replayed = adapter.replay_rows(module, hidden.index_select(0, hit_index), maps, lengths)  # (B_rows, P, out)
        return merge_rows(batch_size, hit_index, replayed, miss_index, missed), None

    def _maps(
        self, adapter: AttentionHooks, layer: int, module: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict
    ) -> list[torch.Tensor]:
        """The maps of every row of ``rows`` at ``layer`` in row order, ``(H, L, L)`` each in the compute dtype:
        the hits' stored maps, and the kept rows' own, computed here and kept."""
        maps = {
            row: layer_maps(self.replay[row], row, layer, self.lengths[row], heads=adapter.num_heads,
                            causal=adapter.causal, dtype=hidden.dtype)
            for row in sorted(self.replay)
        }  # hit row -> (H, L, L)
        keeping = self.keeping
        if keeping is not None:
            index, batch_size = keeping.index, hidden.shape[0]
            lengths = [self.lengths[row] for row in keeping.rows]
            padded = keeping.kept.shape[-1]
            probs = padded_maps(
                adapter,
                module,
                (hidden if index is None else hidden.index_select(0, index))[:, :padded],  # (B_keep, P_keep, hidden)
                lengths,
                args if index is None else select_rows(args, index, batch_size),
                kwargs if index is None else select_rows(kwargs, index, batch_size),
            )  # (B_keep, H, P_keep, P_keep) fp32
            kept_index = keeping.kept_index
            keeping.kept[layer].copy_(probs if kept_index is None else probs.index_select(0, kept_index))
            applied = probs.to(hidden.dtype)
            for k, (row, length) in enumerate(zip(keeping.rows, lengths, strict=True)):
                maps[row] = applied[k, :, :length, :length]  # (H, L, L)
        return [maps[row] for row in self.rows]


def padded_maps(
    adapter: AttentionHooks, module: nn.Module, hidden: torch.Tensor, lengths: Sequence[int], args: tuple,
    kwargs: dict,
) -> torch.Tensor:
    """Every row's attention probabilities at once, ``(B, H, P, P)`` fp32: one batched softmax.

    Row ``r``'s top-left ``L x L`` block is what ``Adapter.row_maps`` yields for it (pad keys get no weight); the
    rest holds no meaning. What keeping maps in an ordinary forward uses, where the rows are length-sorted and pad
    little.
    """
    query, key = adapter._queries_keys(module, hidden, args, kwargs)  # (B, H, P, d), (B, KVH, P, d)
    bias = adapter._score_bias(module, query.shape[2], query.device)  # (H, P, P) or None: rows' L x L blocks hold it
    return attention_probs(query, key, scaling=adapter._scaling(module), causal=adapter.causal,
                           window=adapter._sliding_window(module), lengths=lengths, bias=bias)  # (B, H, P, P)
