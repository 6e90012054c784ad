"""Training and calibrating a projector on captured inputs: what ``attnstore build`` and
``attnstore admin train-projector`` share, so both make the same projector from the same inputs.

Maps and outputs are spilled to ``.npy`` files and read back on access: a namespace's maps
may not fit in memory, and training and calibration read each only a few times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from attnstore_client.adapters import Adapter
from attnstore_client.projector import Projector
from attnstore_tools.build.calibration import (
    MIN_PSEUDO_QUERIES,
    CalibrationConfig,
    CalibrationReport,
    calibrate_projector,
)
from attnstore_tools.build.training import TrainConfig, TrainReport, train_projector


class SpilledArrays(Sequence[torch.Tensor]):
    """Arrays saved with ``np.save``, loaded as tensors on each access."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self._paths = list(paths)

    def __len__(self) -> int:
        return len(self._paths)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return torch.from_numpy(np.load(self._paths[index]))


@dataclass(frozen=True)
class FitConfig:
    """Settings of ``fit_projector``; every default is what ``attnstore build`` uses."""

    train_limit: int = 8000  # inputs the projector trains on (a seeded sample)
    seed: int = 0
    # ``causal``, ``seed`` and ``progress`` are set from the model and this config.
    train: TrainConfig = field(default_factory=TrainConfig)
    # Calibrates the projector's distances to replay fidelity and fits the gate; None leaves it uncalibrated.
    calibration: CalibrationConfig | None = field(default_factory=CalibrationConfig)
    progress: bool = True


@dataclass(frozen=True)
class FitReport:
    """What training and calibration measured."""

    train: TrainReport
    calibration: CalibrationReport | None  # None when not calibrated


def fit_projector(
    adapter: Adapter,
    ids: Sequence[Sequence[int]],
    sources: Sequence[torch.Tensor],
    maps: Sequence[Path],
    outputs: Sequence[Path],
    config: FitConfig = FitConfig(),
) -> tuple[Projector, FitReport]:
    """Train a projector on (a seeded sample of) the inputs, then calibrate it and fit its gate on all.

    Args:
        adapter: the model.
        ids: per input, its token ids.
        sources: per input, its ``(L, hidden)`` feature source.
        maps: per input, a ``.npy`` of its ``(layers, heads, L, L)`` maps.
        outputs: per input, a ``.npy`` of its ``(L, hidden)`` last hidden states.
        config: settings.

    Raises:
        CorpusError, MapShapeError, FeatureSourceError: see ``train_projector`` (too few inputs, or
            too few of one length).
    """
    sample = list(range(len(ids)))
    if len(sample) > config.train_limit:
        sample = sorted(np.random.default_rng(config.seed).choice(len(sample), config.train_limit, replace=False))
    train_config = replace(config.train, causal=adapter.causal, seed=config.seed, progress=config.progress)
    projector, train_report = train_projector(
        [sources[i] for i in sample], SpilledArrays([maps[i] for i in sample]), config=train_config
    )
    calibration = None
    if config.calibration is not None:
        calibration = calibrate_projector(
            adapter, projector, ids, sources, SpilledArrays(maps), SpilledArrays(outputs),
            replace(config.calibration, seed=config.seed, progress=config.progress),
        )
    return projector, FitReport(train_report, calibration)


def format_fit(train: TrainReport | None, calibration: CalibrationReport | None) -> list[str]:
    """Human summary lines of a projector's training and calibration (none for what did not run)."""
    lines = []
    if train is not None:
        t = train
        lines.append(
            f"projector: {t.train_items} train / {t.val_items} val inputs, best epoch {t.best_epoch} of {t.epochs},"
            f" val Spearman {t.val_spearman:.3f} (mean-pooled key {t.val_spearman_mean_pooled:.3f})"
        )
    c = calibration
    if c is None:
        return lines
    if c.pairs < MIN_PSEUDO_QUERIES:
        lines.append(f"calibration: {c.pairs} pseudo-queries, fewer than {MIN_PSEUDO_QUERIES}: no threshold, "
                     "exact hits only until a run with more inputs")
        return lines
    cal = c.calibration
    threshold = "none reached the target" if cal.max_distance is None else f"{cal.max_distance:.4g}"
    within = "" if c.hit_precision is None else f", {c.hit_rate:.1%} of them within it, {c.hit_precision:.1%} faithful"
    lines.append(
        f"calibration: {c.pairs} pseudo-queries, {c.faithful:.1%} faithful at cosine >= {cal.fidelity};"
        f" length exponent {cal.length_exponent:.2f}; recommended max distance {threshold}"
        f" (precision {cal.precision:.0%}{within})"
    )
    if c.gate is not None:
        precision = "" if c.gate_hit_precision is None else f", {c.gate_hit_precision:.1%} faithful"
        lines.append(
            f"fidelity gate: {c.gate.candidates} candidates per query, cutoff {c.gate.cutoff:.3f} (set-level"
            f" threshold {c.gate.min_probability:.3f}); serves {c.gate_hit_rate:.1%} of the pseudo-queries"
            f"{precision}"
        )
    else:
        lines.append("fidelity gate: none (no rule reached the target precision on the pseudo-queries)")
    return lines
