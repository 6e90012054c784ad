"""``attnstore bench search``: vector search latency of one length bucket, HNSW and flat.

Synthetic vectors stand in for projector outputs: i.i.d. Gaussian (the hardest
case for HNSW recall: no low-dimensional structure) or clustered templates with
near-duplicate queries (closer to templated traffic). Searches go through ``FaissIndex``,
the wrapper the server calls, so validation and id mapping are in the figures.
Latencies are per call; p50/p99 are taken within each run, and the median over
runs is reported. The build is timed once per backend.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
from pathlib import Path

import faiss
import numpy as np

from attnstore.index import FaissIndex, FaissIndexConfig
from attnstore_tools.arguments import positive_int
from attnstore_tools.output import write_json

logger = logging.getLogger(__name__)

TARGET_SINGLE_P50_MS = 0.5  # the paper's figure for one query over 100K vectors
_WARMUP = 20


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``search`` benchmark to the ``bench`` group."""
    parser = subparsers.add_parser("search", help="vector search latency (HNSW and flat), p50/p99")
    parser.add_argument("--n", type=positive_int, default=100_000, help="stored vectors (default: 100000)")
    parser.add_argument("--dim", type=positive_int, default=128, help="vector dimension (default: 128)")
    parser.add_argument("--queries", type=positive_int, default=512, help="queries per run (default: 512)")
    parser.add_argument("--batch", type=positive_int, default=64, help="queries per batched call (default: 64)")
    parser.add_argument("--runs", type=positive_int, default=5, help="timed runs; medians are reported (default: 5)")
    defaults = FaissIndexConfig()
    parser.add_argument(
        "--hnsw-m", type=positive_int, default=defaults.hnsw_m, help=f"HNSW degree (default: {defaults.hnsw_m})"
    )
    parser.add_argument(
        "--ef-construction", type=positive_int, default=defaults.ef_construction,
        help=f"HNSW build beam (default: {defaults.ef_construction})",
    )
    parser.add_argument(
        "--ef-search", type=positive_int, default=defaults.ef_search,
        help=f"HNSW search beam (default: {defaults.ef_search})",
    )
    parser.add_argument(
        "--threads", type=positive_int, default=1,
        help="faiss OpenMP threads while searching (default: 1, one core per search call, as a server serving "
        "concurrent requests runs; more threads make a single query wait on thread wake-ups); builds use all cores",
    )
    parser.add_argument("--no-flat", action="store_true", help="skip the flat (exact) reference")
    parser.add_argument(
        "--data", choices=("gaussian", "clustered"), default="gaussian",
        help="gaussian: i.i.d. vectors and queries, HNSW's worst case; clustered: n/100 templates with "
        "spread-out members, queries are perturbed stored vectors (near-duplicate lookups) (default: gaussian)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random data seed (default: 0)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build the indexes, time the searches, print a table, write JSON; returns 0."""
    build_threads = faiss.omp_get_max_threads()
    try:
        report = _measure(args, build_threads)
    finally:
        faiss.omp_set_num_threads(build_threads)
    _print_table(report)
    if args.json:
        write_json(args.json, report)
    return 0


def _measure(args: argparse.Namespace, build_threads: int) -> dict:
    """Build both indexes from random data (all cores) and time searches (``--threads``); the JSON report."""
    stored, queries = _data(args.data, args.n, args.dim, args.queries, args.seed)
    ids = np.arange(args.n, dtype=np.uint64)
    hnsw_config = FaissIndexConfig(
        hnsw_threshold=1, hnsw_m=args.hnsw_m, ef_construction=args.ef_construction, ef_search=args.ef_search
    )
    backends = {"hnsw": hnsw_config}
    if not args.no_flat:
        backends["flat"] = dataclasses.replace(hnsw_config, hnsw_threshold=args.n + 1)
    results: dict[str, dict[str, float]] = {}
    top1: dict[str, np.ndarray] = {}
    for name, config in backends.items():
        index = FaissIndex(args.dim, config)
        faiss.omp_set_num_threads(build_threads)
        started = time.perf_counter()
        index.add(ids, stored)
        build_s = time.perf_counter() - started
        logger.info("bench search: built %s over %s vectors in %.1f s", name, args.n, build_s)
        faiss.omp_set_num_threads(args.threads)
        results[name] = {"build_s": build_s, **_time_searches(index, queries, args.batch, args.runs)}
        top1[name] = index.search(queries, k=1)[1][:, 0]
    if "flat" in top1:
        for name, found in top1.items():
            results[name]["recall_at_1"] = float((found == top1["flat"]).mean())
    return {
        "n": args.n,
        "dim": args.dim,
        "queries_per_run": args.queries,
        "batch": args.batch,
        "runs": args.runs,
        "cores": os.cpu_count(),
        "torch_threads": _torch_threads(),
        "faiss_build_threads": build_threads,
        "faiss_search_threads": args.threads,
        "data": args.data,
        "hnsw": {"m": args.hnsw_m, "ef_construction": args.ef_construction, "ef_search": args.ef_search},
        "results": results,
        "target_single_p50_ms": TARGET_SINGLE_P50_MS,
        "meets_target": results["hnsw"]["single_p50_ms"] <= TARGET_SINGLE_P50_MS,
    }


def _data(kind: str, n: int, dim: int, queries: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Stored vectors (n, dim) and queries (queries, dim), float32."""
    rng = np.random.default_rng(seed)
    if kind == "gaussian":
        return rng.standard_normal((n, dim), dtype=np.float32), rng.standard_normal((queries, dim), dtype=np.float32)
    centres = rng.standard_normal((max(1, n // 100), dim), dtype=np.float32)
    stored = centres[rng.integers(centres.shape[0], size=n)] + 0.25 * rng.standard_normal((n, dim), dtype=np.float32)
    picked = stored[rng.integers(n, size=queries)]
    return stored, picked + 0.05 * rng.standard_normal((queries, dim), dtype=np.float32)


def _time_searches(index: FaissIndex, queries: np.ndarray, batch: int, runs: int) -> dict[str, float]:
    """Median over runs of per-run p50/p99 latency, single queries and batches."""
    for q in queries[:_WARMUP]:
        index.search(q[None, :], k=1)
    single = [_latencies_ms(index, [q[None, :] for q in queries]) for _ in range(runs)]
    batches = [queries[i : i + batch] for i in range(0, queries.shape[0], batch)]
    batched = [_latencies_ms(index, batches) for _ in range(runs)]
    size = batches[0].shape[0]
    return {
        "single_p50_ms": float(np.median([np.percentile(r, 50) for r in single])),
        "single_p99_ms": float(np.median([np.percentile(r, 99) for r in single])),
        "batch_p50_ms": float(np.median([np.percentile(r, 50) for r in batched])),
        "batch_p99_ms": float(np.median([np.percentile(r, 99) for r in batched])),
        "batch_per_query_p50_ms": float(np.median([np.percentile(r, 50) for r in batched])) / size,
    }


def _latencies_ms(index: FaissIndex, calls: list[np.ndarray]) -> np.ndarray:
    out = np.empty(len(calls))
    for i, queries in enumerate(calls):
        started = time.perf_counter_ns()
        index.search(queries, k=1)
        out[i] = (time.perf_counter_ns() - started) / 1e6
    return out


def _torch_threads() -> int | None:
    """torch's intra-op threads, recorded with every benchmark (torch is not needed to search)."""
    try:
        import torch
    except ImportError:
        return None
    return torch.get_num_threads()


def _print_table(report: dict) -> None:
    print(
        f"bench search: n={report['n']} dim={report['dim']} data={report['data']} "
        f"batch={report['batch']} runs={report['runs']} "
        f"cores={report['cores']} faiss threads: build {report['faiss_build_threads']}, "
        f"search {report['faiss_search_threads']}"
    )
    print(
        f"{'index':<6}{'build s':>9}{'1q p50 ms':>11}{'1q p99 ms':>11}"
        f"{'batch p50 ms':>14}{'batch p99 ms':>14}{'recall@1':>10}"
    )
    for name, row in report["results"].items():
        recall = f"{row['recall_at_1']:.3f}" if "recall_at_1" in row else "-"
        print(
            f"{name:<6}{row['build_s']:>9.2f}{row['single_p50_ms']:>11.3f}{row['single_p99_ms']:>11.3f}"
            f"{row['batch_p50_ms']:>14.3f}{row['batch_p99_ms']:>14.3f}{recall:>10}"
        )
    verdict = "meets" if report["meets_target"] else "MISSES"
    print(f"HNSW single-query p50 {verdict} the {report['target_single_p50_ms']} ms target")
