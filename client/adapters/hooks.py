"""What the layers of packed and padded forwards need of an adapter: its layout, the per-layer hooks each family
implements and the parts of a layer the base makes of them. A protocol rather than ``Adapter`` itself, so that
``packed`` and ``padded`` sit below ``base`` (which runs them) instead of in a circle with it."""

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

    def _queries_keys(
        self, module: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict, tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def _sliding_window(self, module: nn.Module) -> int | None: ...

    def _scaling(self, module: nn.Module) -> float: ...

    def _score_bias(self, module: nn.Module, length: int, device: torch.device) -> torch.Tensor | None: ...

    def _values(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor: ...

    def _project_out(self, module: nn.Module, context: torch.Tensor) -> torch.Tensor: ...

    def row_maps(
        self, module: nn.Module, hidden: torch.Tensor, lengths: Sequence[int], args: tuple, kwargs: dict
    ) -> Iterator[torch.Tensor]: ...

    def replay_rows(
        self, module: nn.Module, hidden: torch.Tensor, maps: Sequence[torch.Tensor], lengths: Sequence[int]
    ) -> torch.Tensor: ...
