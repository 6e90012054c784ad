"""When to ask the store for maps: a running estimate, per length band, of what a map lookup earns.

A map hit saves part of a row's forward (attention's q/k work: ~20-35% of a
forward for the models here; MLPs are the rest), and only the rows that hit
save anything, while every row asked for maps pays its projection and search.
So per band of token lengths (1-8, 9-16, 17-32, ... tokens) this keeps:

- ``hit_rate``: the share of rows asked that came back map hits;
- ``saving``: forward seconds per row of a computed batch less those of a
  replaying batch (its maps' fetch included) — until a replaying batch of the
  band has run, ``PRIOR_SAVING`` of the computed row's time;
- ``cost``: projection and search seconds per row asked.

A row is sent for maps when ``hit_rate * saving > cost``. The first
``min_samples`` rows of a band are always sent (there is nothing to estimate
from yet), and afterwards a share ``explore`` of the rows the rule would not
send is sent anyway, so a band whose traffic changes is noticed. Rates and times
are exponentially weighted (``decay`` per recorded batch) so they follow the
traffic. The same model serves a daemon and an embedded store: it only sees times.
"""

from __future__ import annotations

import math
import random
import threading
from dataclasses import dataclass, field

from attnstore.errors import ConfigError

# A map hit's saving before any replaying batch of the band was timed: attention's
# q/k share of a forward measured on the packaged models (docs/BENCHMARKS.md "Replay").
PRIOR_SAVING = 0.2
_FIRST_BAND_HIGH = 8  # the first band is 1-8 tokens; each next one doubles


@dataclass(frozen=True, slots=True)
class CostSettings:
    """How the cost model decides (see the module docstring)."""

    min_samples: int = 32  # rows of a band always sent before the rule applies
    explore: float = 0.02  # share of the rows the rule skips that are sent anyway
    decay: float = 0.98  # weight kept by past batches at each new one
    seed: int = 0  # of the exploration draws

    def __post_init__(self) -> None:
        if self.min_samples < 0 or not 0.0 <= self.explore <= 1.0 or not 0.0 < self.decay <= 1.0:
            raise ConfigError(
                "CostSettings needs min_samples >= 0, explore in [0, 1] and decay in (0, 1]; got "
                f"{self.min_samples}, {self.explore}, {self.decay}"
            )


@dataclass(frozen=True, slots=True)
class BandEstimate:
    """What the cost model knows of one band of token lengths."""

    low: int  # shortest length of the band
    high: int  # longest
    asked: int  # rows sent for maps (all time)
    skipped: int  # rows the rule kept from a lookup (all time)
    hit_rate: float | None  # None: nothing asked yet
    saving_ms: float | None  # forward time a map hit saves, per row
    cost_ms: float | None  # projection and search time per row asked
    # Whether the rule sends this band's rows now (past the first min_samples); None while a figure is
    # missing (no computed or no asked row yet): then every row is sent.
    worth: bool | None


@dataclass
class _Band:
    asked_total: int = 0
    skipped_total: int = 0
    # Exponentially weighted sums.
    asked: float = 0.0
    hits: float = 0.0
    lookup_s: float = 0.0
    miss_rows: float = 0.0
    miss_s: float = 0.0
    hit_rows: float = 0.0
    hit_s: float = 0.0

    def worth(self) -> bool | None:
        """Whether a lookup earns more than it costs; None while a figure is missing."""
        if self.asked <= 0 or self.miss_rows <= 0:
            return None
        miss_row = self.miss_s / self.miss_rows
        saving = miss_row - self.hit_s / self.hit_rows if self.hit_rows > 0 else PRIOR_SAVING * miss_row
        return (self.hits / self.asked) * saving > self.lookup_s / self.asked


@dataclass
class CostModel:
    """Per length band estimates and the decision they give; thread-safe.

    Args:
        settings: warm-up, exploration and decay.
    """

    settings: CostSettings = field(default_factory=CostSettings)

    def __post_init__(self) -> None:
        self._bands: dict[int, _Band] = {}
        self._rng = random.Random(self.settings.seed)
        self._lock = threading.Lock()

    @staticmethod
    def band_of(length: int) -> int:
        """The band index of a token length: 0 for 1-8 tokens, then one per doubling."""
        return max(0, math.ceil(math.log2(max(length, 1) / _FIRST_BAND_HIGH)))

    def should_ask(self, length: int) -> bool:
        """Whether a row of ``length`` tokens should be sent for maps (counted as asked or skipped)."""
        with self._lock:
            band = self._bands.setdefault(self.band_of(length), _Band())
            worth = band.worth()
            ask = (
                band.asked_total < self.settings.min_samples
                or worth is None
                or worth
                or self._rng.random() < self.settings.explore
            )
            if not ask:
                band.skipped_total += 1
            return ask

    def record_lookup(self, length: int, rows: int, hits: int, seconds: float) -> None:
        """``rows`` of this band were projected and searched in ``seconds``; ``hits`` came back map hits."""
        with self._lock:
            band = self._decayed(length)
            band.asked_total += rows
            band.asked += rows
            band.hits += hits
            band.lookup_s += seconds

    def record_forward(self, length: int, rows: int, seconds: float, *, replayed: bool) -> None:
        """A batch of ``rows`` of this band took ``seconds`` (maps fetched and replayed, or computed)."""
        with self._lock:
            band = self._decayed(length)
            if replayed:
                band.hit_rows += rows
                band.hit_s += seconds
            else:
                band.miss_rows += rows
                band.miss_s += seconds

    def estimates(self) -> tuple[BandEstimate, ...]:
        """Every band seen so far, shortest first."""
        with self._lock:
            return tuple(self._estimate(index, band) for index, band in sorted(self._bands.items()))

    def _decayed(self, length: int) -> _Band:
        band = self._bands.setdefault(self.band_of(length), _Band())
        decay = self.settings.decay
        for name in ("asked", "hits", "lookup_s", "miss_rows", "miss_s", "hit_rows", "hit_s"):
            setattr(band, name, getattr(band, name) * decay)
        return band

    @staticmethod
    def _estimate(index: int, band: _Band) -> BandEstimate:
        high = _FIRST_BAND_HIGH << index
        low = 1 if index == 0 else high // 2 + 1
        miss_row = band.miss_s / band.miss_rows if band.miss_rows > 0 else None
        saving = None
        if miss_row is not None:
            saving = miss_row - band.hit_s / band.hit_rows if band.hit_rows > 0 else PRIOR_SAVING * miss_row
        return BandEstimate(
            low=low,
            high=high,
            asked=band.asked_total,
            skipped=band.skipped_total,
            hit_rate=band.hits / band.asked if band.asked > 0 else None,
            saving_ms=None if saving is None else 1000.0 * saving,
            cost_ms=1000.0 * band.lookup_s / band.asked if band.asked > 0 else None,
            worth=band.worth(),
        )
