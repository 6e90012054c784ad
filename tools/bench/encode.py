"""``attnstore bench encode``: one ``encode()`` call of N rows, at the scale users run it, time and peak memory.

Methods, each in a child process of its own (``encode_child``), on the
same texts in one call, with ``--threads`` torch threads: sentence-transformers'
``encode``; a dict of the stored texts' embeddings in front of it (the distinct
misses encoded in one call: what a user writes first); ``AttnCache.encode`` in
embedded mode on a store built by ``attnstore build`` at its defaults
(``attnstore``), and, when asked for, the same without its map tier
(``attnstore_exact``: what the map tier costs or earns on the call). Per N:
seconds (median of ``--repeats`` children per method, run interleaved), peak RSS
(each child's own ``VmHWM``: its ``ru_maxrss`` would carry this process's), AttnCache's time outside the tiers
(``CacheStats.overhead_s``) and its retrieval (projection, lookups, fetches),
speedups against both (excluding and including retrieval), and fidelity: the share
of rows whose AttnCache embedding has cosine >= 0.99 to sentence-transformers', and
for the logs the template accuracy of each (each query takes the template of its
nearest stored line, by sentence-transformers' embeddings of the stored lines).

Data (``--data``):

- ``logs``: the 8 Loghub systems of ../shared/data/loghub; the store is built from
  each system's first 1,000 lines, the call's rows are the last 1,000 of each
  (8,000 lines), repeated or cut to N;
- ``sst2``: SST-2 train; the store is built from its first 2,000 sentences (as
  ``attnstore eval sst2`` builds it), the call's rows are its sentences in file
  order, cut (or repeated) to N.

The built store is kept under ``--work-dir`` and reused by later runs of the same data.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from attnstore.errors import ConfigError
from attnstore_tools.arguments import documented_parser, positive_ints
from attnstore_tools.corpus import DATA_HELP, data_dir
from attnstore_tools.machine import cpu_model
from attnstore_tools.output import write_json

METHODS = ("sentence_transformers", "dict", "attnstore", "attnstore_exact")
DEFAULT_METHODS = METHODS[:3]
NAMESPACE = "encode"
_SST2_BUILD = 2_000
_WARMUP_ROWS = 64


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``encode`` to the ``bench`` group."""
    p = documented_parser(subparsers, "encode", __doc__, summary="one encode() call of N rows: time and peak RSS")
    p.add_argument("--data", choices=("logs", "sst2"), default="logs", help="the rows' source (see above)")
    p.add_argument("--rows", default="1000,8000", help="comma-separated N: rows of the one call")
    p.add_argument("--repeats", type=int, default=3, help="children per method and N (the median is reported)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated, of {', '.join(METHODS)} (default: the first three)")
    p.add_argument("--model", default="minilm", help="a sentence-transformers model alias or path")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each child")
    p.add_argument("--batch", type=int, default=32, help="batch_size of every encode call")
    p.add_argument("--device", default="cpu", help="where every method's model runs (cpu, cuda)")
    p.add_argument("--data-dir", type=Path, default=None, help=DATA_HELP)
    p.add_argument("--work-dir", type=Path, default=Path("runs/bench-encode"), help="where the built store is kept")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of time and peak RSS against N here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; prints a table, writes JSON and the plot when asked."""
    counts = positive_ints(args.rows, "bench encode: --rows")
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        raise ConfigError(f"bench encode: --methods {args.methods!r}: each must be one of {list(METHODS)}")
    if args.repeats < 1 or args.threads < 1 or args.batch < 1:
        raise ConfigError("bench encode: --repeats, --threads and --batch must be >= 1")
    stored, queries, labels, stored_labels = load_data(args.data, data_dir(args.data_dir))
    work = args.work_dir / args.data
    store = built_store(args.model, stored, work)
    embeddings_path = stored_embeddings(args.model, stored, work, threads=args.threads, batch=args.batch)
    stored_vectors = np.load(embeddings_path)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-encode-") as tmp:
        scratch = Path(tmp)
        _write_json(scratch / "stored.json", stored)
        _write_json(scratch / "warmup.json", _warmup_texts(data_dir(args.data_dir)))
        for count in counts:
            rows = [queries[i % len(queries)] for i in range(count)]
            row_labels = None if labels is None else [labels[i % len(labels)] for i in range(count)]
            _write_json(scratch / "texts.json", rows)
            reports = _children(args, methods, scratch, store, embeddings_path)
            results.append(_summarise(count, reports, scratch, stored_vectors, stored_labels, row_labels))
            _print(results[-1])
    report = {
        "data": args.data, "model": args.model, "threads": args.threads, "batch": args.batch, "device": args.device,
        "repeats": args.repeats, "cpu": cpu_model(), "stored_rows": len(stored), "results": results,
    }
    if args.json is not None:
        write_json(args.json, report)
    if args.plot is not None:
        _plot(report, args.plot)
    return 0



def load_data(data: str, root: Path) -> tuple[list[str], list[str], list[str] | None, list[str] | None]:
    """Stored texts, query texts, and (logs) each query's and each stored text's template (see the module
    docstring: the logs' first halves are stored, their second halves are the queries).

    Raises:
        ConfigError: no Loghub files under ``root``.
    """
    if data == "sst2":
        path = root / "sst2_train.tsv"
        with path.open(encoding="utf-8", newline="") as f:
            sentences = [row["sentence"] for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]
        return sentences[:_SST2_BUILD], sentences, None, None
    stored, queries, labels, stored_labels = [], [], [], []
    paths = sorted((root / "loghub").glob("*.tsv"))
    if not paths:
        raise ConfigError(f"bench encode: no Loghub .tsv files in {root / 'loghub'}")
    for path in paths:
        with path.open(encoding="utf-8", newline="") as f:
            lines = list(csv.DictReader(f, delimiter="\t"))
        half = len(lines) // 2
        stored += [row["content"] for row in lines[:half]]
        stored_labels += [f"{path.stem}:{row['event_id']}" for row in lines[:half]]
        queries += [row["content"] for row in lines[half:]]
        labels += [f"{path.stem}:{row['event_id']}" for row in lines[half:]]
    return stored, queries, labels, stored_labels


def built_store(model: str, stored: list[str], work: Path) -> Path:
    """The store (namespace ``NAMESPACE``) built from ``stored`` by ``attnstore build`` at its defaults, built
    once per model and corpus under ``work`` and reused after."""
    digest = hashlib.sha256(json.dumps([model, stored]).encode()).hexdigest()[:16]
    store, marker = work / f"store-{digest}", work / f"store-{digest}.built"
    if not marker.exists():
        corpus = work / "build.jsonl"
        corpus.parent.mkdir(parents=True, exist_ok=True)
        corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in stored), encoding="utf-8")
        subprocess.run([sys.executable, "-m", "attnstore_tools.cli", "build", "--model", model, "--corpus",
                        str(corpus), "--store", str(store), "--namespace", NAMESPACE], check=True)
        marker.write_text("built\n", encoding="utf-8")
    return store


def stored_embeddings(model: str, stored: list[str], work: Path, *, threads: int, batch: int) -> Path:
    """sentence-transformers' embeddings of the stored texts (their ``.npy``): the dict's contents, and the
    template index; computed once per corpus."""
    digest = hashlib.sha256(json.dumps([model, stored]).encode()).hexdigest()[:16]
    path = work / f"stored-{digest}.npy"
    if not path.exists():
        import torch

        from attnstore_client.models import load_model

        torch.set_num_threads(threads)
        pipeline = load_model(model).sentence_transformer
        if pipeline is None:
            raise ConfigError(f"bench: {model!r} has no sentence-transformers configuration")
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, pipeline.encode(stored, batch_size=batch, show_progress_bar=False))
    return path


def _warmup_texts(root: Path) -> list[str]:
    """Texts each child encodes first, untimed: STS-B sentences, none of the call's."""
    with (root / "stsb_dev.tsv").open(encoding="utf-8", newline="") as f:
        return [row["sentence1"] for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)][:_WARMUP_ROWS]


