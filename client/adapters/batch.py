"""Right-padded token batches: the one input format every adapter takes.

Both families are batched with RIGHT padding. For a bidirectional encoder the
attention mask hides the pad columns. For a causal decoder right padding is exact
without any grouping by length: a real position i only attends to positions <= i,
which are all real, and its RoPE position is i as in the unpadded run. Pad
positions produce values nobody reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from attnstore.errors import ConfigError


@dataclass(frozen=True)
class Batch:
    """A right-padded batch of token ids.

    ``input_ids`` and ``attention_mask`` are ``(B, P)`` long tensors with
    ``P = max(lengths)``; row ``b`` holds ``lengths[b]`` real tokens then padding.
    ``token_type_ids`` is ``(B, P)`` long where some row is a text pair of a model with
    token types (BERT's segments), else None (every token of type 0).
    """

    input_ids: torch.Tensor  # (B, P) long
    attention_mask: torch.Tensor  # (B, P) long, 1 on real tokens
    lengths: tuple[int, ...]
    token_type_ids: torch.Tensor | None = None  # (B, P) long, 0 on pad positions

    @property
    def size(self) -> int:
        """Number of rows ``B``."""
        return len(self.lengths)

    @property
    def padded_length(self) -> int:
        """Padded length ``P``."""
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with its tensors on ``device`` (itself when they are there already)."""
        if self.input_ids.device == torch.device(device):
            return self
        types = None if self.token_type_ids is None else self.token_type_ids.to(device)
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.lengths, types)

    def row_ids(self, row: int) -> torch.Tensor:
        """Return row ``row``'s real token ids, ``(lengths[row],)``, a view."""
        return self.input_ids[row, : self.lengths[row]]


def batch_from_ids(
    rows: Sequence[Sequence[int]], pad_id: int, token_types: Sequence[Sequence[int]] | None = None
) -> Batch:
    """Right-pad token id rows into a batch.

    Args:
        rows: one token id sequence per row, each non-empty.
        pad_id: id written into pad positions.
        token_types: per row its token type ids, as long as the row, or empty (all 0); None: no row has any.

    Returns:
        The batch, rows in input order.

    Raises:
        ConfigError: no rows, or an empty row.
    """
    if not rows:
        raise ConfigError("batch_from_ids() needs at least one row, got none")
    lengths = tuple(len(row) for row in rows)
    if min(lengths) == 0:
        raise ConfigError(f"batch_from_ids(): row {lengths.index(0)} is empty; every row needs a token")
    padded = max(lengths)
    input_ids = torch.full((len(rows), padded), pad_id, dtype=torch.long)  # (B, P)
    attention_mask = torch.zeros((len(rows), padded), dtype=torch.long)  # (B, P)
    for b, row in enumerate(rows):
        input_ids[b, : lengths[b]] = torch.as_tensor(list(row), dtype=torch.long)
        attention_mask[b, : lengths[b]] = 1
    types = None
    if token_types is not None and any(token_types):
        types = torch.zeros((len(rows), padded), dtype=torch.long)  # (B, P)
        for b, row_types in enumerate(token_types):
            if row_types:
                types[b, : lengths[b]] = torch.as_tensor(list(row_types), dtype=torch.long)
    return Batch(input_ids=input_ids, attention_mask=attention_mask, lengths=lengths, token_type_ids=types)


