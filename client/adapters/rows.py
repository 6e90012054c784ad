"""Rows of a batch picked out of a module call's arguments, and put back together."""

from __future__ import annotations

from typing import Any

import torch


def hidden_states(args: tuple, kwargs: dict) -> torch.Tensor:
    """The input of an attention module's call, ``(B, T, hidden)``, wherever the call passed it."""
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def merge_rows(
    batch_size: int, hit_index: torch.Tensor, replayed: torch.Tensor, miss_index: torch.Tensor, missed: torch.Tensor
) -> torch.Tensor:
    """Interleave replayed ``(B_hit, P, out)`` and computed ``(B_miss, P, out)`` rows into ``(B, P, out)``."""
    out = replayed.new_empty((batch_size, *replayed.shape[1:]))  # (B, P, out)
    out.index_copy_(0, hit_index, replayed)
    out.index_copy_(0, miss_index, missed)
    return out


def select_rows(value: Any, index: torch.Tensor, batch_size: int) -> Any:
    """Select batch rows from every per-row tensor inside a call's arguments."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, index) if value.dim() and value.shape[0] == batch_size else value
    if isinstance(value, tuple):
        return tuple(select_rows(item, index, batch_size) for item in value)
    if isinstance(value, list):
        return [select_rows(item, index, batch_size) for item in value]
    if isinstance(value, dict):
        return {key: select_rows(item, index, batch_size) for key, item in value.items()}
    return value
