"""Where a call's served rows go: pooled into a preallocated result as each forward ends.

A sink takes the last hidden states of a few rows at a time (a forward's, or a
tier's hits) and keeps only what the caller asked for: the sentence embeddings
(``encode``), every row's states (``hidden_states``, token embeddings) or each
row's last state (``score_choices``). So a call's memory is its result plus a
few batches, whatever its number of rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch

from attnstore_client.call.rows import HiddenRows

# Pools right-padded last hidden states (B, P, hidden) and their mask (B, P) into (B, dim).
Pool = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Sink(ABC):
    """Takes served rows, each with every input position it answers."""

    # Whether it keeps only each row's last state: then a tier may hand it the states of a row's last tokens
    # alone (the chunk tier computes only the question's).
    last_only: ClassVar[bool] = False

    @abstractmethod
    def put(self, targets: Sequence[Sequence[int]], hidden: HiddenRows) -> None:
        """Row ``r`` of ``hidden`` is the result of every input position in ``targets[r]``."""

    @abstractmethod
    def copy(self, source: int, target: int) -> None:
        """Input position ``target`` has the result already given to ``source`` (an identical row)."""


class RowStates(Sink):
    """Every row's last hidden states ``(L, hidden)``, each in its own storage (not a view of its forward's)."""

    def __init__(self, rows: int) -> None:
        self.rows: list[torch.Tensor | None] = [None] * rows

    def put(self, targets: Sequence[Sequence[int]], hidden: HiddenRows) -> None:
        """See :meth:`Sink.put`."""
        for r, positions in enumerate(targets):
            states = hidden.row(r)
            for position in positions:
                self.rows[position] = states.clone()

    def copy(self, source: int, target: int) -> None:
        """See :meth:`Sink.copy`."""
        states = self.rows[source]
        assert states is not None  # a copy follows its source
        self.rows[target] = states.clone()

    def result(self) -> list[torch.Tensor]:
        """Every row's states, in input order."""
        assert all(states is not None for states in self.rows)  # every row was served
        return [states for states in self.rows if states is not None]


class Pooled(Sink):
    """One vector per row (``pool`` of its states), written into one ``(n, dim)`` tensor; optionally the states.

    Args:
        rows: the call's number of input rows.
        pool: the model's pooling.
        keep_states: also keep every row's states (``output_value="token_embeddings"`` or None).
    """

    def __init__(self, rows: int, pool: Pool, *, keep_states: bool = False) -> None:
        self._rows = rows
        self._pool = pool
        self._result: torch.Tensor | None = None  # allocated once the first pooled vectors show its width
        self.states = RowStates(rows) if keep_states else None

    def put(self, targets: Sequence[Sequence[int]], hidden: HiddenRows) -> None:
        """See :meth:`Sink.put`."""
        tokens, mask = hidden.padded()  # (B, P, hidden), (B, P)
        pooled = self._pool(tokens, mask)  # (B, dim)
        if self._result is None:
            self._result = pooled.new_empty((self._rows, pooled.shape[-1]))  # (n, dim)
        index = torch.tensor([r for r, positions in enumerate(targets) for _ in positions], device=pooled.device)
        where = torch.tensor([p for positions in targets for p in positions], device=pooled.device)
        self._result.index_copy_(0, where, pooled.index_select(0, index))
        if self.states is not None:
            self.states.put(targets, hidden)

    def copy(self, source: int, target: int) -> None:
        """See :meth:`Sink.copy`."""
        assert self._result is not None  # a copy follows its source
        self._result[target] = self._result[source]
        if self.states is not None:
            self.states.copy(source, target)

    def result(self) -> torch.Tensor:
        """The ``(n, dim)`` vectors, in input order."""
        assert self._result is not None  # every call has a row
        return self._result


class LastStates(Sink):
    """Each row's last hidden state, in one ``(n, hidden)`` tensor: what a next-token score needs."""

    last_only: ClassVar[bool] = True

    def __init__(self, rows: int) -> None:
        self._rows = rows
        self._result: torch.Tensor | None = None

    def put(self, targets: Sequence[Sequence[int]], hidden: HiddenRows) -> None:
        """See :meth:`Sink.put`."""
        for r, positions in enumerate(targets):
            last = hidden.row(r)[-1]  # (hidden,)
            if self._result is None:
                self._result = last.new_empty((self._rows, last.shape[-1]))  # (n, hidden)
            self._result[list(positions)] = last

    def copy(self, source: int, target: int) -> None:
        """See :meth:`Sink.copy`."""
        assert self._result is not None  # a copy follows its source
        self._result[target] = self._result[source]

    def result(self) -> torch.Tensor:
        """The ``(n, hidden)`` last states, in input order."""
        assert self._result is not None  # every call has a row
        return self._result
