"""Scoring the variants of one evaluation run: the JSON report and the printed table.

Every variant's pass is scored with the task metric (overall, per group, and
split into queries whose exact tokens are stored and the rest), compared with
the full model's outputs (cosine of the pooled outputs), and its timing turned
into speedups over the full model: end-to-end and attention-only, each
excluding and including retrieval, and the speed gained per metric point lost,
gamma = (end-to-end speedup including retrieval - 1) / max(metric loss in points, 0.1).
"""

from __future__ import annotations

import datetime
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from attnstore_tools.eval.runner import Pass, Timing
from attnstore_tools.eval.tasks import Task
from attnstore_tools.eval.variants import Variant
from attnstore_tools.machine import cpu_model

GAMMA_FLOOR = 0.1  # metric loss (points) below which gamma's denominator is floored


def _cosines(outputs: np.ndarray, full: np.ndarray) -> np.ndarray:
    a = outputs / np.maximum(np.linalg.norm(outputs, axis=1, keepdims=True), 1e-12)
    b = full / np.maximum(np.linalg.norm(full, axis=1, keepdims=True), 1e-12)
    return np.sum(a * b, axis=1)  # (n,)


def _metric_input(task: Task, run) -> np.ndarray:
    return run.logits if task.answers_by_logits else run.outputs


def _nan_to_none(value: float | None) -> float | None:
    return None if value is None or not np.isfinite(value) else round(float(value), 6)


def build_report(
    task: Task,
    loaded,
    store_url: str,
    namespace: str,
    config,
    default: float | None,
    variants: Sequence[Variant],
    passes: Sequence[Pass],
    timings: Sequence[Timing],
    duplicate: np.ndarray,
    timed: int,
    context: int,
) -> dict[str, object]:
    """The JSON report of one run: the full model's figures, then one row per variant.

    Args:
        task: the task (fitted).
        loaded: the model.
        store_url, namespace: where the store is.
        config: the run's ``EvalConfig``.
        default: the default threshold; None when the namespace's fidelity gate is the default
            (the attncache row without a threshold).
        variants, passes, timings: per variant, the full model first.
        duplicate: per query, whether its exact tokens are stored.
        timed: queries in the timing subset.
        context: the longest query, in tokens.
    """
    full_pass, full_timing = passes[0], timings[0]
    full_metric, full_groups = task.score(_metric_input(task, full_pass))
    part_masks = {"exact_dup": duplicate, "rest": ~duplicate}
    full_parts = {}
    for part, mask in part_masks.items():
        pair_mask = task.query_mask(mask)
        metric = task.score(_metric_input(task, full_pass), pair_mask)[0] if pair_mask.any() else None
        full_parts[part] = {"queries": int(pair_mask.sum()), "metric": _nan_to_none(metric)}
    rows = []
    for variant, run, timing in zip(variants[1:], passes[1:], timings[1:], strict=True):
        metric, groups = task.score(_metric_input(task, run))
        cosine = _cosines(run.outputs, full_pass.outputs)
        kinds = np.array(run.kinds)
        served = np.isin(kinds, ("exact", "map"))
        parts = {}
        for part, mask in part_masks.items():
            pair_mask = task.query_mask(mask)
            if not pair_mask.any():
                parts[part] = {"queries": 0, "metric": None, "full": None, "hit_rate": None, "cosine_mean": None}
                continue
            parts[part] = {
                "queries": int(pair_mask.sum()),
                "metric": _nan_to_none(task.score(_metric_input(task, run), pair_mask)[0]),
                "full": full_parts[part]["metric"],
                "hit_rate": _nan_to_none(served[mask].mean()),
                "cosine_mean": _nan_to_none(cosine[mask].mean()),
            }
        group_rows = {}
        if task.groups is not None:
            group_array = np.array(task.groups)
            for group, value in groups.items():
                members = group_array == group
                group_rows[group] = {
                    "queries": int(members.sum()), "metric": _nan_to_none(value),
                    "full": _nan_to_none(full_groups.get(group)), "hit_rate": _nan_to_none(served[members].mean()),
                    "exact_hits": int(sum(kind == "exact" for kind in kinds[members])),
                    "map_hits": int(sum(kind == "map" for kind in kinds[members])),
                }
        delta = metric - full_metric
        e2e_incl = full_timing.total_s / timing.total_s
        rows.append({
            "method": variant.name,
            "setting": variant.setting,
            "default": variant.name == "attncache" and variant.setting == default,
            "metric": _nan_to_none(metric),
            "delta": _nan_to_none(delta),
            "hit_rate": _nan_to_none((run.exact_hits + run.map_hits) / len(run.kinds)),
            "exact_hits": run.exact_hits,
            "map_hits": run.map_hits,
            "prefix_hits": int(sum(kind == "prefix" for kind in kinds)),
            "tokens": {"prompt": run.tokens, "computed": run.computed_tokens},
            # the share of queries whose answer (the arg max over the choices) is the full model's
            "answers_agree": _agreement(run.logits, full_pass.logits),
            "misses": run.misses,
            "fallbacks": run.fallbacks,
            "layer_replays": run.layer_replays,
            "cosine": {
                "mean": _nan_to_none(cosine.mean()), "min": _nan_to_none(cosine.min()),
                "share_099": _nan_to_none(np.mean(cosine >= 0.99)),
            },
            "groups": group_rows,
            "parts": parts,
            "speedup": {
                "e2e_excl": _nan_to_none(full_timing.total_s / max(timing.compute_s, 1e-9)),
                "e2e_incl": _nan_to_none(e2e_incl),
                "attn_excl": _nan_to_none(full_timing.attention_s / max(timing.attention_compute_s, 1e-9)),
                "attn_incl": _nan_to_none(
                    full_timing.attention_s / max(timing.attention_compute_s + timing.retrieval_s, 1e-9)
                ),
            },
            "gamma": _nan_to_none((e2e_incl - 1) / max(-delta, GAMMA_FLOOR)),
            "time_s": {
                "total": round(timing.total_s, 4), "retrieval": round(timing.retrieval_s, 4),
                "attention": round(timing.attention_s, 4), "full_total": round(full_timing.total_s, 4),
                "full_attention": round(full_timing.attention_s, 4), "pass": round(run.seconds, 2),
            },
        })
    stats = _store_stats(store_url, namespace)
    return {
        "kind": "attnstore.eval/1",
        "task": task.name,
        "shots": config.extra.get("shots"),
        "model": loaded.name,
        "command": "attnstore " + shlex.join(sys.argv[1:]) if Path(sys.argv[0]).name == "attnstore" else None,
        "metric": {"name": task.metric, "unit": task.unit},
        "machine": {
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu": cpu_model(), "date": datetime.date.today().isoformat(),
        },
        "store": {"url": store_url, "namespace": namespace, **stats},
        "queries": len(full_pass.kinds),
        "pairs": task.pairs,
        "longest_tokens": context,
        "batch_size": config.batch_size,
        "timing": {"queries": timed, "rounds": config.timing_rounds, "warmup_rounds": 1},
        "default_threshold": default,
        "default_rule": "threshold" if default is not None else "gate",
        "options": {**config.extra, **_san_options(variants, config.san_shares),
                    "attncache_f": list(config.attncache_f), "seed": config.seed},
        "full": {
            "metric": _nan_to_none(full_metric),
            "groups": {g: _nan_to_none(v) for g, v in full_groups.items()},
            "parts": full_parts,
            "time_s": {"total": round(full_timing.total_s, 4), "attention": round(full_timing.attention_s, 4),
                       "pass": round(full_pass.seconds, 2)},
        },
        "rows": rows,
    }


