"""When to ask the store for maps: a running estimate, per length band, of what a map lookup earns.

A map hit saves part of its row's forward (the q/k work and softmax of every
layer: 10-35% for the models here, more for longer rows; the MLPs are the rest),
and only the rows that hit save anything, while every row asked for maps pays its
projection and search. Hits replay inside the same length-sorted batches as the
rows computed (``attnstore_client.prefill``), so a forward's time is about
``c * computed + r * replayed`` in padded tokens. Per band of token lengths
(1-8, 9-16, 17-32, ... tokens) this keeps:

- ``hit_rate``: the share of rows asked that came back map hits;
- ``c`` and ``r``: seconds per padded token of a computed and of a replayed row,
  fitted by least squares over the band's forwards (their maps' fetch included),
  starting from the prior that a replayed token costs ``1 - PRIOR_SAVING`` of a
  computed one; a hit of ``L`` tokens saves ``(c - r) * L``;
- ``cost``: projection and search seconds per row asked.

A row is sent for maps when ``hit_rate * saving > cost``. A computed row's maps
are worth writing back (``replay_pays``) when one hit would save more than its
lookup costs, ``saving > cost``, whatever the hit rate: stored maps are what
raise a band's hit rate, so that rule cannot wait for hits. The first
``min_samples`` rows of a band are always sent (there is nothing to estimate
from yet); past them, while a figure is still missing (the band's first forward
has not ended), a row is sent only as exploration, and afterwards the rule
decides, with a share ``explore`` of the rows it would not send sent anyway, so
a band whose traffic changes is noticed. Sums are
exponentially weighted (``decay`` per recorded batch) so they follow the
traffic. The same model serves a daemon and an embedded store: it only sees times.

The same forwards also fit what a forward costs whatever its rows' kind,
``seconds ~ a + b * tokens + c * pairs`` (``a`` the fixed cost of a forward,
``b`` of a token's projections and MLP, ``c`` of one query-key pair of its
attention: ``rows * padded**2`` pairs padded, the sum of ``L**2`` packed),
non-negative, over every band (``forward_cost``). That is what decides, for
padded forwards, where rows of very different lengths are worth a forward of
their own instead of padding to the longest (``attnstore_client.adapters.batch.group_by_length``).
"""

from __future__ import annotations

import itertools
import math
import random
import threading
from dataclasses import dataclass, field

import numpy as np

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
    # Forwards timed before their fit groups rows by length (until then a batch is batch_size rows).
    min_forwards: int = 16

    def __post_init__(self) -> None:
        if (self.min_samples < 0 or not 0.0 <= self.explore <= 1.0 or not 0.0 < self.decay <= 1.0
                or self.min_forwards < 1):
            raise ConfigError(
                "CostSettings needs min_samples >= 0, explore in [0, 1], decay in (0, 1] and min_forwards >= 1; "
                f"got {self.min_samples}, {self.explore}, {self.decay}, {self.min_forwards}"
            )


@dataclass(frozen=True, slots=True)
class BandEstimate:
    """What the cost model knows of one band of token lengths."""

    low: int  # shortest length of the band
    high: int  # longest
    asked: int  # rows sent for maps (all time)
    skipped: int  # rows the rule kept from a lookup (all time)
    hit_rate: float | None  # None: nothing asked yet
    saving_ms: float | None  # forward time a map hit of the band's longest length saves
    cost_ms: float | None  # projection and search time per row asked
    # Whether the rule sends rows of the band's longest length now (past the first min_samples); None
    # while a figure is missing (no forward or no asked row yet): then rows are sent only as exploration.
    worth: bool | None


_SUMS = ("asked", "hits", "lookup_s", "forwards", "tokens", "replayed", "seconds", "cc", "cr", "rr", "ct", "rt")


