"""The markdown of ``attnstore report``: each run's block of tables, the summary, and splicing them into the file.

A generated block is the lines between a ``<!-- report:NAME -->`` line and its
``<!-- /report:NAME -->`` line; everything else in the results file is prose and
is copied through unchanged.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeGuard

from attnstore.errors import ConfigError

if TYPE_CHECKING:
    from attnstore_tools.report.runs import EvalRun, Row

DASH = "–"  # a figure the run does not have (null in the JSON)
_MARKER = re.compile(r"<!-- (?P<end>/?)report:(?P<name>\S+) -->[ \t]*")
# The methods table's row order; the full model comes first.
_METHOD_ORDER = ("sentence_transformers", "dict_cache", "output_cache", "attncache", "lazyformer", "san", "attncache_f")
_LAYER_METHODS = ("lazyformer", "san")  # report layer replays instead of a hit rate


@dataclass(frozen=True, slots=True)
class PlotFile:
    """One plot of a run: written to ``path``, or not written because of ``skipped`` (a reason)."""

    title: str  # "sweep" or "methods"
    path: Path
    skipped: str | None = None


@dataclass(frozen=True, slots=True)
class Block:
    """One generated block: its marker name, the heading it is appended under, its markdown."""

    name: str
    heading: str
    body: str


@dataclass(frozen=True, slots=True)
class Spliced:
    """The results file with the blocks in place, and what happened to each block."""

    text: str
    replaced: list[str]  # blocks rewritten between their markers
    appended: list[str]  # blocks appended at the end with new markers
    stale: list[str]  # marked blocks no run wrote, left as they were


def method_label(row: Row) -> str:
    """A row's name in tables and plots: the method, its setting, ``(default)`` for the default row.

    An attncache row without a setting is the namespace's fidelity gate.
    """
    setting = f" {row.setting:g}" if row.setting is not None else " gate" if row.method == "attncache" else ""
    return f"{row.method}{setting}{' (default)' if row.default else ''}"


def method_rows(run: EvalRun) -> list[Row]:
    """The rows of the methods table: every method's rows, but attncache only at the default threshold."""
    rows = [r for r in run.rows if r.method != "attncache" or r.default]
    return sorted(rows, key=lambda r: (_METHOD_ORDER.index(r.method), _setting_key(r)))


def metric_label(run: EvalRun) -> str:
    """The metric with its unit: ``accuracy (%)``, ``spearman (x100)``."""
    return f"{run.metric_name} ({run.metric_unit})"


def summary_block(runs: Sequence[EvalRun]) -> str:
    """The summary table: one row per run, at its default threshold.

    Args:
        runs: the runs, in block order.

    Returns:
        The block's markdown.
    """
    header = ["task", "model", "metric", "full", "cached", "delta", "hit rate", "e2e speedup incl. retrieval",
              "× dict_cache", "γ"]
    rows = []
    for run in runs:
        row = run.default_row
        task = run.task if run.shots is None else f"{run.task} {run.shots}-shot"
        cells = [task, run.model, metric_label(run), _num(run.full_metric)]
        if row is None:
            cells += [DASH] * 6
        else:
            cells += [_num(row.metric), _delta(row.delta), _pct(row.hit_rate), _x(row.speedup.e2e_incl),
                      _x(_against_dict_cache(run, row)), _num(row.gamma)]
        rows.append(cells)
    return ("Each run at its default (the namespace's fidelity gate, or its threshold); the speedups count"
            " the retrieval time. × dict_cache: the default's speed over a dict output cache in front of"
            " sentence-transformers (or the plain model) in the same run (– for runs made before that row"
            " existed).\n\n"
            + _table(header, rows, labels=3))


def _against_dict_cache(run: EvalRun, row: Row) -> float | None:
    """``row``'s end-to-end speed (retrieval included) over the run's dict_cache row, if it has one."""
    dict_cache = next((r for r in run.rows if r.method == "dict_cache"), None)
    if dict_cache is None or row.speedup.e2e_incl is None or not dict_cache.speedup.e2e_incl:
        return None
    return row.speedup.e2e_incl / dict_cache.speedup.e2e_incl