def _children(
    args: argparse.Namespace, methods: list[str], scratch: Path, store: Path, stored_embeddings: Path
) -> dict[str, list[dict[str, Any]]]:
    """Every method's reports, ``--repeats`` children each, run interleaved (one method after the other)."""
    reports: dict[str, list[dict[str, Any]]] = {method: [] for method in methods}
    for repeat in range(args.repeats):
        for method in methods:
            spec = {
                "method": method, "model": args.model, "threads": args.threads, "batch": args.batch,
                "device": args.device,
                "texts": str(scratch / "texts.json"), "warmup": str(scratch / "warmup.json"),
                "store": str(store), "namespace": NAMESPACE, "stored": str(scratch / "stored.json"),
                "stored_embeddings": str(stored_embeddings), "report": str(scratch / f"{method}-{repeat}.json"),
                "embeddings": str(scratch / f"{method}.npy") if repeat == 0 else None,
            }
            path = scratch / f"spec-{method}-{repeat}.json"
            _write_json(path, spec)
            subprocess.run([sys.executable, "-m", "attnstore_tools.bench.encode_child", str(path)], check=True)
            reports[method].append(json.loads(Path(spec["report"]).read_text(encoding="utf-8")))
    return reports


def _summarise(
    count: int, reports: dict[str, list[dict[str, Any]]], scratch: Path, stored_embeddings: np.ndarray,
    stored_labels: list[str] | None, labels: list[str] | None,
) -> dict[str, Any]:
    """One N's figures: medians per method, speedups, fidelity."""
    methods: dict[str, dict[str, Any]] = {}
    for method, runs in reports.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        entry: dict[str, Any] = {
            "seconds": seconds, "seconds_runs": [r["seconds"] for r in runs], "rows_per_s": count / seconds,
            "peak_rss_bytes": statistics.median(r["peak_rss_bytes"] for r in runs),
            "peak_rss_runs": [r["peak_rss_bytes"] for r in runs],
        }
        if method.startswith("attnstore"):
            stats = [r["stats"] for r in runs]
            entry["overhead_s"] = statistics.median(s["overhead_s"] for s in stats)
            entry["overhead_share"] = statistics.median(s["overhead_s"] / s["total_s"] for s in stats)
            entry["retrieval_s"] = statistics.median(s["projection_s"] + s["lookup_s"] + s["fetch_s"] for s in stats)
            entry["stats"] = stats[0]
            entry["linear_kernels"] = runs[0]["linear_kernels"]
        methods[method] = entry
    result: dict[str, Any] = {"rows": count, "methods": methods}
    embeddings = {m: np.load(scratch / f"{m}.npy") for m in reports}
    reference = embeddings.get("sentence_transformers")
    if labels is not None and stored_labels is not None:
        result["template_accuracy"] = {
            m: _template_accuracy(e, stored_embeddings, stored_labels, labels) for m, e in embeddings.items()
        }
    for method, entry in methods.items():
        if not method.startswith("attnstore"):
            continue
        if reference is not None:
            cosines = _cosines(embeddings[method], reference)
            entry["frac_cos_099"] = float(np.mean(cosines >= 0.99))
            entry["min_cos"] = float(cosines.min())
        excluding = entry["seconds"] - entry["retrieval_s"]
        for base in ("sentence_transformers", "dict"):
            if base in methods:
                entry[f"speedup_vs_{base}"] = methods[base]["seconds"] / entry["seconds"]
                entry[f"speedup_vs_{base}_excluding_retrieval"] = methods[base]["seconds"] / excluding
                entry[f"rss_vs_{base}"] = entry["peak_rss_bytes"] / methods[base]["peak_rss_bytes"]
    # AttnCache at its defaults, the headline: its figures at the top level too.
    result.update({k: v for k, v in methods.get("attnstore", {}).items()
                   if k.startswith(("speedup_", "rss_")) or k in ("frac_cos_099", "min_cos")})
    return result


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.sum(a * b, axis=1)


