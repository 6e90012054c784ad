"""``attnstore bench rerank``: retrieval-shaped rerank requests from N concurrent clients against the node and the
baseline servers users run instead, for a decoder reranker or a cross-encoder.

    attnstore bench rerank --model smollm2 --clients 1 32 --requests 48 --json rerank.json --plot rerank.png
    attnstore bench rerank --model cross-minilm --clients 32 --requests 48 --json rerank-ce.json

Requests are a retrieval pipeline's second stage, from STS-B's test split: a query
(one of ``--queries`` first sentences) and ``--min-documents`` to
``--max-documents`` candidate passages (of a pool of ``--passages`` second
sentences), both drawn by a Zipf popularity (``--zipf``), so popular queries and
passages recur across requests as they do in a search service. Each is posted to
``/v1/rerank`` (Cohere's shape). Every server is the same HTTP layer
(``attnstore_node``'s app) answering the same requests.

A decoder (``--model smollm2`` or a causal folder) reranks with Qwen3-Reranker's
prompt (``RerankTemplate``: instruction, query, then the document; P("yes")):

- ``node``: ``attnstore node`` over an empty embedded store: each request's
  instruction and query computed once for all its documents, requests merged
  into calls;
- ``plain``: each request's prompts through the plain transformers forward, one
  request at a time (``bench score``'s plain server);
- ``cached``: ``plain`` with a dict of prompt tokens -> scores in front (a pair
  seen before is not computed again).

A cross-encoder (any ``*ForSequenceClassification`` or ``CrossEncoder`` folder, or
``--model cross-minilm``) scores each (query, document) pair as ``CrossEncoder.rank``
does, its own activation after its logit (``bench.cross_encoder_server``):

- ``node``: ``attnstore node`` over an embedded store with an exact-tier namespace
  (empty: a pair seen before is served from the tier), requests merged into calls;
- ``plain``: each request's pairs through ``CrossEncoder.predict``, one request at a
  time; ``cached`` (not run by default): the same behind a dict of pair -> logits;
- ``onnx_fp32_dict``, ``onnx_o3_dict``, ``openvino_dict`` (those whose runtime is
  installed: the ``peers`` extra): the base transformer's exported graph
  (``bench.peers_export``, kept in ``--peers-cache``) in ONNX Runtime or OpenVINO,
  the cross-encoder's own head (pooler and classifier) in torch after it, behind a
  dict of pair -> logits, the exact cache users put in front, one request at a time.

``cross-minilm`` is built here, as no trained cross-encoder's weights are at hand:
``BertForSequenceClassification`` of one label on all-MiniLM-L6-v2's encoder (its
weights) with the head initialised from a fixed seed, saved with its tokenizer under
``--work-dir`` (reused after), the activation ms-marco's saves (Identity): the shape
of cross-encoder/ms-marco-MiniLM-L6-v2 (6 layers, 384 wide, pooler and one-logit
classifier). Its timings are that architecture's; its scores are not a trained
reranker's.

Per server and client count: documents/s (items/s), p50/p99 request latency,
errors, the node's tokens computed per real token, and against ``plain``: whether
every request's ranking is the same and the largest score difference; the node's
speedup over every baseline and, for a cross-encoder, over the fastest
``<peer>_dict`` (named). A table, JSON with ``--json``, a plot with ``--plot``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from attnstore.errors import ConfigError
from attnstore_tools.arguments import documented_parser
from attnstore_tools.bench.encode import EXACT_PEERS, peer_method
from attnstore_tools.bench.score import DATA, Server, _metric, _store, plot_by_clients, run_clients, speedups
from attnstore_tools.machine import status_bytes

log = logging.getLogger(__name__)

CROSS_MINILM = "cross-minilm"  # the bench's own cross-encoder, built by ``cross_minilm``
CROSS_MINILM_NOTE = ("cross-minilm: all-MiniLM-L6-v2's encoder with a seeded, untrained one-logit head, the shape of"
                     " cross-encoder/ms-marco-MiniLM-L6-v2: timings are that architecture's; scores are not a trained"
                     " reranker's")
PEER_DICTS = tuple(f"{peer}_dict" for peer in EXACT_PEERS)  # onnx_fp32_dict, onnx_o3_dict, openvino_dict
METHODS = ("node", "plain", "cached", *PEER_DICTS)
DECODER_METHODS = ("node", "plain", "cached")
_RUNTIMES = {"onnx_fp32_dict": "onnxruntime", "onnx_o3_dict": "onnxruntime", "openvino_dict": "openvino"}


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


def cross_minilm(folder: Path, source: str = "minilm") -> Path:
    """The bench's cross-encoder in ``folder``, built there once (reused after): ``BertForSequenceClassification``
    of one label on ``source``'s encoder weights (all-MiniLM-L6-v2's), its head initialised from seed 0, and
    ms-marco-MiniLM-L6-v2's saved activation (Identity: its scores are the logits), with the tokenizer.

    Raises:
        ConfigError: ``source`` is not a known model.
    """
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    from attnstore_client.models import resolve_model_path

    path = resolve_model_path(source)
    torch.manual_seed(0)  # the classifier (and any pooler the encoder lacks) initialised alike on every build
    model = BertForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    model.config.sbert_ce_default_activation_function = "torch.nn.modules.linear.Identity"
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        model.save_pretrained(scratch)
        AutoTokenizer.from_pretrained(path).save_pretrained(scratch)
        try:
            os.rename(scratch, folder)
        except OSError:
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log.info("built %s from %s's encoder in %s", CROSS_MINILM, source, folder)
    return folder


def _by_index(body: Any) -> list[float]:
    """A ``/v1/rerank`` answer's scores in the request's document order."""
    results = body["results"]
    scores = [0.0] * len(results)
    for result in results:
        scores[result["index"]] = result["relevance_score"]
    return scores


def _methods(args: argparse.Namespace, cross_encoder: bool) -> list[str]:
    """The servers to run: ``--methods``, else the kind's defaults (for a cross-encoder the peers whose runtime is
    installed).

    Raises:
        ConfigError: a peer for a decoder.
    """
    if args.methods is None:
        if not cross_encoder:
            return list(DECODER_METHODS[:3])
        return ["node", "plain", *(m for m in PEER_DICTS if importlib.util.find_spec(_RUNTIMES[m]) is not None)]
    methods = list(dict.fromkeys(args.methods))
    if not cross_encoder and set(methods) - set(DECODER_METHODS):
        raise ConfigError(f"bench rerank: --methods {sorted(set(methods) - set(DECODER_METHODS))} run a"
                          f" cross-encoder; {args.model!r} is a decoder: choose of {list(DECODER_METHODS)}")
    return methods


def _pair_tokens(loaded: Any, bodies: list[dict[str, Any]], cross_encoder: bool) -> tuple[list[int], int]:
    """Each body's tokens (its documents' prompts, or its pairs as ``CrossEncoder`` tokenizes them) and the number
    of distinct (query, document) pairs."""
    from attnstore_client.rerank import RerankTemplate

    template = RerankTemplate()
    tokens_of: dict[tuple[str, str], int] = {}
    for body in bodies:
        for document in body["documents"]:
            if (body["query"], document) in tokens_of:
                continue
            encoded = (loaded.tokenizer(body["query"], document, truncation="longest_first") if cross_encoder
                       else loaded.tokenizer(template.prompt(body["query"], document)))
            tokens_of[(body["query"], document)] = len(encoded["input_ids"])
    return [sum(tokens_of[(body["query"], d)] for d in body["documents"]) for body in bodies], len(tokens_of)


def _command(method: str, model: str, store: str, threads: int, cross_encoder: bool,
             graphs: dict[str, Path]) -> list[str]:
    """The server process of ``method``."""
    if method == "node":
        return [sys.executable, "-m", "attnstore_tools.cli", "node", "--model", model, "--store", store, "--threads",
                str(threads)]
    if cross_encoder:
        peer = peer_method(method) if method in PEER_DICTS else None
        return [sys.executable, "-m", "attnstore_tools.bench.cross_encoder_server", "--method", method, "--model",
                model, "--threads", str(threads), *(["--graph", str(graphs[peer])] if peer else [])]
    return [sys.executable, "-m", "attnstore_tools.bench.score", "serve", "--method", method, "--model", model,
            "--threads", str(threads)]


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every server at every client count, the same requests each time (a fresh server per count)."""
    bodies = retrieval_requests(max(args.requests, *args.clients), queries=args.queries, passages=args.passages,
                                documents=(args.min_documents, args.max_documents), zipf=args.zipf, seed=args.seed)
    model = str(cross_minilm(args.work_dir / CROSS_MINILM)) if args.model == CROSS_MINILM else args.model
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="attnstore-bench-rerank-") as tmp:
        from attnstore_client.models import load_model

        loaded = load_model(model)
        cross_encoder = loaded.classifier is not None
        methods = _methods(args, cross_encoder)
        store = _store(loaded, Path(tmp) / "store")
        lengths, distinct = _pair_tokens(loaded, bodies, cross_encoder)
        graphs: dict[str, Path] = {}
        peers = [peer for peer in (peer_method(m) for m in methods if m in PEER_DICTS) if peer is not None]
        if peers:
            from attnstore_tools.bench.cross_encoder_peers import pair_graphs
            from attnstore_tools.bench.peers_export import default_cache_dir

            graphs = dict(pair_graphs(loaded, peers, args.peers_cache or default_cache_dir()))
        del loaded
        for method in methods:
            for clients in args.clients:
                run_bodies = bodies[: max(args.requests, clients)]
                tokens = sum(lengths[: len(run_bodies)])
                workdir = Path(tmp) / f"{method}-{clients}"
                workdir.mkdir()
                server = Server(_command(method, model, store, args.threads, cross_encoder, graphs), workdir).start()
                try:
                    before = _metric(server.url, "attnstore_node_forward_tokens_total") if method == "node" else 0
                    row = asyncio.run(run_clients(server.url, run_bodies, clients, route="/v1/rerank",
                                                  items="documents", read=_by_index))
                    if method == "node":
                        row["computed_per_token"] = (_metric(server.url, "attnstore_node_forward_tokens_total")
                                                     - before) / tokens
                    assert server.process is not None
                    # The server's own high-water mark: model, runtime, caches and the load's requests.
                    row["peak_rss_mib"] = status_bytes(server.process.pid, "VmHWM")["VmHWM"] / 2**20
                finally:
                    server.stop()
                row["method"], row["requests"], row["tokens"] = method, len(run_bodies), tokens
                results.setdefault(method, []).append(row)
                log.info("%s clients=%d documents/s=%.2f", method, clients, row["items_per_s"])
    _compare(results)
    return {"model": args.model, "model_path": model, "cross_encoder": cross_encoder,
            "note": CROSS_MINILM_NOTE if args.model == CROSS_MINILM else None,
            "requests": args.requests, "documents": [args.min_documents, args.max_documents],
            "queries": args.queries, "passages": args.passages, "zipf": args.zipf, "threads": args.threads,
            "distinct_pairs": distinct, "pairs": sum(len(body["documents"]) for body in bodies),
            "peer_graphs": {peer: str(path) for peer, path in graphs.items()}, "results": results}


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
    """``bench score``'s speedups (the node against every other server); where peers ran, the fastest
    ``<peer>_dict`` (``fastest_peer_dict`` names it) and the node's speedup over it."""
    by = {(row["method"], row["clients"]): row for rows in report["results"].values() for row in rows}
    out = speedups(report)
    for line in out:
        clients = line["clients"]
        peers = [m for m in PEER_DICTS if (m, clients) in by]
        if peers:
            fastest = max(peers, key=lambda m: by[(m, clients)]["items_per_s"])
            line["fastest_peer_dict"] = fastest
            line["x_fastest_peer_dict"] = line[f"x_{fastest}"]
            line["p99_vs_fastest_peer_dict"] = line[f"p99_vs_{fastest}"]
    return out