def run_block(run: EvalRun, plots: Sequence[PlotFile], base: Path) -> str:
    """One run's block: command, setup, group, sweep, exact-duplicate and methods tables, plot links.

    Args:
        run: the run.
        plots: its plots, written or skipped.
        base: the results file's folder; plot links are relative to it.

    Returns:
        The block's markdown.
    """
    command = ("The command was not recorded (the run was not started as `attnstore`)." if run.command is None
               else f"```sh\n{run.command}\n```")
    sections = [command, _setup(run)]
    default = run.default_row
    if default is None:
        sections.append("No attncache row is marked default: the tables at the default threshold are left out.")
    else:
        if default.groups:
            sections.append(_groups_table(run, default))
        sections.append(_sweep_table(run))
        if default.parts:
            sections.append(_parts_table(run, default))
    sections.append(_methods_table(run))
    sections.append(_plot_links(plots, base))
    return "\n\n".join(sections)


def splice_blocks(text: str, blocks: Sequence[Block], where: Path) -> Spliced:
    """Put each block between its markers in ``text``, or append it with markers when they are missing.

    Lines outside the markers are copied unchanged, line endings included. Missing
    blocks are appended in the order given, each under a ``## heading``.

    Args:
        text: the results file's text ("" for a new file).
        blocks: the generated blocks.
        where: the results file, for error messages.

    Returns:
        The new text and what happened to each block.

    Raises:
        ConfigError: a marker is unclosed, closed without opening, nested or repeated.
    """
    bodies = {b.name: f"\n{b.body.rstrip()}\n\n" for b in blocks}
    out: list[str] = []
    seen: list[str] = []
    current: str | None = None  # the block whose markers we are inside
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        marker = _MARKER.fullmatch(line.rstrip("\r\n"))
        if marker is None:
            if current is None or current not in bodies:
                out.append(line)
            continue
        name, opening = marker["name"], not marker["end"]
        if opening and current is not None:
            raise ConfigError(f"{where}:{number}: block {name} opens inside block {current}; close {current} first")
        if opening and name in seen:
            raise ConfigError(f"{where}:{number}: block {name} appears twice; remove one of them")
        if not opening and name != current:
            raise ConfigError(f"{where}:{number}: block {name} closes but was not opened here")
        out.append(line)
        if opening:
            seen.append(name)
            out.append(bodies.get(name, ""))
        current = name if opening else None
    if current is not None:
        raise ConfigError(f"{where}: block {current} has no closing line <!-- /report:{current} -->")
    appended = [b for b in blocks if b.name not in seen]
    if appended and out and not out[-1].endswith("\n"):
        out.append("\n")
    for block in appended:
        gap = "\n" if out else ""  # a blank line before the heading, unless the file was empty
        out.append(f"{gap}## {block.heading}\n\n<!-- report:{block.name} -->\n"
                   f"{bodies[block.name]}<!-- /report:{block.name} -->\n")
    return Spliced(
        text="".join(out),
        replaced=[n for n in seen if n in bodies],
        appended=[b.name for b in appended],
        stale=[n for n in seen if n not in bodies],
    )


def _setup(run: EvalRun) -> str:
    m = run.machine
    plural = "" if m.torch_threads == 1 else "s"
    threads = None if m.torch_threads is None else f"{m.torch_threads} torch thread{plural}"
    facts = [m.cpu, None if m.cores is None else f"{m.cores} cores",
             None if m.torch is None else f"torch {m.torch}", threads, m.date]
    machine = ", ".join(f for f in facts if f) or DASH
    return (f"Machine: {machine}. Queries: {_count(run.queries)}, batch size {_count(run.batch_size)}."
            f" Timing: {_count(run.timing_queries)} queries, {_count(run.timing_rounds)} rounds per method."
            f" Default: {_default_rule(run)}. Metric: {metric_label(run)}.")


def _default_rule(run: EvalRun) -> str:
    default = run.default_row
    if default is not None and default.setting is None:
        return "the namespace's fidelity gate"
    return f"threshold {_setting(run.default_threshold)}"


def _groups_table(run: EvalRun, default: Row) -> str:
    label = {"logs": "system", "mmlu": "subject"}.get(run.task, "group")
    header = [label, "queries", "full", "cached", "delta", "hit rate", "exact hits", "map hits"]
    rows = [["**all**", _count(run.queries), _num(run.full_metric), _num(default.metric), _delta(default.delta),
             _pct(default.hit_rate), _count(default.exact_hits), _count(default.map_hits)]]
    for name, g in default.groups.items():
        rows.append([name, _count(g.queries), _num(g.full), _num(g.metric), _delta(_minus(g.metric, g.full)),
                     _pct(g.hit_rate), _count(g.exact_hits), _count(g.map_hits)])
    return f"**Per {label}**, attncache at its default (gate or threshold).\n\n" + _table(header, rows)


