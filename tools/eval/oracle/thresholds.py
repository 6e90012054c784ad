"""Thresholds, hit rates and targets of the oracle evaluation, and its printed table.

Every method (the projector, each simple key) picks one entry per query and has
a distance for it. A pick is a *hit* when its distance is within the method's
threshold, and *faithful* when replaying it keeps the pooled output at cosine
>= the fidelity budget. The oracle has no threshold: its hit rate is the share
of queries whose oracle entry is faithful, the ceiling of any method.

Thresholds are calibrated on a seeded calibration split of the queries (for a
target precision) and every figure is measured on the rest. Calibration uses
the calibration queries *without* an exact duplicate in the store when there
are any: exact duplicates are answered by the exact tier before the index is
searched, so the threshold serves the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PARTS = ("all", "exact_dup", "rest")
# Issue 4's acceptance targets.
TARGET_RATIO = 0.9  # projector hit rate / oracle hit rate
TARGET_PRECISION = 0.95


@dataclass(frozen=True, slots=True)
class Scored:
    """One method's pick for one query, with its replay fidelity."""

    entry_id: int | None  # None: the method had no candidate
    stored_length: int | None
    distance: float  # the method's distance (inf without a candidate)
    cosine: float | None  # replay cosine to the full model's output; None without a candidate
    answer: str | None  # answer letter under replay (multiple-choice prompts)

    def faithful(self, budget: float) -> bool:
        """Whether the replay keeps cosine >= ``budget``."""
        return self.cosine is not None and self.cosine >= budget


@dataclass(frozen=True)
class QueryResult:
    """Everything measured for one query."""

    index: int  # row in the queries file
    group: str | None
    length: int
    duplicate: bool  # an entry with the same tokens is stored
    calibration: bool  # in the calibration split
    answer: str | None  # full model's answer letter
    methods: dict[str, Scored]  # method name -> its pick


def calibration_split(count: int, fraction: float, seed: int) -> np.ndarray:
    """``(count,)`` bool, True for the seeded calibration share of the queries."""
    is_calibration = np.zeros(count, dtype=bool)
    is_calibration[np.random.default_rng(seed).permutation(count)[: int(round(fraction * count))]] = True
    return is_calibration


def calibrate(distances: np.ndarray, faithful: np.ndarray, target: float) -> float | None:
    """The largest threshold whose hits (distance <= threshold) reach ``target`` precision.

    Returns:
        The threshold, or None when no threshold reaches the target (no hits at all).
    """
    finite = np.isfinite(distances)
    order = np.argsort(distances[finite], kind="stable")
    d, f = distances[finite][order], faithful[finite][order]
    if d.size == 0:
        return None
    precision = np.cumsum(f) / np.arange(1, d.size + 1)
    # A threshold takes all picks at its distance: only the end of a tie counts.
    ends = np.r_[d[1:] != d[:-1], True]
    ok = np.flatnonzero((precision >= target) & ends)
    return float(d[ok[-1]]) if ok.size else None


def calibrate_all(
    results: Sequence[QueryResult], methods: Sequence[str], target: float, budget: float
) -> tuple[dict[str, float | None], int]:
    """Calibrate each method's threshold on the calibration split.

    Returns:
        Method -> threshold, and how many queries it was calibrated on.
    """
    pool = [r for r in results if r.calibration and not r.duplicate] or [r for r in results if r.calibration]
    thresholds = {}
    for method in methods:
        distances = np.array([r.methods[method].distance for r in pool], dtype=np.float64)
        faithful = np.array([r.methods[method].faithful(budget) for r in pool], dtype=bool)
        thresholds[method] = calibrate(distances, faithful, target)
    return thresholds, len(pool)


