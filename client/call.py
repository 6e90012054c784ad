"""One call's state as it flows through the tiers: its rows, what they came back as, and its tallies.

A call's input rows are taken a chunk at a time (``prefill``); every distinct
row of a chunk is a ``Row`` until a tier serves it. A tier that serves rows
hands their last hidden states to ``Call.deliver``, which passes them straight
on to the call's ``Sink`` (pooling into the preallocated result, for
``encode``) with every copy of each row, so nothing of a served row stays
behind in the call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from attnstore.protocol.prefix import PrefixLayout
from attnstore_client.projector import Projector
from attnstore_client.settings import CallSettings

if TYPE_CHECKING:
    from attnstore_client.sinks import Sink

RowKind = Literal["exact", "prefix", "map", "miss", "fallback"]


@dataclass(frozen=True, slots=True)
class NamespaceView:
    """What a call needs of its namespace, as last read from the store."""

    projector: Projector | None = None  # None while the namespace has none: exact tiers only
    version: int = 0  # the projector's version; searches state it
    prefix: PrefixLayout | None = None  # how it stores prefix blocks; None: no prefix tier


@dataclass(frozen=True, slots=True)
class Row:
    """A distinct row of a call still to be served."""

    index: int  # its first position in the call's input
    tokens: Sequence[int]  # its token ids, special tokens included
    key: bytes  # its exact-tier key (``keys.token_hash``)
    # Token counts of its segments (instruction, chunks, question) when its prompt came in segments; () otherwise.
    segments: tuple[int, ...] = ()


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

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows right-padded with zeros, ``(B, P, hidden)``, and their mask ``(B, P)`` long."""
        padded = max(self.lengths)
        positions = torch.arange(padded, device=self.values.device)  # (P,)
        lengths = torch.tensor(self.lengths, device=self.values.device)  # (B,)
        mask = (positions[None, :] < lengths[:, None]).long()  # (B, P)
        if self.starts is None:
            return self.values[:, :padded], mask
        out = self.values.new_zeros((self.size, padded, self.values.shape[-1]))  # (B, P, hidden)
        if self.starts == _ends_to_starts(self.lengths) and self.values.shape[0] == sum(self.lengths):
            out.view(-1, out.shape[-1])[mask.view(-1).bool()] = self.values  # rows end to end: the mask's order
        else:
            for r, length in enumerate(self.lengths):
                out[r, :length] = self.row(r)
        return out, mask


def _ends_to_starts(lengths: Sequence[int]) -> tuple[int, ...]:
    """Where each row starts when rows of ``lengths`` lie end to end."""
    return tuple(int(start) for start in np.concatenate([[0], np.cumsum(lengths)[:-1]]))


@dataclass(slots=True)
class CallCounts:
    """Mutable tallies of one call, turned into a ``CacheStats`` at its end."""

    rows: int = 0
    deduplicated: int = 0  # rows answered by an identical row of the same call
    exact_hits: int = 0  # distinct rows answered by stored outputs, ``local_hits`` included
    local_hits: int = 0  # ... of which this process's own exact tier answered
    map_hits: int = 0
    prefix_hits: int = 0  # distinct rows whose forward ran on the suffix only
    prefix_tokens: int = 0  # prompt tokens those rows took from stored prefixes (not computed)
    misses: int = 0
    skipped: int = 0  # distinct rows the cost model kept from a map lookup (computed)
    fallbacks: dict[str, int] = field(default_factory=dict)
    bytes_fetched: int = 0
    projection_s: float = 0.0
    lookup_s: float = 0.0  # exact-tier calls and searches, retries included
    fetch_s: float = 0.0
    forward_s: float = 0.0
    forward_tokens: int = 0  # tokens of the rows the forwards served (prefix tier: the suffixes)
    forwarded_tokens: int = 0  # tokens the forwards ran, padding included
    tier_s: dict[str, float] = field(default_factory=dict)  # each tier's own time (its store calls and forwards)
    sink_s: float = 0.0  # handing served rows to the sink (pooling, writing the result)
    total_s: float = 0.0  # the whole call

    @property
    def overhead_s(self) -> float:
        """Time outside the tiers: tokenizing, hashing, deduplication, pooling, writing the result."""
        return max(0.0, self.total_s - sum(self.tier_s.values()))

    def fallback(self, cause: str, rows: int) -> None:
        """Count ``rows`` computed because of ``cause``."""
        if rows:
            self.fallbacks[cause] = self.fallbacks.get(cause, 0) + rows


class Call:
    """One call in flight: its settings, the namespace as it stood, its sink and its tallies.

    Args:
        settings: how the call uses the store.
        namespace: the namespace's projector and layouts.
        sink: where served rows go.
        rows: the call's number of input rows.
    """

    def __init__(self, settings: CallSettings, namespace: NamespaceView, sink: Sink, rows: int) -> None:
        self.settings = settings
        self.namespace = namespace
        self.sink = sink
        self.counts = CallCounts(rows=rows)
        self.kinds: list[str] = [""] * rows  # per input row, once served
        self.copies: dict[int, list[int]] = {}  # a row's index -> its later copies in the chunk in flight
        self.failed: set[int] = set()  # rows a tier should have served but could not: computed as fallbacks
        self.store_down: str | None = None  # why the store is not asked again in this call (a fallback cause)
        self.admitted: set[int] = set()  # rows the store asks this node to write back once computed
        self.features: dict[int, tuple[np.ndarray, int]] = {}  # row -> its projected feature and projector version

    def deliver(self, rows: Sequence[Row], hidden: HiddenRows, kind: RowKind) -> None:
        """Hand served rows (row ``r`` of ``hidden`` is ``rows[r]``) and their copies to the sink, and count them.

        A computed row that a tier failed to serve counts as a fallback, not a miss.
        """
        started = time.perf_counter()
        targets = [[row.index, *self.copies.pop(row.index, ())] for row in rows]
        self.sink.put(targets, hidden)
        counts = self.counts
        for row, indices in zip(rows, targets, strict=True):
            row_kind = "fallback" if kind == "miss" and row.index in self.failed else kind
            for index in indices:
                self.kinds[index] = row_kind
            if row_kind == "exact":
                counts.exact_hits += 1
            elif row_kind == "map":
                counts.map_hits += 1
            elif row_kind == "prefix":
                counts.prefix_hits += 1
            elif row_kind == "miss":
                counts.misses += 1
        counts.sink_s += time.perf_counter() - started

    def forwarded(self, seconds: float, tokens: int, forwarded: int) -> None:
        """Count one forward: its time, its rows' own tokens and the tokens it ran (padding included)."""
        self.counts.forward_s += seconds
        self.counts.forward_tokens += tokens
        self.counts.forwarded_tokens += forwarded

    def fail(self, rows: Sequence[Row], cause: str) -> None:
        """``rows`` could not be served by the store (``cause``): they are computed and counted as fallbacks."""
        fresh = [row for row in rows if row.index not in self.failed]
        self.counts.fallback(cause, len(fresh))
        self.failed.update(row.index for row in fresh)
