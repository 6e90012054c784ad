"""What the cache did for a call: where each row's result came from, bytes, and where the time went."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType

from attnstore_client.call.rows import RowKind
from attnstore_client.call.state import CallCounts
from attnstore_client.resilience import FALLBACK_CAUSES
from attnstore_client.tiers.cost_model import BandEstimate

# The fields a call's tallies (``CallCounts``) carry as they are.
_FROM_COUNTS = frozenset({
    "rows", "deduplicated", "exact_hits", "local_hits", "map_hits", "prefix_hits", "prefix_tokens", "chunk_hits",
    "chunk_tokens", "chunk_recomputed", "chunks_captured", "misses", "int8_rows", "audited", "audit_mismatches",
    "skipped", "bytes_fetched", "projection_s", "lookup_s", "fetch_s", "forward_s", "forward_tokens",
    "forwarded_tokens",
})


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counts and times of one call (``AttnCache.last_stats``) or of all calls (``AttnCache.stats``).

    Every distinct row of a call (rows with identical tokens are one row, computed
    once: ``deduplicated`` counts the copies) is exactly one of: an exact hit
    (stored outputs, no forward; ``local_hits`` of them from this process's own
    exact tier), a map hit (replayed maps), a miss (the store had nothing close
    enough, or the cost model did not ask it: ``skipped``) or a fallback (the store
    should have served it but could not: ``fallbacks`` says why). Misses and
    fallbacks are computed by the plain model (with ``int8`` on, ``int8_rows`` of
    them by its int8 plan's model: approximate). ``estimates`` is the cost model's
    view after the call, per length band.

    Times are wall seconds. ``fetch_s`` is the time spent receiving arrays; when
    maps stream into a running forward it overlaps ``forward_s``, so the parts
    may add up to more than ``total_s``.
    """

    rows: int = 0  # input rows, copies included
    deduplicated: int = 0  # rows answered by an identical row of the same call
    exact_hits: int = 0  # distinct rows answered by stored outputs, ``local_hits`` included
    local_hits: int = 0  # ... of which this process's node-local exact tier answered
    map_hits: int = 0
    prefix_hits: int = 0  # distinct rows whose forward ran on the suffix only, the prefix's keys and values stored
    prefix_tokens: int = 0  # prompt tokens those rows took from stored prefixes instead of computing them
    chunk_hits: int = 0  # distinct rows fused from stored chunks (prompts in segments, decoders; approximate)
    chunk_tokens: int = 0  # prompt tokens those rows took from stored chunks and instructions
    chunk_recomputed: int = 0  # ... of which chunk tokens computed again from the selection layer on
    chunks_captured: int = 0  # instructions and chunks the chunk source lacked, computed on their own and stored
    misses: int = 0
    int8_rows: int = 0  # computed rows (misses, fallbacks) the namespace's int8 model ran (``int8=True``)
    # The store's exact hits computed again to audit them (``audit_rate``): counted as misses, their forward served.
    audited: int = 0
    audit_mismatches: int = 0  # ... of which the store's outputs were wrong (quarantined: see ``audit_findings``)
    skipped: int = 0  # misses the cost model did not send for maps (a lookup would not have paid)
    fallbacks: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))  # cause -> rows
    bytes_fetched: int = 0  # maps and outputs received
    projection_s: float = 0.0  # feature sources and the projector
    lookup_s: float = 0.0  # until the matches arrived (retries included)
    fetch_s: float = 0.0  # receiving maps and outputs
    # The model's forward passes (reruns after a failed stream included); forwards run side by side count
    # their share of the wall time (each its seconds over how many ran at once).
    forward_s: float = 0.0
    forward_tokens: int = 0  # tokens of the rows the forwards served (for prefix hits: their suffixes)
    forwarded_tokens: int = 0  # tokens the forwards ran, padding included (packed forwards: none)
    # Time outside the tiers: tokenizing, hashing, deduplication, pooling, writing the result.
    overhead_s: float = 0.0
    total_s: float = 0.0  # the whole call
    tier_s: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))  # each tier's own time
    estimates: tuple[BandEstimate, ...] = ()  # the cost model after the (latest) call

    @classmethod
    def of_call(cls, counts: CallCounts, total_s: float, estimates: tuple[BandEstimate, ...]) -> CacheStats:
        """The stats of a call from its tallies; its time outside the tiers is what the tiers did not take."""
        taken = {f.name: getattr(counts, f.name) for f in fields(cls) if f.name in _FROM_COUNTS}
        return cls(
            **taken, fallbacks=MappingProxyType(dict(counts.fallbacks)), tier_s=MappingProxyType(dict(counts.tier_s)),
            overhead_s=max(0.0, total_s - sum(counts.tier_s.values())), total_s=total_s, estimates=estimates,
        )

    @property
    def fallback_rows(self) -> int:
        """Rows computed because the store could not serve them."""
        return sum(self.fallbacks.values())

    def rows_by_kind(self) -> dict[RowKind, int]:
        """Distinct rows by how they were served (every ``RowKind``; copies of a row are ``deduplicated``)."""
        return {"exact": self.exact_hits, "prefix": self.prefix_hits, "chunk": self.chunk_hits, "map": self.map_hits,
                "miss": self.misses, "fallback": self.fallback_rows}

    @property
    def hit_rate(self) -> float:
        """Share of distinct rows served without their full forward (exact and map hits); 0 for no rows."""
        distinct = self.rows - self.deduplicated
        return (self.exact_hits + self.map_hits) / distinct if distinct else 0.0

    def __add__(self, other: CacheStats) -> CacheStats:
        """Both calls' counts and times together."""
        merged = {
            f.name: getattr(self, f.name) + getattr(other, f.name)
            for f in fields(self)
            if f.name not in ("fallbacks", "estimates", "tier_s")
        }
        causes = {cause: self.fallbacks.get(cause, 0) + other.fallbacks.get(cause, 0) for cause in FALLBACK_CAUSES}
        names = {*self.tier_s, *other.tier_s}
        tiers = {tier: self.tier_s.get(tier, 0.0) + other.tier_s.get(tier, 0.0) for tier in names}
        return CacheStats(
            **merged,
            fallbacks=MappingProxyType({c: n for c, n in causes.items() if n}),
            estimates=other.estimates or self.estimates,
            tier_s=MappingProxyType(tiers),
        )

    def summary(self) -> str:
        """One human line, for the CLI."""
        fallbacks = ", ".join(f"{cause} {n}" for cause, n in sorted(self.fallbacks.items())) or "none"
        return (
            f"{self.rows} rows ({self.deduplicated} repeats): {self.exact_hits} exact hits ({self.local_hits} local), "
            f"{self.prefix_hits} prefix hits ({self.prefix_tokens} tokens), "
            f"{self.chunk_hits} chunk hits ({self.chunk_tokens} tokens stored, {self.chunk_recomputed} recomputed), "
            f"{self.map_hits} map hits, {self.misses} misses ({self.skipped} not looked up, {self.int8_rows} in int8, "
            f"{self.audited} audited: {self.audit_mismatches} wrong), "
            f"fallbacks: {fallbacks}; hit rate {self.hit_rate:.1%}; {self.bytes_fetched / 2**20:.1f} MiB fetched; "
            f"time {self.total_s:.2f} s (projection {self.projection_s:.2f}, lookup {self.lookup_s:.2f}, "
            f"fetch {self.fetch_s:.2f}, forward {self.forward_s:.2f}, outside the tiers {self.overhead_s:.2f})"
        )

    def to_json_dict(self) -> dict[str, object]:
        """A JSON-ready dict of every field and the derived rates."""
        data: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        data["fallbacks"] = dict(self.fallbacks)
        data["tier_s"] = dict(self.tier_s)
        data["estimates"] = [dataclasses.asdict(estimate) for estimate in self.estimates]
        data["hit_rate"] = self.hit_rate
        return data