def summarise(
    results: Sequence[QueryResult],
    thresholds: dict[str, float | None],
    *,
    oracle: str,
    budget: float,
    split_threshold: float | None = None,
) -> dict[str, object]:
    """Figures of one part of the evaluation split (see the module docstring).

    Args:
        results: the part's queries.
        thresholds: per thresholded method (``projector`` and the simple keys present).
        oracle: the oracle method the targets compare with.
        budget: the fidelity budget (cosine).
        split_threshold: the projector's threshold calibrated on the split, when the
            projector uses another (its namespace's): reported apart as ``projector_split_*``,
            the like-for-like comparison with the simple keys, which are calibrated that way.
    """
    n = len(results)
    rate = (lambda k: k / n) if n else (lambda k: None)
    summary: dict[str, object] = {"queries": n}
    oracles = sorted(m for m in results[0].methods if m.startswith("oracle")) if results else []
    for method in oracles:
        hits = sum(r.methods[method].faithful(budget) for r in results)
        summary[f"{method}_hit_rate"], summary[f"{method}_hits"] = rate(hits), hits
    oracle_hits = sum(r.methods[oracle].faithful(budget) for r in results)
    summary["oracle_hit_rate"], summary["oracle_hits"] = rate(oracle_hits), oracle_hits
    with_oracle = [r for r in results if r.methods[oracle].entry_id is not None]
    same = sum(r.methods["projector"].entry_id == r.methods[oracle].entry_id for r in with_oracle)
    summary["projector_top1_is_oracle"] = same / len(with_oracle) if with_oracle else None
    rows = [(m, "projector" if m == "projector" else f"key_{m}", t) for m, t in thresholds.items()]
    if split_threshold is not None:
        rows.append(("projector", "projector_split", split_threshold))
    for method, prefix, threshold in rows:
        hits = [r for r in results if _hit(r.methods[method].distance, threshold)]
        faithful = sum(r.methods[method].faithful(budget) for r in hits)
        summary[f"{prefix}_hits"], summary[f"{prefix}_faithful_hits"] = len(hits), faithful
        summary[f"{prefix}_hit_rate"] = rate(faithful)
        summary[f"{prefix}_precision"] = faithful / len(hits) if hits else None
        # Without any threshold: how often the method's top-1 alone is faithful (its ranking quality).
        if prefix != "projector_split":  # the same top-1 as the projector's
            summary[f"{prefix}_top1_faithful_rate"] = rate(sum(r.methods[method].faithful(budget) for r in results))
    summary.update(_answers(results, thresholds.get("projector"), oracle))
    summary["targets"] = _targets(summary, [m for m in thresholds if m != "projector"])
    return summary


def _hit(distance: float, threshold: float | None) -> bool:
    return threshold is not None and math.isfinite(distance) and distance <= threshold


def _answers(results: Sequence[QueryResult], threshold: float | None, oracle: str) -> dict[str, object]:
    """Answer agreement with the full model, for multiple-choice prompts."""
    scored = [r for r in results if r.answer is not None]
    if not scored:
        return {}
    out: dict[str, object] = {"answer_queries": len(scored)}
    for method in [m for m in scored[0].methods if m.startswith("oracle")] + ["projector"]:
        picked = [r for r in scored if r.methods[method].answer is not None]
        agree = sum(r.methods[method].answer == r.answer for r in picked)
        out[f"{method}_answer_agreement"] = agree / len(picked) if picked else None
    hits = [r for r in scored if _hit(r.methods["projector"].distance, threshold)]
    agree = sum(r.methods["projector"].answer == r.answer for r in hits)
    out["projector_hits_answer_agreement"] = agree / len(hits) if hits else None
    return out


def _targets(summary: dict[str, object], keys: Sequence[str]) -> dict[str, object]:
    """Issue 4's targets for one part: hit rate vs the oracle, precision, not below a simple key."""
    projector, oracle = summary.get("projector_hit_rate"), summary.get("oracle_hit_rate")
    precision = summary.get("projector_precision")
    best_key = max((summary[f"key_{k}_hit_rate"] or 0.0 for k in keys), default=None)
    ratio = projector / oracle if projector is not None and oracle else None
    if ratio is not None:
        vs_oracle = ratio >= TARGET_RATIO
    else:
        # No faithful oracle entry: nothing to reach, the target holds trivially.
        vs_oracle = True if oracle == 0 else None
    return {
        "hit_rate_ratio": ratio,
        "hit_rate_vs_oracle": vs_oracle,
        "precision": (precision >= TARGET_PRECISION) if precision is not None else None,
        "not_below_simple_keys": (projector >= best_key) if projector is not None and best_key is not None else None,
    }