@dataclass
class _Band:
    asked_total: int = 0
    skipped_total: int = 0
    sent_total: int = 0  # rows should_ask sent (their lookups are recorded after the search)
    # Exponentially weighted sums: of lookups, and the normal equations of
    # seconds ~ c * computed tokens + r * replayed tokens over forwards.
    asked: float = 0.0
    hits: float = 0.0
    lookup_s: float = 0.0
    forwards: float = 0.0
    tokens: float = 0.0
    replayed: float = 0.0
    seconds: float = 0.0
    cc: float = 0.0
    cr: float = 0.0
    rr: float = 0.0
    ct: float = 0.0
    rt: float = 0.0

    def token_seconds(self) -> tuple[float, float] | None:
        """``(c, r)``: seconds per padded token computed and replayed; None before any forward.

        Two pseudo-forwards of a mean forward's tokens, one computed and one replayed at
        ``1 - PRIOR_SAVING`` of its rate, keep the fit at the prior until the band's
        forwards tell the two apart (no hit yet, every row a hit, or every batch alike).
        """
        if self.forwards <= 0 or self.tokens <= 0:
            return None
        # The prior's computed rate: the one that, with replayed tokens at 1 - PRIOR_SAVING
        # of it, gives the band's mean rate over its mix of computed and replayed tokens.
        rate = self.seconds / self.tokens / (1.0 - PRIOR_SAVING * self.replayed / self.tokens)
        prior = (self.tokens / self.forwards) ** 2  # weight of one pseudo-forward
        a, b, d = self.cc + prior, self.cr, self.rr + prior
        y1, y2 = self.ct + prior * rate, self.rt + prior * rate * (1.0 - PRIOR_SAVING)
        det = a * d - b * b  # > 0: the prior makes the system positive definite
        return (y1 * d - b * y2) / det, (a * y2 - b * y1) / det

    def saving(self, length: int) -> float | None:
        """Forward seconds a map hit of ``length`` tokens saves; None before any forward."""
        fitted = self.token_seconds()
        return None if fitted is None else (fitted[0] - fitted[1]) * length

    def worth(self, length: int) -> bool | None:
        """Whether a lookup earns more than it costs; None while a figure is missing."""
        saving = self.saving(length)
        if self.asked <= 0 or saving is None:
            return None
        return (self.hits / self.asked) * saving > self.lookup_s / self.asked


@dataclass(frozen=True, slots=True)
class ForwardCost:
    """A forward's fitted time: ``fixed + per_token * tokens + per_token_position * pairs`` seconds."""

    fixed: float
    per_token: float
    per_token_position: float  # per query-key pair of attention

    def seconds(self, rows: np.ndarray, padded: np.ndarray) -> np.ndarray:
        """The times of forwards of ``rows`` rows padded to ``padded`` tokens (elementwise)."""
        tokens = rows * padded
        return self.fixed + self.per_token * tokens + self.per_token_position * tokens * padded


# Scales of the fit's terms (1, tokens, pairs), so its normal equations stay well conditioned.
_SCALES = np.array([1.0, 1e3, 1e5])


