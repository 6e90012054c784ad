"""``attnstore bench rerank``: retrieval-shaped rerank requests from N concurrent clients against the node and two
baseline servers.

    attnstore bench rerank --model smollm2 --clients 1 32 --requests 48 --json rerank.json --plot rerank.png

Requests are a retrieval pipeline's second stage, from STS-B's test split: a query
(one of ``--queries`` first sentences) and ``--min-documents`` to
``--max-documents`` candidate passages (of a pool of ``--passages`` second
sentences), both drawn by a Zipf popularity (``--zipf``), so popular queries and
passages recur across requests as they do in a search service. Each is posted to
``/v1/rerank`` (Cohere's shape) and reranked by a decoder with Qwen3-Reranker's
prompt (``RerankTemplate``: instruction, query, then the document; P("yes")).
Three servers, the same HTTP layer (``attnstore_node``'s app) and the same
requests:

- ``node``: ``attnstore node`` over an empty embedded store: each request's
  instruction and query computed once for all its documents, requests merged
  into calls;
- ``plain``: each request's prompts through the plain transformers forward, one
  request at a time (``bench score``'s plain server);
- ``cached``: ``plain`` with a dict of prompt tokens -> scores in front (a pair
  seen before is not computed again).

Per server and client count: documents/s (items/s), p50/p99 request latency,
errors, the node's tokens computed per real token, and against ``plain``: whether
every request's ranking is the same and the largest score difference. A table,
JSON with ``--json``, a plot with ``--plot``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from attnstore.errors import ConfigError
from attnstore_tools.arguments import documented_parser
from attnstore_tools.bench.score import DATA, Server, _metric, _store, run_clients

log = logging.getLogger(__name__)


def retrieval_requests(requests: int, *, queries: int, passages: int, documents: tuple[int, int], zipf: float,
                       seed: int = 0) -> list[dict[str, Any]]:
    """``/v1/rerank`` bodies: a query and its candidate passages, each drawn by a Zipf popularity of exponent
    ``zipf`` over the first ``queries`` first sentences and ``passages`` second sentences of STS-B's test split."""
    lines = (DATA / "stsb_test.tsv").read_text(encoding="utf-8").splitlines()[1:]
    pairs = [line.split("\t") for line in lines if line.count("\t") >= 2]
    query_pool = list(dict.fromkeys(pair[1] for pair in pairs))[:queries]
    passage_pool = list(dict.fromkeys(pair[2] for pair in pairs))[:passages]
    rng = np.random.default_rng(seed)

    def popularity(n: int) -> np.ndarray:
        weights = 1.0 / np.arange(1, n + 1) ** zipf
        return weights / weights.sum()

    by_query, by_passage = popularity(len(query_pool)), popularity(len(passage_pool))
    bodies = []
    for _ in range(requests):
        query = query_pool[int(rng.choice(len(query_pool), p=by_query))]
        count = int(rng.integers(documents[0], documents[1] + 1))
        picked = rng.choice(len(passage_pool), size=min(count, len(passage_pool)), replace=False, p=by_passage)
        bodies.append({"query": query, "documents": [passage_pool[int(i)] for i in picked]})
    return bodies


def _by_index(body: Any) -> list[float]:
    """A ``/v1/rerank`` answer's scores in the request's document order."""
    results = body["results"]
    scores = [0.0] * len(results)
    for result in results:
        scores[result["index"]] = result["relevance_score"]
    return scores


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every server at every client count, the same requests each time (a fresh server per count)."""
    bodies = retrieval_requests(max(args.requests, *args.clients), queries=args.queries, passages=args.passages,
                                documents=(args.min_documents, args.max_documents), zipf=args.zipf, seed=args.seed)
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="attnstore-bench-rerank-") as tmp:
        from attnstore_client.models import load_model
        from attnstore_client.rerank import RerankTemplate

        loaded = load_model(args.model)
        store = _store(loaded, Path(tmp) / "store")
        template = RerankTemplate()
        tokens_of = {}
        for body in bodies:
            for document in body["documents"]:
                prompt = template.prompt(body["query"], document)
                if prompt not in tokens_of:
                    tokens_of[prompt] = len(loaded.tokenizer(prompt)["input_ids"])
        lengths = [sum(tokens_of[template.prompt(body["query"], d)] for d in body["documents"]) for body in bodies]
        for method in args.methods:
            for clients in args.clients:
                run_bodies = bodies[: max(args.requests, clients)]
                tokens = sum(lengths[: len(run_bodies)])
                workdir = Path(tmp) / f"{method}-{clients}"
                workdir.mkdir()
                if method == "node":
                    command = [sys.executable, "-m", "attnstore_tools.cli", "node", "--model", args.model, "--store",
                               store, "--threads", str(args.threads)]
                else:
                    command = [sys.executable, "-m", "attnstore_tools.bench.score", "serve", "--method", method,
                               "--model", args.model, "--threads", str(args.threads)]
                server = Server(command, workdir).start()
                try:
                    before = _metric(server.url, "attnstore_node_forward_tokens_total") if method == "node" else 0
                    row = asyncio.run(run_clients(server.url, run_bodies, clients, route="/v1/rerank",
                                                  items="documents", read=_by_index))
                    if method == "node":
                        row["computed_per_token"] = (_metric(server.url, "attnstore_node_forward_tokens_total")
                                                     - before) / tokens
                finally:
                    server.stop()
                row["method"], row["requests"], row["tokens"] = method, len(run_bodies), tokens
                results.setdefault(method, []).append(row)
                log.info("%s clients=%d documents/s=%.2f", method, clients, row["items_per_s"])
    _compare(results)
    return {"model": args.model, "requests": args.requests, "documents": [args.min_documents, args.max_documents],
            "queries": args.queries, "passages": args.passages, "zipf": args.zipf, "threads": args.threads,
            "distinct_pairs": len(tokens_of), "pairs": sum(len(body["documents"]) for body in bodies),
            "results": results}


def _compare(results: dict[str, list[dict[str, Any]]]) -> None:
    """Each run's answers against ``plain``'s at the same client count: the same ranking of every request, and the
    largest score difference."""
    reference = {row["clients"]: row["scores"] for row in results.get("plain", [])}
    for rows in results.values():
        for row in rows:
            expected = reference.get(row["clients"])
            if expected is None or None in row["scores"] or None in expected:
                row["same_ranking"], row["max_diff"] = None, None
                continue
            row["same_ranking"] = all(np.argsort(-np.array(a), kind="stable").tolist()
                                      == np.argsort(-np.array(b), kind="stable").tolist()
                                      for a, b in zip(row["scores"], expected, strict=True))
            row["max_diff"] = max(float(np.abs(np.array(a) - np.array(b)).max())
                                  for a, b in zip(row["scores"], expected, strict=True))


def _speedups(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per client count, the node's documents/s over each baseline's and its p99 against theirs."""
    by = {(row["method"], row["clients"]): row for rows in report["results"].values() for row in rows}
    out = []
    for (method, clients), node in sorted(by.items()):
        if method != "node":
            continue
        line: dict[str, Any] = {"clients": clients}
        for baseline in ("plain", "cached"):
            other = by.get((baseline, clients))
            if other is not None:
                line[f"x_{baseline}"] = node["items_per_s"] / other["items_per_s"]
                line[f"p99_vs_{baseline}"] = node["p99_ms"] / other["p99_ms"]
        out.append(line)
    return out


