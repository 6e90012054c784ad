"""Where a call's served rows go: pooled into a preallocated result as each forward ends.

A sink takes the last hidden states of a few rows at a time (a forward's, or a
tier's hits) and keeps only what the caller asked for: the sentence embeddings
(``encode``), every row's states (``hidden_states``, token embeddings) or each
row's last state (``score_choices``). So a call's memory is its result plus a
few batches, whatever its number of rows.

A sink knows which input positions it has received: a copy of a row not yet
received, or a result asked for while a position was never written, raises
``UnwrittenRowError`` naming the row. A result buffer is allocated uninitialised
(its rows are all written before it is handed out), so a bug in the call's path
is loud, never a row of garbage.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np
import torch

from attnstore.errors import UnwrittenRowError
from attnstore_client.call.rows import HiddenRows

# Pools rows' last hidden states into (B, dim) (a head's ``pool_rows``).
Pool = Callable[[HiddenRows], torch.Tensor]


class Sink(ABC):
    """Takes served rows, each with every input position it answers, and knows which positions it has.

    Subclasses write the rows (``_put``, ``_copy``); the base keeps the positions received.

    Args:
        rows: the call's number of input rows.
    """

    # Whether it keeps only each row's last state: then a tier may hand it the states of a row's last tokens
    # alone (the chunk tier computes only the question's).
    last_only: ClassVar[bool] = False

    def __init__(self, rows: int) -> None:
        self._received = np.zeros(rows, dtype=bool)  # per input position: written yet

    def put(self, targets: Sequence[Sequence[int]], hidden: HiddenRows) -> None:
        """Row ``r`` of ``hidden`` is the result of every input position in ``targets[r]``."""
        self._put(targets, hidden)
        for positions in targets:
            self._received[list(positions)] = True

    def copy(self, source: int, target: int) -> None:
        """Input position ``target`` has the result already given to ``source`` (an identical row).

        Raises:
            UnwrittenRowError: ``source`` was never received.
        """
        if not self._received[source]:
            raise UnwrittenRowError(f"row {target} copies row {source}, which the call has not written yet")
        self._copy(source, target)
        self._received[target] = True

    def check(self, kinds: Sequence[str] | None = None) -> None:
        """Raise unless every input position was received.

        Args:
            kinds: per input position, the kind the call recorded for it (named in the message).

        Raises:
            UnwrittenRowError: the first unwritten positions, each with its kind.
        """
        missing = np.flatnonzero(~self._received)
        if len(missing):
            shown = ", ".join(f"row {int(p)} (kind {kinds[p] if kinds is not None else '?'!r})" for p in missing[:8])
            raise UnwrittenRowError(f"{len(missing)} of {len(self._received)} rows were never written: {shown}"
                                    f"{', ...' if len(missing) > 8 else ''}")

    @abstractmethod
    def _put(self, targets: Sequence[Sequence[int]], hidden: HiddenRows) -> None:
        """Write row ``r`` of ``hidden`` to every input position in ``targets[r]``."""

    @abstractmethod
    def _copy(self, source: int, target: int) -> None:
        """Write ``source``'s result (already written) to ``target``."""


class RowStates(Sink):
    """Every row's last hidden states ``(L, hidden)``, each in its own storage (not a view of its forward's)."""

    def __init__(self, rows: int) -> None:
        super().__init__(rows)
        self.rows: list[torch.Tensor | None] = [None] * rows

    def _put(self, targets: Sequence[Sequence[int]], hidden: HiddenRows) -> None:
        for r, positions in enumerate(targets):
            states = hidden.row(r)
            for position in positions:
                self.rows[position] = states.clone()

    def _copy(self, source: int, target: int) -> None:
        states = self.rows[source]
        assert states is not None  # Sink.copy checked it was received
        self.rows[target] = states.clone()

    def result(self) -> list[torch.Tensor]:
        """Every row's states, in input order.

        Raises:
            UnwrittenRowError: a row was never written.
        """
        self.check()
        return [states for states in self.rows if states is not None]


class Pooled(Sink):
    """One vector per row (``pool`` of its states), written into one ``(n, dim)`` tensor; optionally the states.

    Args:
        rows: the call's number of input rows.
        pool: the model's pooling.
        keep_states: also keep every row's states (``output_value="token_embeddings"`` or None).
    """

    def __init__(self, rows: int, pool: Pool, *, keep_states: bool = False) -> None:
        super().__init__(rows)
        self._rows = rows
        self._pool = pool
        self._result: torch.Tensor | None = None  # allocated once the first pooled vectors show its width
        self.states = RowStates(rows) if keep_states else None

    def _put(self, targets: Sequence[Sequence[int]], hidden: HiddenRows) -> None:
        pooled = self._pool(hidden)  # (B, dim)
        if self._result is None:
            self._result = pooled.new_empty((self._rows, pooled.shape[-1]))  # (n, dim)
        index = torch.tensor([r for r, positions in enumerate(targets) for _ in positions], device=pooled.device)
        where = torch.tensor([p for positions in targets for p in positions], device=pooled.device)
        self._result.index_copy_(0, where, pooled.index_select(0, index))
        if self.states is not None:
            self.states.put(targets, hidden)

    def _copy(self, source: int, target: int) -> None:
        assert self._result is not None  # Sink.copy checked the source was received
        self._result[target] = self._result[source]
        if self.states is not None:
            self.states.copy(source, target)

    def result(self) -> torch.Tensor:
        """The ``(n, dim)`` vectors, in input order.

        Raises:
            UnwrittenRowError: a row was never written (or the call had no rows).
        """
        self.check()
        if self._result is None:
            raise UnwrittenRowError("a call of no rows has no pooled result")
        return self._result


class LastStates(Sink):
    """Each row's last hidden state, in one ``(n, hidden)`` tensor: what a next-token score needs."""

    last_only: ClassVar[bool] = True

    def __init__(self, rows: int) -> None:
        super().__init__(rows)
        self._rows = rows
        self._result: torch.Tensor | None = None

    def _put(self, targets: Sequence[Sequence[int]], hidden: HiddenRows) -> None:
        for r, positions in enumerate(targets):
            last = hidden.row(r)[-1]  # (hidden,)
            if self._result is None:
                self._result = last.new_empty((self._rows, last.shape[-1]))  # (n, hidden)
            self._result[list(positions)] = last

    def _copy(self, source: int, target: int) -> None:
        assert self._result is not None  # Sink.copy checked the source was received
        self._result[target] = self._result[source]

    def result(self) -> torch.Tensor:
        """The ``(n, hidden)`` last states, in input order.

        Raises:
            UnwrittenRowError: a row was never written (or the call had no rows).
        """
        self.check()
        if self._result is None:
            raise UnwrittenRowError("a call of no rows has no last states")
        return self._result