def _san_options(variants: Sequence[Variant], shares: Sequence[float]) -> dict[str, object]:
    """SAN's calibration as the JSON records it: divergences per adjacent pair, shares and thresholds."""
    san = [v for v in variants if v.name == "san"]
    if not san:
        return {}
    calibration = san[0].calibration
    return {"san": {
        "divergences": [round(d, 5) for d in calibration.divergences], "calibration_inputs": calibration.inputs,
        "shares": list(shares), "thresholds": [round(v.setting, 5) for v in san],
    }}


def _store_stats(store_url: str, namespace: str) -> dict[str, object]:
    """Entries and bytes of the namespace, for an embedded store (a daemon's are not read here)."""
    if not store_url.startswith("local:"):
        return {}
    from attnstore.service import AttnStoreService

    with AttnStoreService.open(store_url[len("local:"):], readonly=True) as service:
        stats = service.store.stats()
    for ns in stats.namespaces:
        if ns.name == namespace:
            return {"entries": ns.entries, "bytes": ns.stored_bytes}
    return {}


def _agreement(logits: np.ndarray | None, full: np.ndarray | None) -> float | None:
    if logits is None or full is None:
        return None
    return float(np.mean(np.argmax(logits, axis=1) == np.argmax(full, axis=1)))


def format_report(report: dict[str, object]) -> str:
    """The printed table: one line per variant."""
    full = report["full"]
    unit = report["metric"]["unit"]
    lines = [
        f"{report['task']} / {report['model']}: {report['queries']} queries, metric {report['metric']['name']} "
        f"({unit}); timing: {report['timing']['queries']} queries, median of {report['timing']['rounds']} rounds",
        f"{'method':<13} {'setting':>8} {'metric':>8} {'delta':>7} {'hit':>7} {'exact':>6} {'map':>6} "
        f"{'prefix':>6} {'computed':>8} {'agree':>6} {'cos min':>8} "
        f"{'cos>=.99':>8} {'e2e ex':>7} {'e2e in':>7} {'att ex':>7} {'att in':>7} {'gamma':>7}",
        f"{'full':<13} {'':>8} {full['metric']:>8.2f} {'':>7} {'':>7} {'':>6} {'':>6} {'':>6} {'':>8} {'':>6} "
        f"{'':>8} {'':>8} {'1.00':>7} {'1.00':>7} {'1.00':>7} {'1.00':>7} {'':>7}",
    ]
    for row in report["rows"]:
        setting = "" if row["setting"] is None else f"{row['setting']:g}"
        speed = row["speedup"]
        gamma = "-" if row["gamma"] is None else f"{row['gamma']:.2f}"
        mark = "*" if row["default"] else ""
        lines.append(
            f"{row['method'] + mark:<13} {setting:>8} {_num(row['metric']):>8} {_num(row['delta']):>7} "
            f"{_pct(row['hit_rate']):>7} {row['exact_hits']:>6} {row['map_hits']:>6} {row['prefix_hits']:>6} "
            f"{_computed(row['tokens']):>8} {_pct(row['answers_agree']):>6} {_cos(row['cosine']['min']):>8} "
            f"{_pct(row['cosine']['share_099']):>8} {_num(speed['e2e_excl']):>7} {_num(speed['e2e_incl']):>7} "
            f"{_num(speed['attn_excl']):>7} {_num(speed['attn_incl']):>7} {gamma:>7}"
        )
    lines.append("* the default threshold; speedups vs the full model, excluding (ex) and including (in) retrieval")
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _computed(tokens: dict[str, int]) -> str:
    """Tokens computed as a share of the prompts' tokens."""
    return "-" if not tokens["prompt"] else f"{tokens['computed'] / tokens['prompt']:.1%}"


def _cos(value: float | None) -> str:
    return "-" if value is None else f"{value:.5f}"
