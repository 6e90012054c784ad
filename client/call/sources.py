"""A call's input rows, taken a window at a time in the order the tiers want them: longest first.

sentence-transformers sorts a call's texts by length before batching them and
returns results in input order; a call here does the same, and tokenizes one
window at a time, so a call of any size never holds every row's tokens at once.
A text that repeats an earlier one of the call is not tokenized again (bulk
calls over logs or records repeat many): it comes as a repeat of that row.

A prompt may come in segments (instruction, chunk, ..., question): each segment
is tokenized on its own and the ids concatenated, so a segment's tokens are the
same wherever it appears (what the chunk tier of causal models needs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from transformers import PreTrainedTokenizerBase

from attnstore.errors import ConfigError

# One input of a call: a text, or a prompt in segments (instruction, chunks, question).
Prompt = str | Sequence[str]


@dataclass(frozen=True, slots=True)
class Tokenized:
    """A row's token ids, its segments' token counts when its prompt came in segments, and its token types when it
    is a text pair of a model with token types (BERT's segment ids, 1 on the second text's tokens)."""

    ids: Sequence[int]
    segments: tuple[int, ...] = ()
    token_types: tuple[int, ...] = ()  # as long as ``ids``, or empty: every token of type 0


@dataclass(frozen=True)
class Window:
    """Some rows of a call: each new one with its tokens, and the repeats of rows already taken."""

    rows: list[tuple[int, Tokenized]]  # (input position, its tokens)
    repeats: list[tuple[int, int]] = field(default_factory=list)  # (input position, the earlier position it repeats)

    def __len__(self) -> int:
        return len(self.rows) + len(self.repeats)


class RowSource(ABC):
    """The rows of one call: how many, and their token ids a window at a time, longest first."""

    @abstractmethod
    def __len__(self) -> int:
        """Rows in the call."""

    @abstractmethod
    def order(self) -> np.ndarray:
        """Input positions in the order the call takes them (longest first; ties in input order)."""

    @abstractmethod
    def tokens(self, positions: Sequence[int]) -> list[Tokenized]:
        """The tokens of the rows at ``positions``."""

    def windows(self, size: int) -> Iterator[Window]:
        """At most ``size`` rows at a time, in ``order()``."""
        order = self.order()
        for start in range(0, len(order), size):
            positions = order[start : start + size].tolist()
            yield Window(list(zip(positions, self.tokens(positions), strict=True)))


class TokenRows(RowSource):
    """Rows the caller tokenized."""

    def __init__(self, rows: Sequence[Sequence[int]]) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def order(self) -> np.ndarray:
        """See :meth:`RowSource.order`: by token length."""
        return np.argsort([-len(row) for row in self._rows], kind="stable")

    def tokens(self, positions: Sequence[int]) -> list[Tokenized]:
        """See :meth:`RowSource.tokens`."""
        return [Tokenized(self._rows[position]) for position in positions]


class TextRows(RowSource):
    """Texts (or prompts in segments), tokenized a window at a time: texts by ``tokenize``, segmented prompts by
    ``tokenize_segments``."""

    def __init__(
        self, texts: Sequence[Prompt], tokenize: Callable[[list[str]], list[list[int]]],
        tokenize_segments: Callable[[list[Sequence[str]]], list[Tokenized]] | None = None,
    ) -> None:
        self._texts = texts
        self._tokenize = tokenize
        self._tokenize_segments = tokenize_segments

    def __len__(self) -> int:
        return len(self._texts)

    def order(self) -> np.ndarray:
        """See :meth:`RowSource.order`: by text length, as sentence-transformers sorts (before tokenizing)."""
        return np.argsort([-_length(text) for text in self._texts], kind="stable")

    def tokens(self, positions: Sequence[int]) -> list[Tokenized]:
        """See :meth:`RowSource.tokens`.

        Raises:
            ConfigError: a prompt in segments for a head that takes none.
        """
        texts = [self._texts[position] for position in positions]
        plain = [k for k, text in enumerate(texts) if isinstance(text, str)]
        out: list[Tokenized | None] = [None] * len(texts)
        if plain:
            for k, ids in zip(plain, self._tokenize([str(texts[k]) for k in plain]), strict=True):
                out[k] = Tokenized(ids)
        segmented = [k for k, text in enumerate(texts) if not isinstance(text, str)]
        if segmented:
            if self._tokenize_segments is None:
                raise ConfigError("this call takes texts only, not prompts in segments (lists of strings)")
            for k, tokens in zip(segmented, self._tokenize_segments([texts[k] for k in segmented]), strict=True):
                out[k] = tokens
        return [tokens for tokens in out if tokens is not None]

    def windows(self, size: int) -> Iterator[Window]:
        """See :meth:`RowSource.windows`: a text seen before in the call is a repeat, not tokenized again."""
        first: dict[str | tuple[str, ...], int] = {}  # text -> its first position (the call's, not copies)
        order = self.order()
        for start in range(0, len(order), size):
            new: list[int] = []
            repeats: list[tuple[int, int]] = []
            for position in order[start : start + size].tolist():
                text = self._texts[position]
                earlier = first.setdefault(text if isinstance(text, str) else tuple(text), position)
                if earlier == position:
                    new.append(position)
                else:
                    repeats.append((position, earlier))
            yield Window(list(zip(new, self.tokens(new), strict=True)), repeats)


def _length(prompt: Prompt) -> int:
    return len(prompt) if isinstance(prompt, str) else sum(len(segment) for segment in prompt)


def segment_tokens(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Sequence[str]], *, max_length: int,
                   ) -> list[Tokenized]:
    """Prompts in segments as token rows: each segment tokenized on its own (no special tokens), the ids
    concatenated, then the tokenizer's special tokens around the whole (counted in the first and last segments).

    Raises:
        ConfigError: a prompt with no segments, or one longer than ``max_length`` tokens (a prompt in
            segments is never truncated: the part cut would be its question).
    """
    lead, trail = _special_tokens(tokenizer)
    out = []
    for number, prompt in enumerate(prompts):
        if isinstance(prompt, str) or not len(prompt):
            raise ConfigError(f"prompt {number} in segments must be a non-empty list of strings, got {prompt!r}")
        pieces = [tokenizer(segment, add_special_tokens=False)["input_ids"] for segment in prompt]
        ids = lead + [token for piece in pieces for token in piece] + trail
        if len(ids) > max_length:
            raise ConfigError(f"prompt {number} in segments is {len(ids)} tokens, over the model's {max_length}")
        lengths = [len(piece) for piece in pieces]
        lengths[0] += len(lead)
        lengths[-1] += len(trail)
        out.append(Tokenized(ids, tuple(lengths)))
    return out


def _special_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a text (``[CLS]``/``[SEP]``, a BOS...)."""
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    lead = next(k for k in range(len(full) - len(bare) + 1) if full[k : k + len(bare)] == bare)
    return full[:lead], full[lead + len(bare) :]