def _table(report: dict[str, Any]) -> str:
    lines = [f"{'server':8} {'clients':>7} {'requests':>8} {'docs/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6} "
             f"{'computed/token':>14} {'same rank':>9} {'max diff':>9}"]
    for rows in report["results"].values():
        for row in rows:
            computed, diff = row.get("computed_per_token"), row.get("max_diff")
            lines.append(f"{row['method']:8} {row['clients']:7d} {row['requests']:8d} {row['items_per_s']:8.2f} "
                         f"{row['p50_ms']:8.0f} {row['p99_ms']:8.0f} {row['errors']:6d} "
                         f"{'' if computed is None else f'{computed:.3f}':>14} {str(row.get('same_ranking')):>9} "
                         f"{'' if diff is None else f'{diff:.1e}':>9}")
    for line in report["speedups"]:
        lines.append(f"node at {line['clients']} clients: " + ", ".join(
            f"{line[f'x_{b}']:.2f}x {b}'s documents/s, p99 {line[f'p99_vs_{b}']:.2f}x {b}'s"
            for b in ("plain", "cached") if f"x_{b}" in line))
    return "\n".join(lines)


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (items_ax, p99_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for method, rows in report["results"].items():
        counts = [row["clients"] for row in rows]
        items_ax.plot(counts, [row["items_per_s"] for row in rows], "o-", label=method)
        p99_ax.plot(counts, [row["p99_ms"] / 1000 for row in rows], "o-", label=method)
    for ax, label in ((items_ax, "documents/s"), (p99_ax, "p99 request latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.legend()
    low, high = report["documents"]
    fig.suptitle(f"bench rerank: STS-B, {low}-{high} documents per query, {report['model']}, "
                 f"{report['threads']} torch threads per server")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``rerank`` to the ``bench`` group."""
    parser = documented_parser(subparsers, "rerank", __doc__,
                               summary="/v1/rerank from concurrent clients: the node, a plain and a cached server")
    parser.add_argument("--model", default="smollm2", help="alias or local model path of a causal model")
    parser.add_argument("--methods", nargs="+", default=["node", "plain", "cached"],
                        choices=("node", "plain", "cached"), help="servers to run (default: all three)")
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 32],
                        help="concurrent clients, one run each (default: 1 32)")
    parser.add_argument("--requests", type=int, default=48,
                        help="rerank requests per run, at least one per client (default 48)")
    parser.add_argument("--min-documents", type=int, default=20, help="candidate passages per query, at least")
    parser.add_argument("--max-documents", type=int, default=50, help="candidate passages per query, at most")
    parser.add_argument("--queries", type=int, default=200, help="the pool of queries drawn from")
    parser.add_argument("--passages", type=int, default=1000, help="the pool of passages drawn from")
    parser.add_argument("--zipf", type=float, default=1.0, help="popularity exponent of queries and passages")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each server")
    parser.add_argument("--seed", type=int, default=0, help="seeds the requests")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="write a PNG of documents/s and p99 latency against clients here")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table, write the JSON and the plot; returns the exit code."""
    if min(args.requests, args.min_documents, args.queries, args.passages, *args.clients) < 1 or (
            args.max_documents < args.min_documents):
        raise ConfigError("bench rerank: --requests, --clients, --queries, --passages and --min-documents must be"
                         " >= 1, and --max-documents >= --min-documents")
    report = bench(args)
    report["speedups"] = _speedups(report)
    print(_table(report))
    if args.plot is not None:
        _plot(report, args.plot)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1), encoding="utf-8")
    return 0
