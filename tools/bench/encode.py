"""``attnstore bench encode``: one ``encode()`` call of N rows, at the scale users run it, time and peak memory.

Methods, each in a child process of its own (``encode_child``), on the
same texts in one call, with ``--threads`` torch threads: sentence-transformers'
``encode``; a dict of the stored texts' embeddings in front of it (the distinct
misses encoded in one call: what a user writes first); ``AttnCache.encode`` in
embedded mode on a store built by ``attnstore build`` at its defaults
(``attnstore``), and, when asked for, the same without its map tier
(``attnstore_exact``: what the map tier costs or earns on the call), with ``int8=True`` (``attnstore_int8``:
computed rows on the int8 plan ``attnstore build --int8`` chose on the stored lines; ``attnstore_int8_auto``,
``attnstore_int8_openvino``: the same with engine ``auto`` or ``openvino``, whose int8 rows may run on the plan's
int8 OpenVINO graph) or auditing ``--audit-rate``
of its exact hits (``attnstore_audit``: what the audit costs, beside ``attnstore``, which audits none), or with its
compute tier on another engine (``attnstore_auto``, ``attnstore_openvino``, ``attnstore_onnxruntime``:
``CacheSettings.engine``, its graphs exported and its choice timed in the child's untimed warm-up); and, when
asked for, the
peers users run
instead (``bench.peers``, the ``peers`` extra): ONNX Runtime on the fp32 graph (``onnx_fp32``), the graph
optimised at O3 (``onnx_o3``) and the dynamically quantised int8 graph (``onnx_int8``), and OpenVINO fp32
(``openvino``), each bare or behind the same dict (``onnx_o3_dict``, ...); their graphs are exported once into
``--peers-cache`` before the children start. Per N:
seconds (median of ``--repeats`` children per method, run interleaved), peak RSS
(each child's own ``VmHWM``: its ``ru_maxrss`` would carry this process's) and its anonymous and file-backed
memory apart (``RssAnon``, ``RssFile``: before the call and at their peak in it), AttnCache's time outside the tiers
(``CacheStats.overhead_s``) and its retrieval (projection, lookups, fetches),
speedups against both (excluding and including retrieval) and, for every method, against the fastest exact
peer behind a dict (``onnx_fp32_dict``, ``onnx_o3_dict`` or ``openvino_dict``, whichever ran fastest), and
fidelity: for every method, the share of rows whose embedding has cosine >= 0.99 to sentence-transformers' (or,
without that method, the dict's: the same vectors) and the minimum cosine, and
for the logs the template accuracy of each (each query takes the template of its
nearest stored line, by sentence-transformers' embeddings of the stored lines).

Data (``--data``):

- ``logs``: the 8 Loghub systems of ../shared/data/loghub; the store is built from
  each system's first 1,000 lines, the call's rows are the last 1,000 of each
  (8,000 lines), repeated or cut to N;
- ``sst2``: SST-2 train; the store is built from its first 2,000 sentences (as
  ``attnstore eval sst2`` builds it), the call's rows are its sentences in file
  order, cut (or repeated) to N.

``--store-rows K`` builds the store from the first K lines of each system (``logs``) or the first K sentences
(``sst2``) instead, and the call's rows are the lines or sentences after them: a store of 25,000 SST-2
sentences (1.5 GB) under a call of 20,000 others is how memory is measured against the store's size.

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
from attnstore_tools.arguments import DEFAULT_NODE_AUDIT_RATE, audit_rate, documented_parser, positive_ints
from attnstore_tools.bench.peers_export import PeerName, default_cache_dir
from attnstore_tools.corpus import DATA_HELP, data_dir
from attnstore_tools.machine import cpu_model
from attnstore_tools.output import write_json

# A peer method's peer (bench.peers); each also behind the dict, as METHOD_dict.
PEER_METHODS: dict[str, PeerName] = {
    "onnx_fp32": "onnx_fp32", "onnx_o3": "onnx_o3", "onnx_int8": "onnx_int8", "openvino": "openvino_fp32",
}
# Peers whose vectors equal the model's within fp32 rounding (O3's GELU approximation included): the baselines
# an exact cache must beat. int8 is not one.
EXACT_PEERS = ("onnx_fp32", "onnx_o3", "openvino")
# AttnCache with its compute tier on another engine (``CacheSettings.engine``): method -> engine.
ENGINE_METHODS = {"attnstore_auto": "auto", "attnstore_openvino": "openvino", "attnstore_onnxruntime": "onnxruntime"}
# AttnCache with ``int8=True`` on each engine its int8 rows may run on: method -> engine.
INT8_METHODS = {"attnstore_int8": "torch", "attnstore_int8_auto": "auto", "attnstore_int8_openvino": "openvino"}
METHODS = ("sentence_transformers", "dict", "attnstore", "attnstore_exact", "attnstore_int8",
           *(f"{peer}{suffix}" for peer in PEER_METHODS for suffix in ("", "_dict")), "attnstore_audit",
           *ENGINE_METHODS, "attnstore_int8_auto", "attnstore_int8_openvino")
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
                   help=f"comma-separated, of {', '.join(METHODS)} (default: the first three; the peers need the"
                        " peers extra)")
    p.add_argument("--store-rows", type=int, default=None,
                   help="build the store from the first K lines of each system (logs) or sentences (sst2) and"
                        " query the ones after them (default: see above)")
    p.add_argument("--model", default="minilm", help="a sentence-transformers model alias or path")
    p.add_argument("--audit-rate", type=audit_rate, default=DEFAULT_NODE_AUDIT_RATE,
                   help="the share of its exact hits the attnstore_audit method recomputes and compares (the other"
                   " attnstore methods audit none)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each child")
    p.add_argument("--batch", type=int, default=32, help="batch_size of every encode call")
    p.add_argument("--device", default="cpu", help="where every method's model runs (cpu, cuda)")
    p.add_argument("--data-dir", type=Path, default=None, help=DATA_HELP)
    p.add_argument("--work-dir", type=Path, default=Path("runs/bench-encode"), help="where the built store is kept")
    p.add_argument("--peers-cache", type=Path, default=None,
                   help="where the peers' exported graphs are kept (default: $ATTNSTORE_PEERS_CACHE or"
                        " ~/.cache/attnstore/peers)")
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
    if args.device != "cpu" and any(map(peer_method, methods)):
        raise ConfigError(f"bench encode: the peers run on the CPU only; --device {args.device!r} with --methods"
                          f" {args.methods!r}")
    stored, queries, labels, stored_labels = load_data(args.data, data_dir(args.data_dir), args.store_rows)
    work = args.work_dir / args.data
    # Exported (or found in the cache) first: a missing peers extra is said before the store is built.
    graphs = peer_graphs(args.model, methods, args.peers_cache or default_cache_dir())
    # Only AttnCache reads the store: a run of the other methods builds none.
    store = (built_store(args.model, stored, work, int8=bool(set(INT8_METHODS) & set(methods)))
             if any(m.startswith("attnstore") for m in methods) else None)
    store_bytes = None if store is None else sum(f.stat().st_size for f in store.rglob("*") if f.is_file())
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
            reports = _children(args, methods, scratch, store, embeddings_path, graphs)
            results.append(_summarise(count, reports, scratch, stored_vectors, stored_labels, row_labels))
            _print(results[-1], store_bytes)
    report = {
        "data": args.data, "model": args.model, "threads": args.threads, "batch": args.batch, "device": args.device,
        "repeats": args.repeats, "cpu": cpu_model(), "stored_rows": len(stored), "store_bytes": store_bytes,
        "results": results,
        "peer_graphs": {peer: str(path) for peer, path in graphs.items()},
    }
    if args.json is not None:
        write_json(args.json, report)
    if args.plot is not None:
        _plot(report, args.plot)
    return 0



def load_data(
    data: str, root: Path, store_rows: int | None = None
) -> tuple[list[str], list[str], list[str] | None, list[str] | None]:
    """Stored texts, query texts, and (logs) each query's and each stored text's template (see the module
    docstring: the logs' first halves are stored, their second halves are the queries; with ``store_rows``, the
    first ``store_rows`` lines of each system or sentences are stored and the ones after them are the queries).

    Raises:
        ConfigError: no Loghub files under ``root``, or ``store_rows`` leaves no query.
    """
    if store_rows is not None and store_rows < 1:
        raise ConfigError(f"bench encode: --store-rows must be >= 1, got {store_rows}")
    if data == "sst2":
        path = root / "sst2_train.tsv"
        with path.open(encoding="utf-8", newline="") as f:
            sentences = [row["sentence"] for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]
        if store_rows is None:
            return sentences[:_SST2_BUILD], sentences, None, None
        if store_rows >= len(sentences):
            raise ConfigError(f"bench encode: --store-rows {store_rows} leaves no query of the {len(sentences)}"
                              " SST-2 sentences")
        return sentences[:store_rows], sentences[store_rows:], None, None
    stored, queries, labels, stored_labels = [], [], [], []
    paths = sorted((root / "loghub").glob("*.tsv"))
    if not paths:
        raise ConfigError(f"bench encode: no Loghub .tsv files in {root / 'loghub'}")
    for path in paths:
        with path.open(encoding="utf-8", newline="") as f:
            lines = list(csv.DictReader(f, delimiter="\t"))
        half = len(lines) // 2 if store_rows is None else store_rows
        if half >= len(lines):
            raise ConfigError(f"bench encode: --store-rows {store_rows} leaves no query of {path.name}'s"
                              f" {len(lines)} lines")
        stored += [row["content"] for row in lines[:half]]
        stored_labels += [f"{path.stem}:{row['event_id']}" for row in lines[:half]]
        queries += [row["content"] for row in lines[half:]]
        labels += [f"{path.stem}:{row['event_id']}" for row in lines[half:]]
    return stored, queries, labels, stored_labels


def built_store(model: str, stored: list[str], work: Path, *, int8: bool = False) -> Path:
    """The store (namespace ``NAMESPACE``) built from ``stored`` by ``attnstore build`` at its defaults, built
    once per model and corpus under ``work`` and reused after; with ``int8``, its int8 plan chosen on ``stored``
    too (``attnstore build --int8`` on the built namespace: it adds the plan, and no entry)."""
    digest = hashlib.sha256(json.dumps([model, stored]).encode()).hexdigest()[:16]
    store = work / f"store-{digest}"
    corpus = work / "build.jsonl"
    # The int8 marker names the plan's kind: a plan made before plans named graph layers is made again.
    for extra, marker in (((), work / f"store-{digest}.built"), (("--int8",), work / f"store-{digest}.int8-graph")):
        if marker.exists() or (extra and not int8):
            continue
        corpus.parent.mkdir(parents=True, exist_ok=True)
        corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in stored), encoding="utf-8")
        subprocess.run([sys.executable, "-m", "attnstore_tools.cli", "build", "--model", model, "--corpus",
                        str(corpus), "--store", str(store), "--namespace", NAMESPACE, *extra], check=True)
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


def peer_method(method: str) -> PeerName | None:
    """The peer a method runs (``onnx_o3_dict`` -> ``onnx_o3``), or None for the other methods."""
    return PEER_METHODS.get(method.removesuffix("_dict"))


def peer_graphs(model: str, methods: list[str], cache: Path, *, bench: str = "encode") -> dict[PeerName, Path]:
    """The exported graph of every peer the methods (or ``bench node``'s servers) run, exported here once (the
    children only read them); progress lines on stderr name ``bench``."""
    peers = list(dict.fromkeys(peer for peer in map(peer_method, methods) if peer is not None))
    if not peers:
        return {}
    from attnstore_client.models import load_model
    from attnstore_tools.bench.peers_export import export_graph

    def progress(line: str) -> None:
        print(f"bench {bench}: {line}", file=sys.stderr, flush=True)

    loaded = load_model(model)
    return {peer: export_graph(peer, loaded, cache_dir=cache, progress=progress) for peer in peers}


def _warmup_texts(root: Path) -> list[str]:
    """Texts each child encodes first, untimed: STS-B sentences, none of the call's."""
    with (root / "stsb_dev.tsv").open(encoding="utf-8", newline="") as f:
        return [row["sentence1"] for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)][:_WARMUP_ROWS]


