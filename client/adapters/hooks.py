"""What packed attention needs of an adapter: its layout and the per-layer hooks each family implements. A
protocol rather than ``Adapter`` itself, so that ``packed`` sits below ``base`` (which runs it) instead of in a
circle with it."""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
from torch import nn


class AttentionHooks(Protocol):
    causal: ClassVar[bool]
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def _queries_keys(
        self, module: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict, tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def _sliding_window(self, module: nn.Module) -> int | None: ...

    def _scaling(self, module: nn.Module) -> float: ...

    def _values(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor: ...

    def _project_out(self, module: nn.Module, context: torch.Tensor) -> torch.Tensor: ...
