"""The fidelity gate: which of a query's nearest stored entries, if any, may be replayed.

A threshold on the projector's distance alone decides poorly which map hits keep
the output faithful: on held-out Loghub lines at 95% precision it served about
half of what the oracle could (docs/RESULTS.md). What it misses is visible in the
tokens: a stored line that differs from the query in one token of forty replays
faithfully at a distance where one that differs in three tokens of seven does
not. So the service scores each of a query's ``candidates`` nearest entries of
its length (or, for causal models, longer ones cropped) with a logistic model
over features of the pair, and serves the most probable one when its
probability reaches the gate's ``cutoff``:

- the projector's distance (log), the query's length (log);
- how many token positions differ between the query and the entry (for a crop,
  the entry's first L tokens), as a count, its log, and its share of L;
- the candidate's rank by distance.

The cutoff is the larger of ``min_probability`` (the lowest probability at which
the served pseudo-queries of the build were still ``precision`` faithful as a
set) and ``precision`` itself (each served candidate predicted that faithful on
its own): a set-level threshold lets marginal candidates in beside near-certain
ones, and held-out queries are farther from the store than pseudo-queries. On
held-out Loghub lines (all-MiniLM-L6-v2) the set-level threshold alone (0.84)
served hits 93% faithful (98.3% of queries at cosine >= 0.99); the cutoff (0.95)
served half as many, 99.2% faithful (99.9% of queries).

The gate is fitted when a namespace is built (``attnstore_tools.build.calibration``),
on pseudo-queries from the build corpus, and travels in the namespace's projector
blob (``attnstore.projector.blob``). Entries ingested without token ids cannot be
gated and are never served by it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import numpy as np

from attnstore.errors import ConfigError

FEATURES = ("log_distance", "log_length", "log_differing", "differing_share", "differing", "rank")
MAX_CANDIDATES = 64


@dataclass(frozen=True, slots=True)
class FidelityGate:
    """A logistic model of P(replay is faithful) over ``FEATURES``, and its decision rule."""

    weights: tuple[float, ...]  # one per feature, in ``FEATURES`` order
    bias: float
    min_probability: float  # the build's set-level threshold (a hit needs ``cutoff``, at least this)
    candidates: int  # nearest entries scored per query
    fidelity: float  # cosine to the full model's output that counted as faithful when fitted
    precision: float  # share of faithful hits ``min_probability`` was chosen for

    def __post_init__(self) -> None:
        if len(self.weights) != len(FEATURES):
            raise ConfigError(f"FidelityGate: {len(self.weights)} weights for {len(FEATURES)} features")
        if not all(math.isfinite(w) for w in (*self.weights, self.bias)):
            raise ConfigError("FidelityGate: weights and bias must be finite")
        if not 0.0 < self.min_probability <= 1.0:
            raise ConfigError(f"FidelityGate: min_probability must be in (0, 1], got {self.min_probability!r}")
        if isinstance(self.candidates, bool) or not 1 <= self.candidates <= MAX_CANDIDATES:
            raise ConfigError(f"FidelityGate: candidates must be in [1, {MAX_CANDIDATES}], got {self.candidates!r}")

    @property
    def cutoff(self) -> float:
        """The probability the most probable candidate must reach to be served (see the module docstring)."""
        return max(self.min_probability, self.precision)

    def probabilities(self, features: np.ndarray) -> np.ndarray:
        """``(n,)`` P(faithful) of ``(n, len(FEATURES))`` rows of ``gate_features``."""
        logits = features @ np.asarray(self.weights, dtype=np.float64) + self.bias
        return 1.0 / (1.0 + np.exp(-np.clip(logits, -60.0, 60.0)))

    def to_json(self) -> str:
        """The gate as a JSON object."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FidelityGate:
        """Inverse of ``to_json``.

        Raises:
            ConfigError: not JSON, or not a valid gate.
        """
        try:
            record = json.loads(text)
            return cls(**{**record, "weights": tuple(float(w) for w in record["weights"])})
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"FidelityGate: malformed gate ({exc})") from None


def differing_positions(query_ids: np.ndarray, entry_ids: np.ndarray) -> int:
    """Positions where the query's tokens differ from the entry's first ``len(query_ids)`` tokens."""
    length = len(query_ids)
    return int(np.count_nonzero(np.asarray(query_ids) != np.asarray(entry_ids)[:length]))


def gate_features(
    distances: np.ndarray, lengths: int | np.ndarray, differing: np.ndarray, ranks: np.ndarray
) -> np.ndarray:
    """``(n, len(FEATURES))`` float64 features of ``n`` (query, candidate) pairs.

    Args:
        distances: (n,) the projector's distances to the candidates.
        lengths: (n,) or one: the queries' token lengths L.
        differing: (n,) token positions that differ (``differing_positions``).
        ranks: (n,) the candidates' ranks by distance among their query's, 0 = nearest.
    """
    distances = np.asarray(distances, dtype=np.float64)
    lengths = np.broadcast_to(np.asarray(lengths, dtype=np.float64), distances.shape)
    differing = np.asarray(differing, dtype=np.float64)
    return np.stack(
        [
            np.log(distances + 1e-6),
            np.log(lengths),
            np.log(differing + 0.5),
            differing / lengths,
            differing,
            np.asarray(ranks, dtype=np.float64),
        ],
        axis=1,
    )