def _children(
    args: argparse.Namespace, methods: list[str], scratch: Path, store: Path | None, stored_embeddings: Path,
    graphs: dict[PeerName, Path],
) -> dict[str, list[dict[str, Any]]]:
    """Every method's reports, ``--repeats`` children each, run interleaved (one method after the other)."""
    reports: dict[str, list[dict[str, Any]]] = {method: [] for method in methods}
    for repeat in range(args.repeats):
        for method in methods:
            spec = {
                "method": method, "model": args.model, "threads": args.threads, "batch": args.batch,
                "device": args.device,
                "texts": str(scratch / "texts.json"), "warmup": str(scratch / "warmup.json"),
                "store": None if store is None else str(store), "namespace": NAMESPACE,
                "stored": str(scratch / "stored.json"),
                "stored_embeddings": str(stored_embeddings), "report": str(scratch / f"{method}-{repeat}.json"),
                "embeddings": str(scratch / f"{method}.npy") if repeat == 0 else None,
                "audit_rate": args.audit_rate if method == "attnstore_audit" else 0.0,
            }
            peer = peer_method(method)
            if peer is not None:
                spec.update(peer=peer, graph=str(graphs[peer]))
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
            # Anonymous and file-backed memory apart, before the call and at their peak in it (medians).
            "memory": {k: statistics.median(r["memory"][k] for r in runs) for k in runs[0]["memory"]},
        }
        if method.startswith("attnstore"):
            stats = [r["stats"] for r in runs]
            entry["overhead_s"] = statistics.median(s["overhead_s"] for s in stats)
            entry["overhead_share"] = statistics.median(s["overhead_s"] / s["total_s"] for s in stats)
            entry["retrieval_s"] = statistics.median(s["projection_s"] + s["lookup_s"] + s["fetch_s"] for s in stats)
            entry["stats"] = stats[0]
            entry["linear_kernels"] = runs[0]["linear_kernels"]
            for key in ("engines", "int8_engines"):
                if runs[0].get(key) is not None:
                    entry[key] = runs[0][key]
        methods[method] = entry
    result: dict[str, Any] = {"rows": count, "methods": methods}
    embeddings = {m: np.load(scratch / f"{m}.npy") for m in reports}
    if labels is not None and stored_labels is not None:
        result["template_accuracy"] = {
            m: _template_accuracy(e, stored_embeddings, stored_labels, labels) for m, e in embeddings.items()
        }
    # The dict's vectors are sentence-transformers' (stored, or its misses computed): the reference without it.
    reference = next((m for m in ("sentence_transformers", "dict") if m in embeddings), None)
    result["fidelity_reference"] = reference
    exact_dicts = [f"{peer}_dict" for peer in EXACT_PEERS if f"{peer}_dict" in methods]
    fastest = min(exact_dicts, key=lambda m: methods[m]["seconds"]) if exact_dicts else None
    result["fastest_exact_peer_dict"] = fastest
    for method, entry in methods.items():
        if reference is not None and method != reference:
            cosines = _cosines(embeddings[method], embeddings[reference])
            entry["frac_cos_099"] = float(np.mean(cosines >= 0.99))
            entry["min_cos"] = float(cosines.min())
        bases = [b for b in ("sentence_transformers", "dict") if b in methods and b != method]
        if fastest is not None and fastest != method:
            bases.append(fastest)
        for base in bases:
            key = "fastest_exact_peer_dict" if base == fastest else base
            entry[f"speedup_vs_{key}"] = methods[base]["seconds"] / entry["seconds"]
            entry[f"rss_vs_{key}"] = entry["peak_rss_bytes"] / methods[base]["peak_rss_bytes"]
            if "retrieval_s" in entry:
                excluding = entry["seconds"] - entry["retrieval_s"]
                entry[f"speedup_vs_{key}_excluding_retrieval"] = methods[base]["seconds"] / excluding
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


