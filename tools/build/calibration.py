"""Calibrating a trained projector's distances to replay fidelity, at build time.

The projector learns to predict the map distance, but a map hit is only worth
having if replaying the stored maps keeps the output faithful (cosine of the
pooled output to the full model's >= 0.99), and that depends on the length as
well as the distance: one differing token moves a 7-token log line's output far
more than a 40-token one's. A single threshold on the distance is then too
loose for short inputs and too tight for long ones.

So after training, the build measures it on *pseudo-queries* from the corpus
itself (no query data): for a seeded sample of inputs, the nearest other input of
the same length under the projector, its maps replayed on the input, and the
pooled output compared with the input's own. A logistic fit of
``P(faithful) = sigmoid(a + b log d + c log L)`` gives a decision boundary
``d <= t (L / L_ref) ** gamma`` with ``gamma = -c / b``; the projector scales its
output by ``(L / L_ref) ** -gamma`` (``Calibration.length_exponent``), which
turns that boundary into one threshold on its distance, and the largest
threshold whose pseudo-query hits reach the target precision becomes the
namespace's recommended ``max_distance``.

Then the fidelity gate (``attnstore.projector.gate``): for each pseudo-query, its
``gate_candidates`` nearest other inputs of its length under the calibrated
projector are replayed too; a logistic fit over the gate's features (distance,
length, differing tokens, rank) gives P(faithful), and the lowest probability at
which the most probable candidate per pseudo-query is still ``precision``
faithful becomes the gate's ``min_probability`` (a hit needs its ``cutoff``: that,
and at least ``precision`` itself). The gate is stored with the
projector and decides hits when clients leave ``max_distance`` unset.

Pseudo-queries are neighbours inside the store, which are closer than held-out
queries tend to be; measured on Loghub, the threshold chosen for 95% precision on
them gave 99% precision on held-out lines (see docs/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from attnstore.errors import ConfigError
from attnstore.projector.gate import FidelityGate, differing_positions, gate_features
from attnstore_client.adapters import Adapter
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.projector import Calibration, Projector

log = logging.getLogger(__name__)

# Fewer pseudo-queries than this calibrate nothing: the projector then serves exact hits only.
MIN_PSEUDO_QUERIES = 16

# Bounds of the fitted exponent: 0 is the plain threshold; past 2 a fit on a few
# pairs is more likely noise than a real length effect.
_MAX_EXPONENT = 2.0


@dataclass(frozen=True, slots=True)
class CalibrationConfig:
    """Settings of ``calibrate_projector``; every default is what ``attnstore build`` uses."""

    queries: int = 2000  # pseudo-queries sampled (inputs with another input of their length)
    fidelity: float = 0.99  # cosine of the pooled output to the full model's that counts as faithful
    precision: float = 0.95  # the recommended threshold's hits reach this share of faithful ones
    batch_size: int = 32  # pseudo-queries per replay forward
    gate_candidates: int = 4  # nearest inputs scored per pseudo-query for the fidelity gate; 0: no gate
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.precision < 1.0:
            raise ConfigError(f"CalibrationConfig: precision must be in (0, 1), got {self.precision!r}")


@dataclass(frozen=True, slots=True)
class CalibrationReport:
    """What the calibration measured."""

    pairs: int  # pseudo-queries replayed
    faithful: float  # share of them whose replay was faithful (no threshold)
    calibration: Calibration  # max_distance None: no threshold reached the target (or too few pseudo-queries)
    hit_rate: float  # share of pseudo-queries within the recommended threshold
    hit_precision: float | None  # faithful share of those
    gate: FidelityGate | None = None  # None: not fitted (disabled, too few pairs, or no precise enough rule)
    gate_hit_rate: float = 0.0  # share of pseudo-queries the gate serves
    gate_hit_precision: float | None = None  # faithful share of those


def calibrate_projector(
    adapter: Adapter,
    projector: Projector,
    ids: Sequence[Sequence[int]],
    sources: Sequence[torch.Tensor],
    maps: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    config: CalibrationConfig = CalibrationConfig(),
) -> CalibrationReport:
    """Measure replay fidelity on pseudo-queries; install the calibration and the gate on ``projector``.

    Args:
        adapter: the model.
        projector: the trained projector (its calibration is replaced).
        ids: per input, its token ids.
        sources: per input, its ``(L, hidden)`` feature source.
        maps: per input, its ``(layers, heads, L, L)`` maps (may be a lazy sequence).
        outputs: per input, its ``(L, hidden)`` last hidden states (may be lazy).
        config: settings.

    Returns:
        The measurement; ``projector.calibration`` is set unless there were too few pseudo-queries,
        ``projector.gate`` when a gate reached the target precision on them.
    """
    projector.calibration = None
    projector.gate = None
    lengths = np.array([len(row) for row in ids])
    pairs = _pseudo_queries(projector.project(sources), lengths, config)
    if len(pairs) < MIN_PSEUDO_QUERIES:
        # Too few to tell a faithful distance from an unfaithful one: the projector recommends no
        # threshold (exact hits only) rather than leaving clients the uncalibrated default, which a
        # projector trained on a few dozen maps does not honour (a cold start's map hits fell to
        # cosine 0.40 with it). A later build or train-projector with more inputs calibrates.
        log.warning("calibration found %d pseudo-queries (inputs sharing a length with another), fewer than %d: "
                    "the projector serves exact hits only", len(pairs), MIN_PSEUDO_QUERIES)
        projector.calibration = Calibration(
            length_exponent=0.0, reference_length=max(1, int(np.median(lengths))) if lengths.size else 1,
            max_distance=None, fidelity=config.fidelity, precision=config.precision, pairs=len(pairs),
        )
        return CalibrationReport(pairs=len(pairs), faithful=float("nan"), calibration=projector.calibration,
                                 hit_rate=0.0, hit_precision=None)
    cosine = _replay_cosines(adapter, ids, maps, outputs, pairs, config)
    faithful = cosine >= config.fidelity
    distance = np.array([d for _, _, d in pairs])
    length = lengths[[i for i, _, _ in pairs]]
    exponent = _length_exponent(distance, length, faithful)
    reference = int(np.median(length))
    scaled = distance * (length / reference) ** -exponent
    threshold = _threshold(scaled, faithful, config.precision, min_hits(config.precision))
    hits = scaled <= threshold if threshold is not None else np.zeros(len(pairs), dtype=bool)
    projector.calibration = Calibration(
        length_exponent=exponent, reference_length=reference, max_distance=threshold,
        fidelity=config.fidelity, precision=config.precision, pairs=len(pairs),
    )
    report = CalibrationReport(
        pairs=len(pairs),
        faithful=float(faithful.mean()),
        calibration=projector.calibration,
        hit_rate=float(hits.mean()),
        hit_precision=float(faithful[hits].mean()) if hits.any() else None,
    )
    if config.gate_candidates < 1:
        return report
    queries = sorted({i for i, _, _ in pairs})
    gate, served, precision = _fit_gate(adapter, projector, ids, sources, maps, outputs, queries, config)
    projector.gate = gate
    return dataclasses.replace(report, gate=gate, gate_hit_rate=served, gate_hit_precision=precision)


def _fit_gate(
    adapter: Adapter,
    projector: Projector,
    ids: Sequence[Sequence[int]],
    sources: Sequence[torch.Tensor],
    maps: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    queries: list[int],
    config: CalibrationConfig,
) -> tuple[FidelityGate | None, float, float | None]:
    """Fit the fidelity gate on ``queries``' nearest inputs under the calibrated projector.

    Returns:
        The gate (None if no probability reaches the target precision), the share of
        the queries it serves, and the faithful share of those.
    """
    vectors = projector.project(sources)  # (n, dim), length-scaled like the stored features
    lengths = np.array([len(row) for row in ids])
    token_ids = [np.asarray(row) for row in ids]
    pairs, ranks = [], []
    for i in queries:
        same = np.flatnonzero(lengths == lengths[i])
        same = same[[not np.array_equal(token_ids[j], token_ids[i]) for j in same]]  # exact tier's rows
        distance = np.linalg.norm(vectors[same] - vectors[i], axis=1)  # (m,)
        for rank, k in enumerate(np.argsort(distance, kind="stable")[: config.gate_candidates]):
            pairs.append((i, int(same[k]), float(distance[k])))
            ranks.append(rank)
    if not pairs:
        return None, 0.0, None
    faithful = _replay_cosines(adapter, ids, maps, outputs, pairs, config) >= config.fidelity
    features = gate_features(
        np.array([d for _, _, d in pairs]),
        np.array([len(ids[i]) for i, _, _ in pairs]),
        np.array([differing_positions(token_ids[i], token_ids[j]) for i, j, _ in pairs]),
        np.array(ranks),
    )  # (pairs, features)
    weights, bias = _logistic(features, faithful)
    if weights is None:
        return None, 0.0, None
    fitted = FidelityGate(
        weights=tuple(float(w) for w in weights), bias=bias, min_probability=1.0,
        candidates=config.gate_candidates, fidelity=config.fidelity, precision=config.precision,
    )
    probability = fitted.probabilities(features)  # (pairs,)
    owner = np.array([i for i, _, _ in pairs])
    best = [max(np.flatnonzero(owner == i), key=lambda k: probability[k]) for i in np.unique(owner)]
    support = min_hits(config.precision)
    threshold = _threshold(1.0 - probability[best], faithful[best], config.precision, support)
    if threshold is None:
        return None, 0.0, None
    gate = dataclasses.replace(fitted, min_probability=max(1.0 - threshold, 1e-6))
    served = probability[best] >= gate.cutoff
    if served.sum() < support:
        return None, 0.0, None  # too few picks trusted on their own to know the gate's precision
    return gate, float(served.mean()), float(faithful[best][served].mean())


def _logistic(
    features: np.ndarray, labels: np.ndarray, *, l2: float = 1e-3, max_iter: int = 500
) -> tuple[np.ndarray | None, float]:
    """Weights and bias (in the features' own units) of a logistic fit; None if one class only.

    The L2 term (on the standardised weights) keeps a fit on a few, perfectly separable pairs
    from running off to huge weights.
    """
    if labels.all() or not labels.any():
        return None, 0.0
    mean, scale = features.mean(axis=0), features.std(axis=0)
    constant = scale < 1e-6  # e.g. every pair differs in one token: such a feature gets weight 0
    scale[constant] = 1.0
    standard = (features - mean) / scale  # standardised: LBFGS converges fast
    standard[:, constant] = 0.0
    x = torch.tensor(standard, dtype=torch.float64)
    y = torch.tensor(labels, dtype=torch.float64)
    params = torch.zeros(features.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    optimiser = torch.optim.LBFGS([params], max_iter=max_iter, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        optimiser.zero_grad()
        value = F.binary_cross_entropy_with_logits(params[0] + x @ params[1:], y) + l2 * params[1:].pow(2).sum()
        value.backward()
        return value

    optimiser.step(loss)
    standardised = params.detach().numpy()
    weights = standardised[1:] / scale
    return weights, float(standardised[0] - (weights * mean).sum())


def _pseudo_queries(
    vectors: np.ndarray, lengths: np.ndarray, config: CalibrationConfig
) -> list[tuple[int, int, float]]:
    """``(input, nearest other input of its length, distance)`` for a seeded sample of inputs.

    Inputs with identical vectors (the same tokens) are not each other's neighbours.
    """
    candidates = [i for i in range(len(lengths)) if (lengths == lengths[i]).sum() > 1]
    rng = np.random.default_rng(config.seed)
    chosen = rng.permutation(candidates)[: config.queries] if candidates else []
    pairs = []
    for i in chosen:
        same = np.flatnonzero(lengths == lengths[i])
        same = same[same != i]
        distance = np.linalg.norm(vectors[same] - vectors[i], axis=1)  # (m,)
        distance[distance == 0] = np.inf  # a second copy of the same tokens says nothing
        j = int(np.argmin(distance))
        if np.isfinite(distance[j]):
            pairs.append((int(i), int(same[j]), float(distance[j])))
    return pairs


def _replay_cosines(
    adapter: Adapter,
    ids: Sequence[Sequence[int]],
    maps: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    pairs: list[tuple[int, int, float]],
    config: CalibrationConfig,
) -> np.ndarray:
    """Cosine of each pseudo-query's pooled output under its neighbour's maps to its own output."""
    pad = adapter.loaded.tokenizer.pad_token_id
    cosines = np.empty(len(pairs))
    order = sorted(range(len(pairs)), key=lambda k: len(ids[pairs[k][0]]))  # batches of similar length
    bar = tqdm(total=len(pairs), desc="calibrate", unit="query", disable=not config.progress)
    for start in range(0, len(order), config.batch_size):
        batch_rows = order[start : start + config.batch_size]
        batch = batch_from_ids([ids[pairs[k][0]] for k in batch_rows], pad)
        replay = {row: maps[pairs[k][1]] for row, k in enumerate(batch_rows)}  # (layers, heads, L, L) each
        hidden = adapter.forward(batch, replay)  # (B, P, hidden)
        for row, k in enumerate(batch_rows):
            length = batch.lengths[row]
            own = outputs[pairs[k][0]].float()  # (L, hidden)
            mine = hidden[row, :length]  # (L, hidden)
            pooled = (mine[-1], own[-1]) if adapter.causal else (mine.mean(dim=0), own.mean(dim=0))
            cosines[k] = float(F.cosine_similarity(pooled[0], pooled[1], dim=0))
        bar.update(len(batch_rows))
    bar.close()
    return cosines


def _length_exponent(distance: np.ndarray, length: np.ndarray, faithful: np.ndarray) -> float:
    """``gamma`` of the boundary ``d ~ L ** gamma`` of a logistic fit; 0 when the fit says nothing."""
    if faithful.all() or not faithful.any() or len(set(length.tolist())) < 2:
        return 0.0
    features = np.stack([np.log(np.maximum(distance, 1e-9)), np.log(length)], axis=1)  # (n, 2)
    weights, _ = _logistic(features, faithful, l2=1e-4, max_iter=200)
    b, c = weights  # in log units: logit = a + b log d + c log L
    if b >= 0:
        return 0.0  # larger distances are not less faithful here: no length rule to learn
    gamma = -c / b
    return float(min(max(gamma, 0.0), _MAX_EXPONENT)) if math.isfinite(gamma) else 0.0


def min_hits(precision: float) -> int:
    """Hits a threshold needs before its precision is trusted: all of them faithful would put the
    one-sided 95% lower bound of its precision (Clopper-Pearson, ``0.05 ** (1 / n)``) at ``precision``.

    59 at 95%: a threshold or gate fitted on a cold start's 17 faithful picks (all of them, so 100% on
    the pseudo-queries) served map hits at cosine 0.40 to held-out rows.
    """
    if precision >= 1.0:
        raise ConfigError(f"calibration: precision must be below 1, got {precision!r}")
    return max(1, math.ceil(math.log(0.05) / math.log(precision)))


def _threshold(distance: np.ndarray, faithful: np.ndarray, precision: float, support: int) -> float | None:
    """The largest threshold whose hits (distance <= it), at least ``support`` of them, are ``precision`` faithful."""
    order = np.argsort(distance, kind="stable")
    d, f = distance[order], faithful[order]
    count = np.arange(1, d.size + 1)
    share = np.cumsum(f) / count
    ends = np.r_[d[1:] != d[:-1], True]  # a threshold takes every pick at its distance
    ok = np.flatnonzero((share >= precision) & ends & (count >= support))
    return float(d[ok[-1]]) if ok.size else None
