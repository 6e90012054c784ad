"""A call's input rows, taken a chunk at a time in the order the tiers want them: longest first.

sentence-transformers sorts a call's texts by length before batching them and
returns results in input order; a call here does the same, and tokenizes one
chunk at a time, so a call of any size never holds every row's tokens at once.
A text that repeats an earlier one of the call is not tokenized again (bulk
calls over logs or records repeat many): it comes as a repeat of that row.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Chunk:
    """Some rows of a call: each new one with its token ids, and the repeats of rows already taken."""

    rows: list[tuple[int, Sequence[int]]]  # (input position, token ids)
    repeats: list[tuple[int, int]] = field(default_factory=list)  # (input position, the earlier position it repeats)

    def __len__(self) -> int:
        return len(self.rows) + len(self.repeats)


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

    def chunks(self, size: int) -> Iterator[Chunk]:
        """At most ``size`` rows at a time, in ``order()``."""
        order = self.order()
        for start in range(0, len(order), size):
            positions = order[start : start + size].tolist()
            yield Chunk(list(zip(positions, self.tokens(positions), strict=True)))


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

    def chunks(self, size: int) -> Iterator[Chunk]:
        """See :meth:`RowSource.chunks`: a text seen before in the call is a repeat, not tokenized again."""
        first: dict[str, int] = {}  # text -> its first position (the call's texts, not copies of them)
        order = self.order()
        for start in range(0, len(order), size):
            new: list[int] = []
            repeats: list[tuple[int, int]] = []
            for position in order[start : start + size].tolist():
                earlier = first.setdefault(self._texts[position], position)
                if earlier == position:
                    new.append(position)
                else:
                    repeats.append((position, earlier))
            yield Chunk(list(zip(new, self.tokens(new), strict=True)), repeats)