def report_parts(
    results: Sequence[QueryResult],
    thresholds: dict[str, float | None],
    *,
    oracle: str,
    budget: float,
    split_threshold: float | None = None,
) -> dict[str, dict[str, object]]:
    """``summarise`` of the evaluation split: all queries, those with an exact duplicate, the rest."""
    held_out = [r for r in results if not r.calibration]
    parts = {
        "all": held_out,
        "exact_dup": [r for r in held_out if r.duplicate],
        "rest": [r for r in held_out if not r.duplicate],
    }
    return {
        name: summarise(rows, thresholds, oracle=oracle, budget=budget, split_threshold=split_threshold)
        for name, rows in parts.items()
    }


def format_table(sections: dict[str, dict[str, dict[str, object]]], keys: Sequence[str]) -> str:
    """A text table: one row per (section, part); rates in %, counts in brackets.

    ``top1`` is a method's top-1 faithful rate with no threshold; ``hit`` its
    faithful hits at its threshold; ``prec`` the share of its hits that are faithful.
    ``split`` is the projector at the threshold calibrated on the split, shown when
    it used another one.
    """
    labels = {"mean_pooled": "mean", "positionwise": "pos"}
    split = any("projector_split_hits" in parts[part] for parts in sections.values() for part in PARTS)
    columns = ["n", "oracle", "top1=oracle", "proj top1", "proj hit", "proj prec"]
    if split:
        columns += ["split hit", "split prec"]
    for key in keys:
        columns += [f"{labels.get(key, key)} top1", f"{labels.get(key, key)} hit"]
    columns.append("targets")
    rows = [(f"{section} {part}", parts[part]) for section, parts in sections.items() for part in PARTS]
    width = max(len(name) for name, _ in rows) + 1
    lines = [f"{'':<{width}}" + "".join(f"{c:>15}" for c in columns)]
    for name, s in rows:
        cells = [str(s["queries"]), _pct(s["oracle_hit_rate"], s["oracle_hits"]),
                 _pct(s["projector_top1_is_oracle"]), _pct(s.get("projector_top1_faithful_rate")),
                 _pct(s.get("projector_hit_rate"), s.get("projector_faithful_hits")),
                 _pct(s.get("projector_precision"), s.get("projector_hits"), of=True)]
        if split:
            cells += [_pct(s.get("projector_split_hit_rate"), s.get("projector_split_faithful_hits")),
                      _pct(s.get("projector_split_precision"), s.get("projector_split_hits"), of=True)]
        for key in keys:
            cells += [_pct(s.get(f"key_{key}_top1_faithful_rate")),
                      _pct(s.get(f"key_{key}_hit_rate"), s.get(f"key_{key}_faithful_hits"))]
        cells.append(_flags(s["targets"]))
        lines.append(f"{name:<{width}}" + "".join(f"{c:>15}" for c in cells))
    return "\n".join(lines)


def _pct(value: object, count: object = None, *, of: bool = False) -> str:
    if value is None:
        return "-" if count is None else f"- ({'of ' if of else ''}{count})"
    text = f"{100 * float(value):.1f}%"
    return text if count is None else f"{text} ({'of ' if of else ''}{count})"


def _flags(targets: dict[str, object]) -> str:
    """One letter per target (ratio, precision, keys): Y holds, n fails, - undefined."""
    return "".join(
        "-" if targets[name] is None else ("Y" if targets[name] else "n")
        for name in ("hit_rate_vs_oracle", "precision", "not_below_simple_keys")
    )