def _sweep_table(run: EvalRun) -> str:
    header = ["threshold", "metric", "delta", "hit rate", "exact hits", "map hits", "cosine mean", "cosine min",
              "cosine ≥ 0.99", "e2e excl", "e2e incl", "attn excl", "attn incl"]
    rows = []
    for r in sorted((r for r in run.rows if r.method == "attncache"), key=_setting_key):
        setting = "gate" if r.setting is None else _setting(r.setting)
        cells = [setting, _num(r.metric), _delta(r.delta), _pct(r.hit_rate), _count(r.exact_hits),
                 _count(r.map_hits), _num(r.cosine.mean, 4), _num(r.cosine.min, 4), _pct(r.cosine.share_099),
                 _x(r.speedup.e2e_excl), _x(r.speedup.e2e_incl), _x(r.speedup.attn_excl), _x(r.speedup.attn_incl)]
        rows.append([f"**{c}**" for c in cells] if r.default else cells)
    return ("**Threshold sweep** (attncache; default in bold; \"gate\": the namespace's fidelity gate decides)."
            " Speedups over the full model, excluding or"
            " including the retrieval time.\n\n" + _table(header, rows))


def _parts_table(run: EvalRun, default: Row) -> str:
    header = ["part", "queries", "full", "cached", "delta", "hit rate", "cosine mean"]
    rows = [["**all**", _count(run.queries), _num(run.full_metric), _num(default.metric), _delta(default.delta),
             _pct(default.hit_rate), _num(default.cosine.mean, 4)]]
    for name, p in default.parts.items():
        rows.append([name.replace("_", " "), _count(p.queries), _num(p.full), _num(p.metric),
                     _delta(_minus(p.metric, p.full)), _pct(p.hit_rate), _num(p.cosine_mean, 4)])
    return "**Exact duplicates and the rest**, attncache at its default (gate or threshold).\n\n" + _table(header, rows)


def _methods_table(run: EvalRun) -> str:
    header = ["method", "metric", "delta", "hit rate / layer replays", "e2e excl", "e2e incl", "attn excl",
              "attn incl", "γ"]
    one = _x(1.0)
    rows = [["full model", _num(run.full_metric), DASH, DASH, one, one, one, one, DASH]]
    for r in method_rows(run):
        served = f"{_count(r.layer_replays)} replays" if r.method in _LAYER_METHODS else _pct(r.hit_rate)
        rows.append([method_label(r), _num(r.metric), _delta(r.delta), served, _x(r.speedup.e2e_excl),
                     _x(r.speedup.e2e_incl), _x(r.speedup.attn_excl), _x(r.speedup.attn_incl), _num(r.gamma)])
    return "**Methods** (speedups over the full model, excluding or including retrieval).\n\n" + _table(header, rows)


def _plot_links(plots: Sequence[PlotFile], base: Path) -> str:
    lines = []
    for plot in plots:
        if plot.skipped is None:
            link = Path(os.path.relpath(plot.path, base)).as_posix()
            lines.append(f"![{plot.title}]({link})")
        else:
            lines.append(f"No {plot.title} plot: {plot.skipped}.")
    return "\n\n".join(lines)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], *, labels: int = 1) -> str:
    """A markdown table: the first ``labels`` columns left-aligned, the figures right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * labels + " ---: |" * (len(header) - labels)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def _setting_key(row: Row) -> tuple[bool, float]:
    return (row.setting is None, 0.0 if row.setting is None else row.setting)


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _known(value: float | None) -> TypeGuard[float]:
    return value is not None and math.isfinite(value)


def _num(value: float | None, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if _known(value) else DASH


def _delta(value: float | None) -> str:
    return f"{value:+.2f}" if _known(value) else DASH


def _pct(value: float | None) -> str:
    return f"{100 * value:.1f}%" if _known(value) else DASH


def _x(value: float | None) -> str:
    return f"{value:.2f}×" if _known(value) else DASH


def _count(value: int | None) -> str:
    return DASH if value is None else f"{value:,}"


def _setting(value: float | None) -> str:
    return f"{value:g}" if _known(value) else DASH