def _print(result: dict[str, Any], store_bytes: int | None) -> None:
    fastest = result["fastest_exact_peer_dict"]
    store = "" if store_bytes is None else f"; the store: {store_bytes / 2**20:,.0f} MiB on disk"
    print(f"N = {result['rows']} (fidelity against {result['fidelity_reference'] or 'no reference'};"
          f" fastest exact peer behind a dict: {fastest or 'none run'}{store})")
    print(f"  {'method':24} {'seconds':>9} {'rows/s':>9} {'peak RSS MiB':>13} {'x st+dict':>10}"
          f" {'x fastest':>10} {'cos>=0.99':>10} {'min cos':>8} {'outside tiers':>16}")
    for method, entry in result["methods"].items():
        outside = f"{entry['overhead_s']:.2f} s ({entry['overhead_share']:.1%})" if "overhead_s" in entry else "-"
        share = f"{entry['frac_cos_099']:.2%}" if "frac_cos_099" in entry else "-"
        low = f"{entry['min_cos']:.4f}" if "min_cos" in entry else "-"
        kernels = f" (linear layers on {entry['linear_kernels']})" if "linear_kernels" in entry else ""
        print(f"  {method:24} {entry['seconds']:9.2f} {entry['rows_per_s']:9.1f}"
              f" {entry['peak_rss_bytes'] / 2**20:13.0f} {_ratio(entry, 'dict'):>10}"
              f" {_ratio(entry, 'fastest_exact_peer_dict'):>10} {share:>10} {low:>8} {outside:>16}{kernels}")
    for method, entry in result["methods"].items():
        for base in ("dict", "sentence_transformers", "fastest_exact_peer_dict"):
            if f"speedup_vs_{base}_excluding_retrieval" in entry:
                name = fastest if base == "fastest_exact_peer_dict" else base
                print(f"  {method} vs {name}: {entry[f'speedup_vs_{base}']:.2f}x including retrieval,"
                      f" {entry[f'speedup_vs_{base}_excluding_retrieval']:.2f}x excluding it;"
                      f" peak RSS {entry[f'rss_vs_{base}']:.2f}x")
    print(f"  {'memory (MiB)':24} {'anon before':>12} {'anon peak':>10} {'file before':>12} {'file peak':>10}")
    for method, entry in result["methods"].items():
        memory = {k: v / 2**20 for k, v in entry["memory"].items()}
        print(f"  {method:24} {memory['anon_start']:12.0f} {memory['anon_peak']:10.0f} {memory['file_start']:12.0f}"
              f" {memory['file_peak']:10.0f}")
    for method, entry in result["methods"].items():
        for key, rows in (("engines", ""), ("int8_engines", "int8 ")):
            if entry.get(key):
                bands = ", ".join(f"<={band}: {engine}" for band, engine in zip(entry[key]["bands"],
                                                                               entry[key]["engines"], strict=True))
                print(f"  {method} {rows}engines by forward length: {bands}")
    if "template_accuracy" in result:
        print("  template accuracy: " + ", ".join(f"{m} {a:.2%}" for m, a in result["template_accuracy"].items()))


def _ratio(entry: dict[str, Any], base: str) -> str:
    return f"{entry[f'speedup_vs_{base}']:.2f}" if f"speedup_vs_{base}" in entry else "-"


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