def _table(report: dict[str, Any]) -> str:
    lines = [report["note"]] if report.get("note") else []
    lines.append(f"{'server':14} {'clients':>7} {'requests':>8} {'docs/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
                 f"{'errors':>6} {'peak MiB':>8} {'computed/token':>14} {'same rank':>9} {'max diff':>9}")
    for rows in report["results"].values():
        for row in rows:
            computed, diff = row.get("computed_per_token"), row.get("max_diff")
            lines.append(f"{row['method']:14} {row['clients']:7d} {row['requests']:8d} {row['items_per_s']:8.2f} "
                         f"{row['p50_ms']:8.0f} {row['p99_ms']:8.0f} {row['errors']:6d} {row['peak_rss_mib']:8.0f} "
                         f"{'' if computed is None else f'{computed:.3f}':>14} {str(row.get('same_ranking')):>9} "
                         f"{'' if diff is None else f'{diff:.1e}':>9}")
    for line in report["speedups"]:
        parts = [f"{line[f'x_{b}']:.2f}x {b}'s documents/s, p99 {line[f'p99_vs_{b}']:.2f}x {b}'s"
                 for b in report["results"] if f"x_{b}" in line]
        if "fastest_peer_dict" in line:
            parts.append(f"{line['x_fastest_peer_dict']:.2f}x the fastest peer behind a dict's"
                         f" ({line['fastest_peer_dict']})")
        lines.append(f"node at {line['clients']} clients: " + ", ".join(parts))
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``rerank`` to the ``bench`` group."""
    parser = documented_parser(subparsers, "rerank", __doc__,
                               summary="/v1/rerank from concurrent clients: the node against plain, dict and peer"
                               " servers")
    parser.add_argument("--model", default="smollm2",
                        help="alias or local path of a causal model, or of a cross-encoder folder (a"
                        f" *ForSequenceClassification or CrossEncoder one); {CROSS_MINILM}: the bench's own, built"
                        " under --work-dir (the shape of ms-marco-MiniLM-L6-v2, an untrained head)")
    parser.add_argument("--methods", nargs="+", default=None, choices=METHODS,
                        help="servers to run (default: node plain cached for a decoder; node, plain and each"
                        f" {'/'.join(PEER_DICTS)} whose runtime is installed for a cross-encoder)")
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
    parser.add_argument("--work-dir", type=Path, default=Path("runs/bench-rerank"),
                        help=f"where {CROSS_MINILM} is built (and reused)")
    parser.add_argument("--peers-cache", type=Path, default=None,
                        help="where the peers' exported graphs are kept (default: $ATTNSTORE_PEERS_CACHE or"
                        " ~/.cache/attnstore/peers)")
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
        low, high = report["documents"]
        plot_by_clients(report, args.plot, "documents/s",
                        f"bench rerank: STS-B, {low}-{high} documents per query, {report['model']}, "
                        f"{report['threads']} torch threads per server")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1), encoding="utf-8")
    return 0
