"""The rows of a call: a distinct row until a tier serves it (``Row``) with what the tiers learn of it on the way
(``RowFacts``), what a forward hands back for rows (``HiddenRows``), and what a call needs of its namespace
(``NamespaceView``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np
import torch

from attnstore.protocol.prefix import PrefixLayout
from attnstore_client.projector import Projector

# How a call served a distinct row (``Call.deliver``, ``AttnCache.last_row_kinds``): the one spelling of a row's
# kind for the client's tallies (``CallCounts``), its stats (``CacheStats.rows_by_kind``) and the node's metrics
# (``attnstore_node.metrics`` maps each to the ``tier`` label value it publishes). "miss": computed, the store had
# nothing to serve it; "fallback": computed, the store should have served it but could not.
RowKind = Literal["exact", "prefix", "chunk", "map", "miss", "fallback"]
ROW_KINDS: tuple[RowKind, ...] = get_args(RowKind)


@dataclass(frozen=True, slots=True)
class NamespaceView:
    """What a call needs of its namespace, as last read from the store."""

    projector: Projector | None = None  # None while the namespace has none: exact tiers only
    version: int = 0  # the projector's version; searches state it
    prefix: PrefixLayout | None = None  # how it stores prefix blocks; None: no prefix tier


@dataclass(slots=True)
class RowFacts:
    """What a tier learns of a row in flight that a later tier of the same call reads (one per ``Row``)."""

    admitted: bool = False  # the store asks this node to write the row back once computed (``store_exact``)
    failed: str | None = None  # why a tier that should have served it could not (a fallback cause): it is computed
    feature: np.ndarray | None = None  # (d,) its projected feature (``maps``): a written-back row carries it
    projector_version: int = 0  # the version of the projector ``feature`` came from
    # (L, hidden) fp16: the outputs the store served for it, set aside for its audit (``audit``): the row goes straight
    # to the compute tier, and its forward is compared with them.
    audit: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class Row:
    """A distinct row of a call still to be served."""

    index: int  # its first position in the call's input
    tokens: Sequence[int]  # its token ids, special tokens included
    key: bytes  # its exact-tier key (``keys.token_hash``)
    # Token counts of its segments (instruction, chunks, question) when its prompt came in segments; () otherwise.
    segments: tuple[int, ...] = ()
    # Its token types when it is a text pair of a model with token types (``sources.Tokenized``); () : all 0. Such
    # a row is keyed by them too, and served by this process's exact tier and the compute tier only: a written-back
    # row carries its ids alone, and the store's features and maps know no token types.
    token_types: tuple[int, ...] = ()
    facts: RowFacts = field(default_factory=RowFacts, compare=False, repr=False)  # set by the tiers as it goes


class HiddenRows:
    """Last hidden states of some rows, fp32: ``(T, hidden)`` end to end, or ``(B, P, hidden)`` right-padded.

    Args:
        values: the states.
        lengths: each row's length.
        starts: each row's first token in ``values`` when it is ``(T, hidden)``; None when padded.
    """

    def __init__(self, values: torch.Tensor, lengths: Sequence[int], starts: Sequence[int] | None = None) -> None:
        self.values = values
        self.lengths = tuple(lengths)
        self.starts = None if starts is None else tuple(starts)

    @classmethod
    def stacked(cls, rows: Sequence[torch.Tensor]) -> HiddenRows:
        """Rows given one by one, ``(L, hidden)`` each, as one ``(T, hidden)`` tensor."""
        lengths = [int(row.shape[0]) for row in rows]
        return cls(torch.cat(list(rows)), lengths, _ends_to_starts(lengths))

    @property
    def size(self) -> int:
        """Number of rows."""
        return len(self.lengths)

    def row(self, r: int) -> torch.Tensor:
        """Row ``r``'s states ``(L, hidden)``, a view."""
        if self.starts is None:
            return self.values[r, : self.lengths[r]]
        return self.values[self.starts[r] : self.starts[r] + self.lengths[r]]

    @property
    def end_to_end(self) -> bool:
        """Whether ``values`` is ``(T, hidden)`` with the rows in order and nothing between them (a packed
        forward's output): then ``offsets`` bounds them."""
        return (self.starts is not None and self.values.shape[0] == sum(self.lengths)
                and self.starts == _ends_to_starts(self.lengths))

    def offsets(self) -> torch.Tensor:
        """Where each row starts and, last, where the rows end: ``(B + 1,)`` int32.

        Raises:
            ValueError: the rows are padded or have gaps between them (not ``end_to_end``).
        """
        if self.starts is None or not self.end_to_end:
            raise ValueError(f"HiddenRows.offsets: rows of lengths {self.lengths} in values of shape "
                             f"{tuple(self.values.shape)} are not end to end (padded, or with gaps between them)")
        return torch.tensor((*self.starts, self.values.shape[0]), dtype=torch.int32, device=self.values.device)

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows right-padded with zeros, ``(B, P, hidden)``, and their mask ``(B, P)`` long."""
        padded = max(self.lengths)
        positions = torch.arange(padded, device=self.values.device)  # (P,)
        lengths = torch.tensor(self.lengths, device=self.values.device)  # (B,)
        mask = (positions[None, :] < lengths[:, None]).long()  # (B, P)
        if self.starts is None:
            return self.values[:, :padded], mask
        out = self.values.new_zeros((self.size, padded, self.values.shape[-1]))  # (B, P, hidden)
        if self.end_to_end:
            out.view(-1, out.shape[-1])[mask.view(-1).bool()] = self.values  # rows end to end: the mask's order
        else:
            for r, length in enumerate(self.lengths):
                out[r, :length] = self.row(r)
        return out, mask


def last_positions(mask: torch.Tensor) -> torch.Tensor:
    """Each row's last real position ``(B,)`` in a padded batch's mask ``(B, P)``, read from the mask itself: a
    batch may be padded on either side (a tokenizer's ``padding_side``), so a row's length is not its last index."""
    width = mask.shape[1]
    return width - 1 - mask.flip(1).to(torch.int32).argmax(dim=1)  # first real position from the right


def _ends_to_starts(lengths: Sequence[int]) -> tuple[int, ...]:
    """Where each row starts when rows of ``lengths`` lie end to end."""
    return tuple(int(start) for start in np.concatenate([[0], np.cumsum(lengths)[:-1]]))