def _template_accuracy(
    queries: np.ndarray, stored: np.ndarray, stored_labels: list[str], labels: list[str]
) -> float:
    """Each query takes the template of its nearest stored line (cosine); the share right."""
    index = stored / np.linalg.norm(stored, axis=1, keepdims=True)
    unit = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    right = 0
    for start in range(0, len(unit), 4096):
        nearest = np.argmax(unit[start : start + 4096] @ index.T, axis=1)
        right += sum(stored_labels[j] == labels[start + k] for k, j in enumerate(nearest))
    return right / len(unit)


def _print(result: dict[str, Any]) -> None:
    print(f"N = {result['rows']}")
    print(f"  {'method':24} {'seconds':>9} {'rows/s':>9} {'peak RSS MiB':>13} {'outside tiers':>14}")
    for method, entry in result["methods"].items():
        outside = f"{entry['overhead_s']:.2f} s ({entry['overhead_share']:.1%})" if "overhead_s" in entry else "-"
        kernels = f" (linear layers on {entry['linear_kernels']})" if "linear_kernels" in entry else ""
        print(f"  {method:24} {entry['seconds']:9.2f} {entry['rows_per_s']:9.1f}"
              f" {entry['peak_rss_bytes'] / 2**20:13.0f} {outside:>14}{kernels}")
    for method, entry in result["methods"].items():
        for base in ("dict", "sentence_transformers"):
            if f"speedup_vs_{base}" in entry:
                print(f"  {method} vs {base}: {entry[f'speedup_vs_{base}']:.2f}x including retrieval,"
                      f" {entry[f'speedup_vs_{base}_excluding_retrieval']:.2f}x excluding it;"
                      f" peak RSS {entry[f'rss_vs_{base}']:.2f}x")
    for method, entry in result["methods"].items():
        if "frac_cos_099" in entry:
            print(f"  {method} fidelity: {entry['frac_cos_099']:.2%} of rows at cosine >= 0.99,"
                  f" min {entry['min_cos']:.4f}")
    if "template_accuracy" in result:
        print("  template accuracy: " + ", ".join(f"{m} {a:.2%}" for m, a in result["template_accuracy"].items()))


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = [r["rows"] for r in report["results"]]
    fig, (time_ax, rss_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for method in report["results"][0]["methods"]:
        time_ax.plot(counts, [r["methods"][method]["seconds"] for r in report["results"]], "o-", label=method)
        rss_ax.plot(counts, [r["methods"][method]["peak_rss_bytes"] / 2**20 for r in report["results"]], "o-",
                    label=method)
    for ax, label in ((time_ax, "seconds (one encode call)"), (rss_ax, "peak RSS of the process (MiB)")):
        ax.set_xscale("log")
        ax.set_xticks(counts, [f"{n:,}" for n in counts])  # the measured counts only: minor labels overlap
        ax.minorticks_off()
        ax.set_xlabel("rows in the call (N)")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"bench encode: {report['data']}, {report['model']}, {report['threads']} torch threads")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data), encoding="utf-8")