class _ForwardFit:
    """Exponentially weighted normal equations of forward seconds on ``(1, tokens, pairs) / _SCALES``."""

    def __init__(self) -> None:
        self.forwards = 0
        self.xx = np.zeros((3, 3))
        self.xy = np.zeros(3)
        self.yy = 0.0

    def add(self, tokens: int, pairs: int, seconds: float, decay: float) -> None:
        x = np.array([1.0, tokens, pairs]) / _SCALES
        self.forwards += 1
        self.xx = decay * self.xx + np.outer(x, x)
        self.xy = decay * self.xy + x * seconds
        self.yy = decay * self.yy + seconds * seconds

    def solve(self) -> ForwardCost | None:
        """The non-negative least-squares fit (every subset of the terms, the best feasible one), or None
        when no subset's equations can be solved."""
        best: tuple[float, np.ndarray] | None = None
        for size in (3, 2, 1):
            for terms in itertools.combinations(range(3), size):
                index = list(terms)
                try:
                    beta = np.linalg.solve(self.xx[np.ix_(index, index)], self.xy[index])
                except np.linalg.LinAlgError:
                    continue
                if not np.all(np.isfinite(beta)) or np.any(beta < 0):
                    continue
                full = np.zeros(3)
                full[index] = beta
                residual = self.yy - 2.0 * full @ self.xy + full @ self.xx @ full
                if best is None or residual < best[0]:
                    best = (float(residual), full)
        if best is None:
            return None
        fixed, per_token, per_position = (float(v) for v in best[1] / _SCALES)
        return ForwardCost(fixed, per_token, per_position)


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
        self._fit = _ForwardFit()

    @staticmethod
    def band_of(length: int) -> int:
        """The band index of a token length: 0 for 1-8 tokens, then one per doubling."""
        return max(0, math.ceil(math.log2(max(length, 1) / _FIRST_BAND_HIGH)))

    def should_ask(self, length: int) -> bool:
        """Whether a row of ``length`` tokens should be sent for maps (counted as asked or skipped)."""
        with self._lock:
            band = self._bands.setdefault(self.band_of(length), _Band())
            worth = band.worth(length)
            # Until the band's figures exist (no forward timed, or nothing asked), its first min_samples
            # rows are what they are estimated from: asking every row of a fresh process's first window
            # cost the logs call 713 lookups for 68 hits. Exploration goes on meanwhile.
            ask = (
                band.sent_total < self.settings.min_samples
                or bool(worth)
                or self._rng.random() < self.settings.explore
            )
            if ask:
                band.sent_total += 1
            else:
                band.skipped_total += 1
            return ask

    def replay_pays(self, length: int) -> bool:
        """Whether a map hit of ``length`` tokens saves more forward time than its lookup costs (True while
        either figure is missing: a namespace without a projector has no lookups to time). Counts nothing."""
        with self._lock:
            band = self._bands.get(self.band_of(length))
            saving = None if band is None else band.saving(length)
            if band is None or saving is None or band.asked <= 0:
                return True
            return saving > band.lookup_s / band.asked

    def record_lookup(self, length: int, rows: int, hits: int, seconds: float) -> None:
        """``rows`` of this band were projected and searched in ``seconds``; ``hits`` came back map hits."""
        with self._lock:
            band = self._decayed(length)
            band.asked_total += rows
            band.asked += rows
            band.hits += hits
            band.lookup_s += seconds

    def record_forward(
        self, length: int, *, computed_tokens: int, replayed_tokens: int, seconds: float, pairs: int | None = None
    ) -> None:
        """A forward whose longest row has ``length`` tokens took ``seconds``: ``computed_tokens`` of its tokens
        (padding included, if padded) computed, ``replayed_tokens`` replayed maps (fetched during the forward),
        its attention covering ``pairs`` query-key pairs (None: the tokens padded to ``length``)."""
        tokens = computed_tokens + replayed_tokens
        with self._lock:
            self._fit.add(tokens, tokens * length if pairs is None else pairs, seconds, self.settings.decay)
            band = self._decayed(length)
            band.forwards += 1
            band.tokens += computed_tokens + replayed_tokens
            band.replayed += replayed_tokens
            band.seconds += seconds
            band.cc += computed_tokens * computed_tokens
            band.cr += computed_tokens * replayed_tokens
            band.rr += replayed_tokens * replayed_tokens
            band.ct += computed_tokens * seconds
            band.rt += replayed_tokens * seconds

    def forward_cost(self) -> ForwardCost | None:
        """The fitted time of a forward by its tokens and attention pairs; None before ``min_forwards`` forwards."""
        with self._lock:
            if self._fit.forwards < self.settings.min_forwards:
                return None
            return self._fit.solve()

    def estimates(self) -> tuple[BandEstimate, ...]:
        """Every band seen so far, shortest first."""
        with self._lock:
            return tuple(self._estimate(index, band) for index, band in sorted(self._bands.items()))

    def _decayed(self, length: int) -> _Band:
        band = self._bands.setdefault(self.band_of(length), _Band())
        decay = self.settings.decay
        for name in _SUMS:
            setattr(band, name, getattr(band, name) * decay)
        return band

    @staticmethod
    def _estimate(index: int, band: _Band) -> BandEstimate:
        high = _FIRST_BAND_HIGH << index
        low = 1 if index == 0 else high // 2 + 1
        saving = band.saving(high)
        return BandEstimate(
            low=low,
            high=high,
            asked=band.asked_total,
            skipped=band.skipped_total,
            hit_rate=band.hits / band.asked if band.asked > 0 else None,
            saving_ms=None if saving is None else 1000.0 * saving,
            cost_ms=1000.0 * band.lookup_s / band.asked if band.asked > 0 else None,
            worth=band.worth(high),
        )
