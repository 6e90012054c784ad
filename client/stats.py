"""What the cache did for a call: where each row's result came from, bytes, and where the time went."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType

from attnstore_client.resilience import FALLBACK_CAUSES


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counts and times of one call (``AttnCache.last_stats``) or of all calls (``AttnCache.stats``).

    Every row is exactly one of: an exact hit (stored outputs, no forward), a map
    hit (replayed maps), a miss (the store had nothing close enough) or a
    fallback (the store should have served it but could not: ``fallbacks`` says
    why). Misses and fallbacks are computed by the plain model.

    Times are wall seconds. ``fetch_s`` is the time spent receiving arrays; when
    maps stream into a running forward it overlaps ``forward_s``, so the parts
    may add up to more than ``total_s``.
    """

    rows: int = 0
    exact_hits: int = 0
    map_hits: int = 0
    misses: int = 0
    fallbacks: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))  # cause -> rows
    bytes_fetched: int = 0  # maps and outputs received
    projection_s: float = 0.0  # feature sources and the projector
    lookup_s: float = 0.0  # until the matches arrived (retries included)
    fetch_s: float = 0.0  # receiving maps and outputs
    forward_s: float = 0.0  # the model's forward passes (reruns after a failed stream included)
    total_s: float = 0.0  # the whole call

    @property
    def fallback_rows(self) -> int:
        """Rows computed because the store could not serve them."""
        return sum(self.fallbacks.values())

    @property
    def hit_rate(self) -> float:
        """Share of rows served from the store (exact and map hits); 0 for no rows."""
        return (self.exact_hits + self.map_hits) / self.rows if self.rows else 0.0

    def __add__(self, other: CacheStats) -> CacheStats:
        """Both calls' counts and times together."""
        merged = {
            f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self) if f.name != "fallbacks"
        }
        causes = {cause: self.fallbacks.get(cause, 0) + other.fallbacks.get(cause, 0) for cause in FALLBACK_CAUSES}
        return CacheStats(**merged, fallbacks=MappingProxyType({c: n for c, n in causes.items() if n}))

    def summary(self) -> str:
        """One human line, for the CLI."""
        fallbacks = ", ".join(f"{cause} {n}" for cause, n in sorted(self.fallbacks.items())) or "none"
        return (
            f"{self.rows} rows: {self.exact_hits} exact hits, {self.map_hits} map hits, {self.misses} misses, "
            f"fallbacks: {fallbacks}; hit rate {self.hit_rate:.1%}; {self.bytes_fetched / 2**20:.1f} MiB fetched; "
            f"time {self.total_s:.2f} s (projection {self.projection_s:.2f}, lookup {self.lookup_s:.2f}, "
            f"fetch {self.fetch_s:.2f}, forward {self.forward_s:.2f})"
        )

    def to_json_dict(self) -> dict[str, object]:
        """A JSON-ready dict of every field and the derived rates."""
        data: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        data["fallbacks"] = dict(self.fallbacks)
        data["hit_rate"] = self.hit_rate
        return data
