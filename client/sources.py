"""A call's input rows, taken a chunk at a time in the order the tiers want them: longest first.

sentence-transformers sorts a call's texts by length before batching them and
returns results in input order; a call here does the same, and tokenizes one
chunk at a time, so a call of any size never holds every row's tokens at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence

import numpy as np


class RowSource(ABC):
    """The rows of one call: how many, and their token ids a chunk at a time, longest first."""

    @abstractmethod
    def __len__(self) -> int:
        """Rows in the call."""

    @abstractmethod
    def order(self) -> np.ndarray:
        """Input positions in the order the call takes them (longest first; ties in input order)."""

    @abstractmethod
    def tokens(self, positions: Sequence[int]) -> list[Sequence[int]]:
        """The token ids of the rows at ``positions``."""

    def chunks(self, size: int) -> Iterator[tuple[list[int], list[Sequence[int]]]]:
        """``(positions, their token ids)`` of at most ``size`` rows at a time, in ``order()``."""
        order = self.order()
        for start in range(0, len(order), size):
            positions = order[start : start + size].tolist()
            yield positions, self.tokens(positions)


class TokenRows(RowSource):
    """Rows the caller tokenized."""

    def __init__(self, rows: Sequence[Sequence[int]]) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def order(self) -> np.ndarray:
        """See :meth:`RowSource.order`: by token length."""
        return np.argsort([-len(row) for row in self._rows], kind="stable")

    def tokens(self, positions: Sequence[int]) -> list[Sequence[int]]:
        """See :meth:`RowSource.tokens`."""
        return [self._rows[position] for position in positions]


class TextRows(RowSource):
    """Texts, tokenized a chunk at a time by ``tokenize``."""

    def __init__(self, texts: Sequence[str], tokenize: Callable[[list[str]], list[list[int]]]) -> None:
        self._texts = texts
        self._tokenize = tokenize

    def __len__(self) -> int:
        return len(self._texts)

    def order(self) -> np.ndarray:
        """See :meth:`RowSource.order`: by text length, as sentence-transformers sorts (before tokenizing)."""
        return np.argsort([-len(text) for text in self._texts], kind="stable")

    def tokens(self, positions: Sequence[int]) -> list[Sequence[int]]:
        """See :meth:`RowSource.tokens`."""
        return list(self._tokenize([self._texts[position] for position in positions]))