def group_by_length(
    lengths: Sequence[int], max_rows: int, seconds: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
) -> list[slice]:
    """Split rows sorted longest first into consecutive forwards of at most ``max_rows`` rows.

    Without ``seconds`` every forward but the last has ``max_rows`` rows. With it,
    ``seconds(rows, padded)`` being the times of forwards of ``rows[k]`` rows padded to
    ``padded[k]`` tokens (arrays), the split is the one of least total time (dynamic
    programming): a run of short rows gets a forward of its own where the padding it
    would get costs more than a forward does.

    Args:
        lengths: the rows' token lengths, longest first.
        max_rows: the most rows a forward takes (``batch_size``), at least 1.
        seconds: forward times, elementwise over two integer arrays.

    Returns:
        The forwards, as slices of the rows, in order.

    Raises:
        ConfigError: ``max_rows < 1``, or lengths not sorted longest first.
    """
    if max_rows < 1:
        raise ConfigError(f"group_by_length(): max_rows must be >= 1, got {max_rows}")
    if any(a < b for a, b in zip(lengths, lengths[1:], strict=False)):
        raise ConfigError("group_by_length() needs the lengths sorted longest first")
    count = len(lengths)
    if seconds is None:
        return [slice(start, min(start + max_rows, count)) for start in range(0, count, max_rows)]
    padded = np.asarray(lengths, dtype=np.int64)
    best = np.zeros(count + 1)  # best[j]: least time of the first j rows
    cut = np.zeros(count + 1, dtype=np.int64)  # where the last forward of that split starts
    for end in range(1, count + 1):
        starts = np.arange(max(0, end - max_rows), end)
        # A forward of rows start..end-1 is padded to its first, longest row.
        totals = best[starts] + seconds(end - starts, padded[starts])
        pick = int(np.argmin(totals))
        best[end], cut[end] = totals[pick], starts[pick]
    forwards: list[slice] = []
    end = count
    while end > 0:
        forwards.append(slice(int(cut[end]), end))
        end = int(cut[end])
    return forwards[::-1]


def within_padding(
    lengths: Sequence[int], *, waste: float, max_rows: int | None = None, max_tokens: int | None = None,
) -> list[slice]:
    """Split rows, in their order, into consecutive padded batches: a batch is closed before the row that would
    pad it past ``waste`` of its real tokens, or give it more than ``max_rows`` rows or ``max_tokens`` tokens
    padded (a longer row goes alone).

    A padded batch runs every row at its longest row's length; sorted rows (either way) keep each batch's
    spread of lengths, and so its padding, small.

    Raises:
        ConfigError: ``waste < 0``, or ``max_rows`` or ``max_tokens`` below 1.
    """
    if waste < 0 or (max_rows is not None and max_rows < 1) or (max_tokens is not None and max_tokens < 1):
        raise ConfigError(f"within_padding(): waste must be >= 0 and max_rows, max_tokens >= 1; got {waste},"
                          f" {max_rows}, {max_tokens}")
    batches: list[slice] = []
    start = real = longest = 0
    for end, length in enumerate(lengths):
        rows, padded = end - start + 1, max(longest, length)
        if end > start and ((max_rows is not None and rows > max_rows)
                            or (max_tokens is not None and rows * padded > max_tokens)
                            or rows * padded > (1 + waste) * (real + length)):
            batches.append(slice(start, end))
            start, real, padded = end, 0, length
        real += length
        longest = padded
    if start < len(lengths):
        batches.append(slice(start, len(lengths)))
    return batches


def tokenize(
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    *,
    max_length: int | None = None,
) -> Batch:
    """Tokenize texts (with the tokenizer's special tokens) into a right-padded batch.

    Args:
        tokenizer: the model's tokenizer; it needs a pad token (``load_model``
            sets one on decoders that ship without).
        texts: the inputs, one row each, in order.
        max_length: truncate each row to at most this many tokens; ``None`` keeps all.

    Returns:
        The batch.

    Raises:
        ConfigError: no texts, a bare string instead of a sequence, a bad
            ``max_length``, or a tokenizer without a pad token.
    """
    if isinstance(texts, str):
        raise ConfigError("tokenize() takes a sequence of texts, got a single str; wrap it in a list")
    if max_length is not None and max_length < 1:
        raise ConfigError(f"tokenize(): max_length must be >= 1 or None, got {max_length}")
    if tokenizer.pad_token_id is None:
        raise ConfigError("tokenize(): the tokenizer has no pad token; set tokenizer.pad_token first")
    encoded = tokenizer(
        list(texts),
        truncation=max_length is not None,
        max_length=max_length,
        add_special_tokens=True,
    )["input_ids"]
    return batch_from_ids(encoded, tokenizer.pad_token_id)
