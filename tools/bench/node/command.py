"""``attnstore bench node``: concurrent clients of the official ``openai`` package against HTTP servers.

The servers, one after another on the same cores, each a fresh process per
client count (so no point inherits another's cache):

- ``attnstore``: ``attnstore node`` over an embedded store built by ``attnstore
  build`` at its defaults from the 8 Loghub systems' first 1,000 lines each
  (kept under ``--work-dir`` and reused); ``attnstore_openvino``,
  ``attnstore_onnxruntime`` and ``attnstore_auto``: the same node with its
  compute tier on that engine (``attnstore node --engine``);
- ``sentence_transformers``: the node's own HTTP app answering each request with
  ``SentenceTransformer.encode`` (``bench.node.server``);
- ``dict``: the same with a dict cache in front, holding the stored lines'
  embeddings at start (as the node's store holds them) and every line it computes;
- the peers users run instead (``bench.peers``, the ``peers`` extra), through the
  same HTTP app: ONNX Runtime on the fp32 graph (``onnx_fp32``), the graph
  optimised at O3 (``onnx_o3``), the dynamically quantised int8 graph
  (``onnx_int8``) and OpenVINO fp32 (``openvino``), each bare or behind the same
  dict (``onnx_o3_dict``, ...); their graphs are exported once into
  ``--peers-cache`` before the servers start.

Load: ``--requests`` requests, each of 1 to ``--max-lines`` lines drawn at random
(seeded) from the systems' last 1,000 lines, the same requests for every server;
N clients (``--clients``), each an ``AsyncOpenAI`` client sending its next request
once its last is answered (``client.embeddings.create``; no retries, so every
failure counts). Per server and N: rows/s over the run, p50 and p99 request
latency, errors, and the CPU seconds of the server and of the clients' process;
for each node also its ``/metrics``: rows by tier, requests per call, tokens per
call, and the tokens its forwards ran against the real tokens they held. Every
server's fidelity: the share of the rows it answered at cosine >= 0.99 to
sentence-transformers' own vectors of them, and the lowest cosine. The node's
speedups are against every other server, and each node's against the fastest exact peer
behind a dict (the fastest of ``onnx_fp32_dict``, ``onnx_o3_dict`` and
``openvino_dict`` that ran: int8 is not exact).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from attnstore.errors import ConfigError
from attnstore_tools.arguments import documented_parser
from attnstore_tools.bench.encode import (
    ENGINE_METHODS,
    EXACT_PEERS,
    NAMESPACE,
    PEER_METHODS,
    built_store,
    load_data,
    peer_graphs,
    peer_method,
    stored_embeddings,
)
from attnstore_tools.bench.node.load import run_load, warm_up
from attnstore_tools.bench.peers_export import PeerName, default_cache_dir
from attnstore_tools.corpus import DATA_HELP, data_dir
from attnstore_tools.machine import cpu_model
from attnstore_tools.output import write_json

# The node's servers: server -> its compute tier's engine (``attnstore node --engine``).
NODES = {"attnstore": "torch", **ENGINE_METHODS}
SERVERS = ("attnstore", "sentence_transformers", "dict",
           *(f"{peer}{suffix}" for peer in PEER_METHODS for suffix in ("", "_dict")), *ENGINE_METHODS)
DEFAULT_SERVERS = ("attnstore", "sentence_transformers", "dict", "onnx_o3", "onnx_o3_dict", "onnx_int8_dict",
                   "openvino_dict")
EXACT_PEER_DICTS = tuple(f"{peer}_dict" for peer in EXACT_PEERS)
FAITHFUL = 0.99  # the cosine a row must keep to sentence-transformers' vector to count as faithful
_START_TIMEOUT = 300.0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``node`` to the ``bench`` group."""
    p = documented_parser(subparsers, "node", __doc__, summary="concurrent openai clients: node vs baselines")
    p.add_argument("--clients", default="1,8,32", help="comma-separated client counts")
    p.add_argument("--requests", type=int, default=240, help="requests per server and client count")
    p.add_argument("--max-lines", type=int, default=32, help="lines per request at most (at least 1)")
    p.add_argument("--servers", default=",".join(DEFAULT_SERVERS),
                   help=f"comma-separated, of {', '.join(SERVERS)} (default: {', '.join(DEFAULT_SERVERS)}; the"
                   " peers need the peers extra)")
    p.add_argument("--model", default="minilm", help="a sentence-transformers model alias or path")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each server")
    p.add_argument("--seed", type=int, default=0, help="of the requests' draws")
    p.add_argument("--node-args", default="", help="more `attnstore node` arguments, space-separated")
    p.add_argument("--data-dir", type=Path, default=None, help=DATA_HELP)
    p.add_argument("--work-dir", type=Path, default=Path("runs/bench-node"), help="where the built store is kept")
    p.add_argument("--peers-cache", type=Path, default=None,
                   help="where the peers' exported graphs are kept (default: $ATTNSTORE_PEERS_CACHE or"
                   " ~/.cache/attnstore/peers)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of rows/s and p99 latency here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; prints a table, writes JSON and the plot when asked."""
    try:
        counts = [int(part) for part in args.clients.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"bench node: --clients {args.clients!r} must be comma-separated integers") from None
    servers = [s for s in args.servers.split(",") if s]
    if not counts or min(counts) < 1 or args.requests < 1 or args.max_lines < 1 or args.threads < 1:
        raise ConfigError("bench node: --clients, --requests, --max-lines and --threads must be >= 1")
    if not servers or set(servers) - set(SERVERS):
        raise ConfigError(f"bench node: --servers {args.servers!r}: each must be one of {list(SERVERS)}")
    root = data_dir(args.data_dir)
    stored, queries, _, _ = load_data("logs", root)
    work = args.work_dir / "logs"
    store = built_store(args.model, stored, work) if set(servers) & set(NODES) else None
    embeddings = (stored_embeddings(args.model, stored, work, threads=args.threads, batch=32)
                  if any(s == "dict" or s.endswith("_dict") for s in servers) else None)
    graphs = peer_graphs(args.model, servers, args.peers_cache or default_cache_dir(), bench="node")
    rng = random.Random(args.seed)
    requests = [rng.choices(queries, k=rng.randint(1, args.max_lines)) for _ in range(args.requests)]
    reference = _reference(args.model, requests, args.threads)
    warmup = _warmup_texts(root)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-node-") as tmp:
        scratch = Path(tmp)
        (scratch / "stored.json").write_text(json.dumps(stored), encoding="utf-8")
        for clients in counts:
            point: dict[str, Any] = {"clients": clients, "servers": {}}
            for server in servers:
                command = _command(args, server, store, scratch, embeddings, graphs)
                result = _measure(command, scratch / f"{server}-{clients}", args.model, requests, clients, warmup,
                                  metrics=server in NODES)
                result.update(_fidelity(result.pop("vectors"), requests, reference))
                point["servers"][server] = result
                _print_line(clients, server, point["servers"][server])
            _ratios(point)
            results.append(point)
    report = {
        "model": args.model, "threads": args.threads, "requests": args.requests, "max_lines": args.max_lines,
        "rows": sum(len(r) for r in requests), "seed": args.seed, "node_args": args.node_args,
        "cpu": cpu_model(), "cores": os.cpu_count(), "stored_rows": len(stored),
        "peer_graphs": {peer: str(path) for peer, path in graphs.items()}, "results": results,
    }
    _print_summary(report)
    if args.json is not None:
        write_json(args.json, report)
    if args.plot is not None:
        _plot(report, args.plot)
    return 0


def _warmup_texts(root: Path) -> list[str]:
    """Texts each server answers first, untimed: STS-B sentences, none of the logs'."""
    lines = (root / "stsb_dev.tsv").read_text(encoding="utf-8").splitlines()[1:65]
    return [line.split("\t")[-2] for line in lines if line.count("\t") >= 2]


def _reference(model: str, requests: list[list[str]], threads: int) -> dict[str, Any]:
    """sentence-transformers' vector of every text the requests hold, normalised: what fidelity is measured
    against."""
    import torch

    from attnstore_client.models import load_model

    torch.set_num_threads(threads)
    pipeline = load_model(model).sentence_transformer
    if pipeline is None:
        raise ConfigError(f"bench node: {model!r} has no sentence-transformers configuration")
    texts = list(dict.fromkeys(text for request in requests for text in request))
    vectors = pipeline.encode(texts, batch_size=32, show_progress_bar=False, normalize_embeddings=True)
    return dict(zip(texts, vectors, strict=True))


def _fidelity(vectors: list[Any], requests: list[list[str]], reference: dict[str, Any]) -> dict[str, Any]:
    """The share of the answered rows at cosine >= ``FAITHFUL`` to sentence-transformers', and the lowest."""
    import numpy as np

    got = [vector for answer in vectors if answer is not None for vector in answer]
    if not got:
        return {"frac_cos_099": None, "min_cos": None}
    expected = np.stack([reference[text] for answer, request in zip(vectors, requests, strict=True)
                         if answer is not None for text in request])  # (rows, dim), unit rows
    answered = np.stack(got)
    cosine = (answered * expected).sum(axis=1) / np.linalg.norm(answered, axis=1)
    return {"frac_cos_099": float((cosine >= FAITHFUL).mean()), "min_cos": float(cosine.min())}


def _command(
    args: argparse.Namespace, server: str, store: Path | None, scratch: Path, embeddings: Path | None,
    graphs: dict[PeerName, Path],
) -> list[str]:
    ready = scratch / f"{server}-ready.json"
    if server in NODES:
        assert store is not None
        return [sys.executable, "-m", "attnstore_tools.cli", "node", "--model", args.model, "--store",
                f"local:{store}", "--namespace", NAMESPACE, "--listen", "127.0.0.1:0", "--ready-file", str(ready),
                "--threads", str(args.threads), "--engine", NODES[server], *args.node_args.split()]
    method = "dict" if server == "dict" or server.endswith("_dict") else "encode"
    command = [sys.executable, "-m", "attnstore_tools.bench.node.server", "--method", method, "--model", args.model,
               "--listen", "127.0.0.1:0", "--ready-file", str(ready), "--threads", str(args.threads)]
    if method == "dict":
        command += ["--stored", str(scratch / "stored.json"), "--stored-embeddings", str(embeddings)]
    peer = peer_method(server)
    if peer is not None:
        command += ["--peer", peer, "--graph", str(graphs[peer])]
    return command


def _measure(
    command: list[str], log_stem: Path, model: str, requests: list[list[str]], clients: int, warmup: list[str],
    *, metrics: bool,
) -> dict[str, Any]:
    """Start one server, warm it up, run the load, read its metrics, stop it (SIGTERM: it must exit 0)."""
    ready = Path(command[command.index("--ready-file") + 1])
    ready.unlink(missing_ok=True)
    log = log_stem.with_suffix(".log")
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        url = wait_ready(process, ready, log)
        asyncio.run(warm_up(url, model, warmup))
        cpu_before = _cpu_seconds(process.pid)
        result = asyncio.run(run_load(url, model, requests, clients))
        result["server_cpu_s"] = _cpu_seconds(process.pid) - cpu_before
        if metrics:
            result["node"] = _node_metrics(url)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        code = process.wait(120)
    result["exit_code"] = code
    return result


def wait_ready(process: subprocess.Popen[bytes], ready: Path, log: Path, *, bench: str = "bench node") -> str:
    """The URL of the server ``process`` once it wrote its ``--ready-file``.

    Raises:
        ConfigError: it exited first, or was not ready within the start timeout (its log's tail, or its path).
    """
    deadline = time.monotonic() + _START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ConfigError(f"{bench}: a server exited with {process.returncode}: {log.read_text()[-3000:]}")
        if ready.exists():
            return f"http://127.0.0.1:{json.loads(ready.read_text(encoding='utf-8'))['port']}"
        time.sleep(0.1)
    raise ConfigError(f"{bench}: a server was not ready within {_START_TIMEOUT:g} s; its log: {log}")


def _cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _node_metrics(url: str) -> dict[str, Any]:
    """What the node's ``/metrics`` says of the run: rows by tier, calls, tokens forwarded and held."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, float] = {}
    rows: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "attnstore_node_rows_total":
                rows[sample.labels["tier"]] = sample.value
            elif not sample.labels:
                samples[sample.name] = sample.value
    calls = samples.get("attnstore_node_call_requests_count", 0.0)
    forward = samples.get("attnstore_node_forward_tokens_total", 0.0)
    return {
        "rows_by_tier": rows, "calls": calls,
        "requests_per_call": samples.get("attnstore_node_call_requests_sum", 0.0) / calls if calls else None,
        "tokens_per_call": samples.get("attnstore_node_batch_tokens_sum", 0.0) / calls if calls else None,
        "call_seconds": samples.get("attnstore_node_call_seconds_sum", 0.0),
        "forward_tokens": forward, "forwarded_tokens": samples.get("attnstore_node_forwarded_tokens_total", 0.0),
        "forwarded_per_real_token": samples.get("attnstore_node_forwarded_tokens_total", 0.0) / forward
        if forward else None,
        "max_batch_tokens": samples.get("attnstore_node_max_batch_tokens"),
    }


def _ratios(point: dict[str, Any]) -> None:
    """The node's rows/s and p99 against every other server's, and each node's (``NODES``) against the fastest
    exact peer's behind a dict (``fastest_exact_peer_dict`` names it; a node on another engine keeps its ratios
    in ``engines``)."""
    servers = point["servers"]
    node = servers.get("attnstore")
    if node is not None:
        for base in [s for s in servers if s != "attnstore"]:
            point[f"rows_per_s_vs_{base}"] = node["rows_per_s"] / servers[base]["rows_per_s"]
            point[f"p99_vs_{base}"] = node["p99_ms"] / servers[base]["p99_ms"]
    peers = [s for s in EXACT_PEER_DICTS if s in servers]
    if not peers:
        return
    fastest = max(peers, key=lambda s: servers[s]["rows_per_s"])
    point["fastest_exact_peer_dict"] = fastest
    for name in [s for s in NODES if s in servers]:
        ours, theirs = servers[name], servers[fastest]
        ratios = {"rows_per_s_vs_fastest_exact_peer_dict": ours["rows_per_s"] / theirs["rows_per_s"],
                  "p99_vs_fastest_exact_peer_dict": ours["p99_ms"] / theirs["p99_ms"]}
        if name == "attnstore":
            point.update(ratios)
        else:
            point.setdefault("engines", {})[name] = ratios


def _print_line(clients: int, server: str, r: dict[str, Any]) -> None:
    frac = "-" if r.get("frac_cos_099") is None else f"{r['frac_cos_099']:.4f}"
    low = "-" if r.get("min_cos") is None else f"{r['min_cos']:.4f}"
    print(f"{clients:>7} {server:22} {r['rows_per_s']:9.1f} {r['requests_per_s']:7.1f} {r['p50_ms']:8.1f}"
          f" {r['p99_ms']:8.1f} {r['errors']:6d} {frac:>8} {low:>8} {r['server_cpu_s']:9.1f}"
          f" {r['client_cpu_s']:9.1f}", flush=True)


def _print_summary(report: dict[str, Any]) -> None:
    print(f"\n{report['requests']} requests of 1-{report['max_lines']} lines ({report['rows']} rows) per point;"
          f" {report['threads']} torch threads per server; {report['cores']} cores ({report['cpu']})")
    print(f"{'clients':>7} {'server':22} {'rows/s':>9} {'req/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6}"
          f" {'cos>=.99':>8} {'min cos':>8} {'srv CPU s':>9} {'cli CPU s':>9}")
    for point in report["results"]:
        for server, result in point["servers"].items():
            _print_line(point["clients"], server, result)
    for point in report["results"]:
        parts = [f"{point['clients']} clients:"]
        for base in ("sentence_transformers", "dict", point.get("fastest_exact_peer_dict")):
            if base and f"rows_per_s_vs_{base}" in point:
                parts.append(f"rows/s {point[f'rows_per_s_vs_{base}']:.2f}x {base}"
                             f" (p99 {point[f'p99_vs_{base}']:.2f}x)")
        node = point["servers"].get("attnstore", {}).get("node")
        if node:
            parts.append(f"| node: {node['requests_per_call'] or 0:.1f} requests and {node['tokens_per_call'] or 0:.0f}"
                         f" tokens per call, forwarded/real tokens {node['forwarded_per_real_token'] or 0:.3f},"
                         f" rows by tier {({k: int(v) for k, v in node['rows_by_tier'].items() if v})}")
        for name, ratios in point.get("engines", {}).items():
            parts.append(f"| {name}: rows/s {ratios['rows_per_s_vs_fastest_exact_peer_dict']:.2f}x"
                         f" {point['fastest_exact_peer_dict']} (p99 {ratios['p99_vs_fastest_exact_peer_dict']:.2f}x)")
        if len(parts) > 1:  # a run without the node has no speedups to give
            print("  " + " ".join(parts))


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = [point["clients"] for point in report["results"]]
    fig, (rows_ax, p99_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for server in report["results"][0]["servers"]:
        rows_ax.plot(counts, [p["servers"][server]["rows_per_s"] for p in report["results"]], "o-", label=server)
        p99_ax.plot(counts, [p["servers"][server]["p99_ms"] for p in report["results"]], "o-", label=server)
    for ax, label in ((rows_ax, "rows/s"), (p99_ax, "p99 latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"bench node: Loghub lines, {report['model']}, {report['threads']} torch threads per server")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
