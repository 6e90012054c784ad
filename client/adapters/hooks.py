"""What packed and planned attention need of an adapter: its layout and the per-layer hooks each family
implements. A protocol rather than ``Adapter`` itself, so that ``packed`` and ``planned`` sit below
``base`` (which runs them) instead of in a circle with it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import ClassVar, Protocol

import torch
from torch import nn


class AttentionHooks(Protocol):
    causal: ClassVar[bool]
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def _attention_probs(
        self, module: nn.Module, hidden: torch.Tensor, lengths: Sequence[int], args: tuple, kwargs: dict
    ) -> Iterator[torch.Tensor]: ...

    def _packed_queries_keys(
        self, module: nn.Module, hidden: torch.Tensor, index: torch.Tensor | None, args: tuple, kwargs: dict
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def _sliding_window(self, module: nn.Module) -> int | None: ...

    def _values(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor: ...

    def _project_out(self, module: nn.Module, context: torch.Tensor) -> torch.Tensor: ...

    def _replay_rows(
        self, module: nn.Module, hidden: torch.Tensor, maps: Sequence[torch.Tensor], lengths: Sequence[int]
    ) -> torch.Tensor: ...
