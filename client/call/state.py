"""One call's state as it flows through the tiers: its rows, what they came back as, and its tallies.

A call's input rows are taken a window at a time (``prefill``); every distinct
row of a window is a ``Row`` until a tier serves it. What a tier learns of a row
for the tiers after it (admitted for write-back, failed, its feature) is kept
on the row (``RowFacts``); ``Call`` holds what is the whole call's. A tier that
serves rows hands their last hidden states to ``Call.deliver``, which passes
them straight on to the call's ``Sink`` (pooling into the preallocated result,
for ``encode``) with every copy of each row, so nothing of a served row stays
behind in the call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from attnstore_client.call.rows import HiddenRows, NamespaceView, Row, RowKind
from attnstore_client.call.settings import CallSettings

if TYPE_CHECKING:
    from attnstore_client.call.sinks import Sink

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
    chunk_hits: int = 0  # distinct rows fused from stored chunks (``tiers.chunks``)
    chunk_tokens: int = 0  # prompt tokens those rows took from stored chunks and instructions
    chunk_recomputed: int = 0  # ... of which chunk tokens computed again from the selection layer on
    chunks_captured: int = 0  # instructions and chunks the source lacked, computed on their own and put in it
    misses: int = 0
    int8_rows: int = 0  # computed rows (misses, fallbacks) the int8 model ran (``int8``)
    audited: int = 0  # the store's exact hits computed again to audit them (counted as misses; ``audit``)
    audit_mismatches: int = 0  # ... of which the stored outputs differed from the forward's (reported)
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
        self.kinds: list[RowKind | Literal[""]] = [""] * rows  # per input row, once served
        self.copies: dict[int, list[int]] = {}  # a row's index -> its later copies in the window in flight
        self.store_down: str | None = None  # why the store is not asked again in this call (a fallback cause)

    def deliver(self, rows: Sequence[Row], hidden: HiddenRows, kind: RowKind) -> None:
        """Hand served rows (row ``r`` of ``hidden`` is ``rows[r]``) and their copies to the sink, and count them.

        A computed row that a tier failed to serve counts as a fallback, not a miss.
        """
        started = time.perf_counter()
        targets = [[row.index, *self.copies.pop(row.index, ())] for row in rows]
        self.sink.put(targets, hidden)
        counts = self.counts
        for row, indices in zip(rows, targets, strict=True):
            row_kind: RowKind = "fallback" if kind == "miss" and row.facts.failed is not None else kind
            for index in indices:
                self.kinds[index] = row_kind
            if row_kind == "exact":
                counts.exact_hits += 1
            elif row_kind == "map":
                counts.map_hits += 1
            elif row_kind == "prefix":
                counts.prefix_hits += 1
            elif row_kind == "chunk":
                counts.chunk_hits += 1
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
        fresh = [row for row in rows if row.facts.failed is None]
        self.counts.fallback(cause, len(fresh))
        for row in fresh:
            row.facts.failed = cause
