"""The plots of ``attnstore report``: per run, the threshold sweep and the methods' speed against their metric.

Drawn with matplotlib's object API (``Figure``, saved through Agg), so no
pyplot state or display is involved. matplotlib is imported when the first plot
is drawn: it belongs to the ``eval`` extra, and the rest of the ``attnstore``
command must not need it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from attnstore.errors import ConfigError
from attnstore_tools.report.tables import PlotFile, method_label, method_rows, metric_label

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from attnstore_tools.report.runs import EvalRun

DPI = 110  # with the figure sizes below: about 700 x 400 pixels, tens of KB per PNG
_SIZE = (6.4, 4.0)  # inches


def write_plots(runs: Sequence[EvalRun], folder: Path) -> dict[str, list[PlotFile]]:
    """Write ``{name}-sweep.png`` and ``{name}-methods.png`` for every run that has something to plot.

    Args:
        runs: the runs.
        folder: where the PNG files go (created if missing).

    Returns:
        Per run name, its two plots, written or skipped.

    Raises:
        ConfigError: matplotlib is not installed.
    """
    folder.mkdir(parents=True, exist_ok=True)
    return {run.name: [_sweep(run, folder / f"{run.name}-sweep.png"),
                       _methods(run, folder / f"{run.name}-methods.png")] for run in runs}


def _sweep(run: EvalRun, path: Path) -> PlotFile:
    """Hit rate (left axis) and metric (right axis) against the attncache threshold."""
    rows = sorted((r for r in run.rows if r.method == "attncache" and r.setting is not None),
                  key=lambda r: r.setting or 0.0)
    hits = [(r.setting, 100 * r.hit_rate) for r in rows if r.hit_rate is not None]
    metric = [(r.setting, r.metric) for r in rows if r.metric is not None]
    if not hits and not metric:
        return PlotFile("sweep", path, "no attncache row has a threshold and a hit rate or metric")
    fig = _figure()
    left = fig.add_subplot()
    right = left.twinx()
    if hits:
        left.plot(*zip(*hits, strict=True), "o-", color="tab:blue", label="hit rate")
    if metric:
        right.plot(*zip(*metric, strict=True), "s-", color="tab:orange", label=run.metric_name)
    if run.full_metric is not None:
        right.axhline(run.full_metric, color="tab:orange", linestyle="--", linewidth=1, label="full model")
    if run.default_threshold is not None:
        left.axvline(run.default_threshold, color="grey", linestyle=":", linewidth=1, label="default threshold")
    left.set_xlabel("threshold")
    left.set_ylabel("hit rate (%)", color="tab:blue")
    right.set_ylabel(metric_label(run), color="tab:orange")
    handles = [h for axis in (left, right) for h in axis.get_legend_handles_labels()[0]]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize="small", frameon=False)
    left.set_title(f"{run.title}: threshold sweep")
    return _save(fig, PlotFile("sweep", path))


def _methods(run: EvalRun, path: Path) -> PlotFile:
    """End-to-end speedup (retrieval included) against the metric, one labelled marker per method row."""
    points = [(method_label(r), r.metric, r.speedup.e2e_incl) for r in method_rows(run)
              if r.metric is not None and r.speedup.e2e_incl is not None]
    if not points:
        return PlotFile("methods", path, "no method row has both a metric and an e2e speedup")
    if run.full_metric is not None:
        points.insert(0, ("full model", run.full_metric, 1.0))
    fig = _figure()
    axis = fig.add_subplot()
    for label, x, y in points:
        axis.plot(x, y, "o", color="black" if label == "full model" else "tab:blue")
        axis.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize="small")
    axis.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    axis.set_xlabel(metric_label(run))
    axis.set_ylabel("e2e speedup incl. retrieval (×)")
    axis.set_title(f"{run.title}: methods")
    axis.margins(0.15)
    return _save(fig, PlotFile("methods", path))


def _figure() -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError("attnstore report draws its plots with matplotlib: pip install 'attnstore[eval]'") from exc
    return Figure(figsize=_SIZE, layout="constrained")


def _save(fig: Figure, plot: PlotFile) -> PlotFile:
    fig.savefig(plot.path, dpi=DPI)
    return plot
