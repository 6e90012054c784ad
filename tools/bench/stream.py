"""``attnstore bench stream``: Loghub lines streamed by several node processes sharing one daemon.

The 8 Loghub systems of ``../shared/data/loghub``: the first ``--build-lines``
lines of each are the build corpus (``attnstore build``: maps, projector,
calibration, gate) and pre-fill the dict caches; the stream is the rest, in
their original order, systems interleaved in blocks of 50 lines, cut to
``--limit`` lines. ``--nodes`` processes (``--threads`` torch threads each) take
batches of ``--batch`` rows dealt round-robin, all starting together. Variants,
each on the same stream and the same number of processes, one after the other:

- ``plain``: sentence-transformers ``encode``;
- ``dict``: each process its own dict output cache, pre-filled with the build lines;
- ``redis_cache``: the processes share one exact cache in a real Redis, as a
  team sharing results across replicas runs RedisVL's ``EmbeddingsCache``
  (``bench.redis_cache``: text + model keys; one ``MGET`` per batch, the misses
  encoded with sentence-transformers, or with ``--redis-peer``, and set back),
  pre-filled with the build lines; the bench starts its own ``redis-server`` on
  a loopback port and stops it after;
- ``attnstore``: ``AttnCache`` against the built namespace, write-back off
  (the exact tiers, the node's own and the store's, and map replay);
- ``attnstore_exact_write_back``: the store's exact tier alone (no map lookups),
  write-back on;
- ``attnstore_write_back``: everything: exact tiers, map replay, write-back on.

Every AttnStore variant gets its own copy of the built store and its own daemon
(``--max-bytes``, ``--dram-bytes``, ``--admit-after``), so what one variant
writes back no other sees. Reports rows/s per variant, hit rates by kind,
fidelity (cosine per row to ``plain``), store bytes and daemon RSS at the end
(against its RSS at start plus its caps), the Redis cache's keys and memory,
errors, and a PNG of the hit rates over the stream. The speedups are
``attnstore_write_back``'s. ``--variants`` runs some of them (``plain``, the
reference, always runs).

``--cold-start``: no corpus and no build. The dicts start empty, and the
AttnStore variant, ``attnstore_cold_start``, starts from a namespace made by
``admin create-namespace`` (exact tier only): the first half of the stream is
sent with write-back on, then ``admin train-projector`` trains the projector
from the maps written back, then the second half is sent by new node processes
(map hits become possible). Its rows/s counts the two halves, not the training
(reported apart); the speedups are its own. The Redis cache starts empty too.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from attnstore.errors import ConfigError
from attnstore_tools.arguments import documented_parser
from attnstore_tools.bench.peers_export import PEERS, default_cache_dir
from attnstore_tools.bench.redis_cache import RedisEmbeddingsCache, RedisProcess
from attnstore_tools.launcher import ServeProcess
from attnstore_tools.machine import status_bytes
from attnstore_tools.output import write_json

BASELINES = ("plain", "dict", "redis_cache")  # no daemon
BUILT = ("attnstore", "attnstore_exact_write_back", "attnstore_write_back")  # on the built namespace
VARIANTS = (*BASELINES, *BUILT)
COLD_START = "attnstore_cold_start"
STORE_VARIANTS = (*BUILT, COLD_START)  # each with its own store and its own daemon
WRITING = frozenset({"attnstore_exact_write_back", "attnstore_write_back", COLD_START})
NAMESPACE = "stream"
LOGHUB = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "loghub"
_ADMIN = "bench-admin-token-0123456789"


def _write_token(node: int) -> str:
    """Node ``node``'s write token: each node is a caller of its own, as admission counts distinct callers."""
    return f"bench-write-token-{node:03d}-0123456789"
_BLOCK = 50  # lines of one system before the next system's


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``stream`` to the ``bench`` group."""
    p = documented_parser(subparsers, "stream", __doc__, summary="Loghub stream, node processes sharing a daemon")
    p.add_argument("--data", type=Path, default=LOGHUB, help="folder of the Loghub .tsv files")
    p.add_argument("--model", default="minilm", help="a sentence-transformers model alias or path")
    p.add_argument("--build-lines", type=int, default=500, help="lines per system that fill the store")
    p.add_argument("--limit", type=int, default=12_000, help="stream lines at most")
    p.add_argument("--nodes", type=int, default=4, help="node processes")
    p.add_argument("--batch", type=int, default=32, help="rows per encode call")
    p.add_argument("--threads", type=int, default=1, help="torch threads per node")
    p.add_argument("--admit-after", type=int, default=2, help="the daemons' --admit-after")
    p.add_argument("--max-bytes", type=int, default=2 << 30, help="the daemons' --max-bytes (stored bytes cap)")
    p.add_argument("--dram-bytes", type=int, default=256 << 20, help="the daemons' --dram-bytes (decoded maps cap)")
    p.add_argument("--cold-start", action="store_true",
                   help="no build: an empty namespace filled by write-back, a projector trained halfway")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)} (plain always runs; with --cold-start, the"
                   f" baselines chosen and {COLD_START})")
    p.add_argument("--redis-peer", choices=PEERS, default=None,
                   help="the peer that encodes redis_cache's misses (default: sentence-transformers)")
    p.add_argument("--peers-cache", type=Path, default=None,
                   help="where the peers' exported graphs are kept (default: $ATTNSTORE_PEERS_CACHE or"
                   " ~/.cache/attnstore/peers)")
    p.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    p.add_argument("--plot", type=Path, default=None, help="write the hit-rate plot here (PNG)")
    p.set_defaults(func=run)


def load_stream(data: Path, build_lines: int, limit: int) -> tuple[list[str], list[str]]:
    """The build lines (first ``build_lines`` of each system) and the stream (the rest, interleaved, cut)."""
    systems = []
    for path in sorted(data.glob("*.tsv")):
        with path.open(encoding="utf-8", newline="") as f:
            systems.append([row["content"] for row in csv.DictReader(f, delimiter="\t")])
    if not systems:
        raise ConfigError(f"bench stream: no .tsv files in {data}")
    build = [line for lines in systems for line in lines[:build_lines]]
    rests = [lines[build_lines:] for lines in systems]
    stream: list[str] = []
    for start in range(0, max(len(r) for r in rests), _BLOCK):
        for rest in rests:
            stream += rest[start : start + _BLOCK]
    return build, stream[:limit]


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table, write the JSON (and the plot); returns the exit code."""
    if min(args.build_lines, args.limit, args.nodes, args.batch, args.threads, args.admit_after,
           args.max_bytes, args.dram_bytes) < 1:
        raise ConfigError(
            "need --build-lines, --limit, --nodes, --batch, --threads, --admit-after, --max-bytes and --dram-bytes"
            f" >= 1; got {args.build_lines}, {args.limit}, {args.nodes}, {args.batch}, {args.threads},"
            f" {args.admit_after}, {args.max_bytes}, {args.dram_bytes}"
        )
    chosen = [v for v in args.variants.split(",") if v]
    if set(chosen) - set(VARIANTS):
        raise ConfigError(f"bench stream: --variants {args.variants!r}: each must be one of {list(VARIANTS)}")
    baselines = [v for v in BASELINES if v == "plain" or v in chosen]
    built = [] if args.cold_start else [v for v in BUILT if v in chosen]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    build, stream = load_stream(args.data, args.build_lines, args.limit)
    with tempfile.TemporaryDirectory(prefix="attnstore-bench-stream-") as folder:  # store copies: GBs
        work = Path(folder)
        (work / "stream.json").write_text(json.dumps(stream), encoding="utf-8")
        tokens = work / "tokens"
        writers = "".join(f"write {_write_token(node)} name=node-{node}\n" for node in range(args.nodes))
        tokens.write_text(f"admin {_ADMIN}\n{writers}", encoding="utf-8")
        tokens.chmod(0o600)
        if args.cold_start:
            embedded = _embed(args, [], work)
            reports, redis = _run_baselines(args, baselines, work, [], embedded, len(stream))
            daemons, phases = _run_cold_start(args, work, tokens, reports, len(stream))
            result = _summarise(args, reports, len(stream), daemons, COLD_START)
            result["variants"][COLD_START]["phases"] = phases
        else:
            built_s = _build(args, build, work) if built else None
            embedded = _embed(args, build, work)
            reports, redis = _run_baselines(args, baselines, work, build, embedded, len(stream))
            daemons = {}
            for variant in built:
                store = work / f"store-{variant}"
                shutil.copytree(work / "built", store)
                with _daemon(args, store, work / variant, tokens) as (daemon, rss_start):
                    reports[variant] = _run_variant(args, variant, f"grpc://{daemon.target}", work, 0, len(stream))
                    daemons[variant] = _daemon_report(daemon, rss_start)
            result = _summarise(args, reports, len(stream), daemons,
                                "attnstore_write_back" if "attnstore_write_back" in built else None)
            result["build_seconds"] = built_s
        if redis is not None:
            result["variants"]["redis_cache"]["redis"] = redis
    _print(result)
    if args.plot is not None:
        _plot(reports, args.plot)
    if args.json is not None:
        write_json(args.json, result)
    return 0 if result["errors"] == 0 else 1


@contextlib.contextmanager
def _daemon(
    args: argparse.Namespace, store: Path, folder: Path, tokens: Path
) -> Iterator[tuple[ServeProcess, int | None]]:
    """A daemon on ``store`` with the bench's caps and tokens, and its RSS at start; stopped at the end."""
    folder.mkdir()
    daemon = ServeProcess(store, folder, args=(
        "--token-file", str(tokens), "--admit-after", str(args.admit_after),
        "--max-bytes", str(args.max_bytes), "--dram-bytes", str(args.dram_bytes))).start()
    try:
        yield daemon, _rss_bytes(daemon.pid)
    finally:
        daemon.stop()


def _daemon_report(daemon: ServeProcess, rss_start: int | None) -> dict[str, Any]:
    """The daemon's store and memory now."""
    with daemon.client(_ADMIN) as admin:
        stats = admin.stats()
    return {"store_bytes": stats.stored_bytes, "entries": stats.entries,
            "written_back_entries": stats.written_back_entries, "written_back_bytes": stats.written_back_bytes,
            "store_evictions": stats.store_evictions, "rss_start_bytes": rss_start,
            "rss_end_bytes": _rss_bytes(daemon.pid)}


def _run_cold_start(
    args: argparse.Namespace, work: Path, tokens: Path, reports: dict[str, list[dict[str, Any]]], count: int
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The cold-start variant: create the namespace, the first half, train the projector, the second half.

    Adds its node reports (both halves) to ``reports``; returns the daemon report and one record per half.
    """
    half = count // 2
    with _daemon(args, work / f"store-{COLD_START}", work / COLD_START, tokens) as (daemon, rss_start):
        env = {**os.environ, "ATTNSTORE_TOKEN": _ADMIN}  # not on the command line: argv is visible to ps
        admin = [sys.executable, "-m", "attnstore_tools.cli", "admin"]
        where = ["--target", daemon.target]
        subprocess.run([*admin, "create-namespace", *where, "--model", args.model, "--namespace", NAMESPACE],
                       check=True, env=env, stdout=subprocess.DEVNULL)
        url = f"grpc://{daemon.target}"
        first = _run_variant(args, COLD_START, url, work, 0, half, phase=0)
        started = time.perf_counter()
        trained = work / "train-projector.json"
        done = subprocess.run([*admin, "train-projector", *where, "--model", args.model, "--namespace", NAMESPACE,
                               "--no-progress", "--json", str(trained)], env=env, stdout=subprocess.DEVNULL)
        if done.returncode != 0:
            raise ConfigError(
                f"bench stream --cold-start: admin train-projector exited {done.returncode} (its error above); "
                "too few rows written back with maps? A longer stream (--limit) or --admit-after 1 writes back more"
            )
        train_s = time.perf_counter() - started
        second = _run_variant(args, COLD_START, url, work, half, count, phase=1)
        daemons = {COLD_START: _daemon_report(daemon, rss_start)}
    reports[COLD_START] = first + second
    phases = []
    for name, nodes, rows in (("fill (no projector)", first, half), ("after train-projector", second, count - half)):
        kinds = [kind for r in nodes for kind in r["kinds"]]
        seconds = _span(nodes)
        phases.append({"phase": name, "rows": rows, "seconds": seconds,
                       "rows_per_s": rows / seconds if seconds > 0 else 0.0,
                       "hit_rate": {k: kinds.count(k) / rows for k in ("exact", "map", "miss", "fallback")}})
    phases[1]["train_projector_seconds"] = train_s
    phases[1]["train_projector"] = json.loads(trained.read_text(encoding="utf-8"))
    return daemons, phases


def _build(args: argparse.Namespace, build: list[str], work: Path) -> float:
    """Build the namespace from the build lines (``attnstore build``); returns seconds."""
    corpus = work / "build.txt"
    corpus.write_text("".join(line.replace("\n", " ") + "\n" for line in build), encoding="utf-8")
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "attnstore_tools.cli", "build", "--model", args.model, "--corpus",
                    str(corpus), "--store", str(work / "built"), "--namespace", NAMESPACE,
                    "--batch-size", str(args.batch)], check=True)
    return time.perf_counter() - started


def _embed(args: argparse.Namespace, build: list[str], work: Path) -> np.ndarray:
    """The build lines and their embeddings, that the dicts (and the Redis cache) start with; returns these."""
    import torch

    from attnstore_client.models import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    assert loaded.sentence_transformer is not None, "bench stream needs a sentence-transformers model"
    embedded = (loaded.sentence_transformer.encode(build, batch_size=args.batch) if build
                else np.zeros((0, 0), np.float32))
    (work / "build.json").write_text(json.dumps(build), encoding="utf-8")
    np.save(work / "build.npy", embedded)
    return embedded


def _run_baselines(
    args: argparse.Namespace, baselines: list[str], work: Path, build: list[str], embedded: np.ndarray, count: int,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any] | None]:
    """The baselines' node reports on the whole stream, and the Redis cache's report (None if it did not run)."""
    reports = {v: _run_variant(args, v, "", work, 0, count) for v in baselines if v != "redis_cache"}
    if "redis_cache" not in baselines:
        return reports, None
    extra: dict[str, Any] = {}
    if args.redis_peer is not None:
        from attnstore_client.models import load_model
        from attnstore_tools.bench.peers_export import export_graph

        graph = export_graph(args.redis_peer, load_model(args.model), cache_dir=args.peers_cache or default_cache_dir())
        extra = {"peer": args.redis_peer, "graph": str(graph)}
    with RedisProcess(work / "redis") as server:
        client = server.client()
        RedisEmbeddingsCache(client, args.model).set_many(build, embedded)
        prefilled = int(client.dbsize())
        reports["redis_cache"] = _run_variant(args, "redis_cache", server.url, work, 0, count, extra=extra)
        memory = client.info("memory")
        redis = {"prefilled_keys": prefilled, "keys": int(client.dbsize()), "peer": args.redis_peer,
                 "used_memory_bytes": memory.get("used_memory"), "rss_bytes": _rss_bytes(server.pid)}
        client.close()
    return reports, redis


def _run_variant(
    args: argparse.Namespace, variant: str, url: str, work: Path, first: int, last: int, *, phase: int = 0,
    extra: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Start the nodes on stream rows ``first..last-1``, wait until all loaded, start them together, collect
    their reports."""
    name = f"{variant}-{phase}"
    procs = []
    for node in range(args.nodes):
        spec = {"variant": variant, "phase": phase, "node": node, "nodes": args.nodes, "batch": args.batch,
                "url": url, "token": _write_token(node), "namespace": NAMESPACE, "work": str(work), "first": first,
                "last": last, "threads": args.threads, "model": args.model,
                "maps": variant != "attnstore_exact_write_back", "write_back": variant in WRITING, **(extra or {})}
        path = work / f"spec-{name}-{node}.json"
        path.write_text(json.dumps(spec), encoding="utf-8")
        with (work / f"{name}-{node}.log").open("wb") as stderr:  # the child keeps its own descriptor
            procs.append(subprocess.Popen([sys.executable, "-m", "attnstore_tools.bench.stream_node", str(path)],
                                          stdout=subprocess.DEVNULL, stderr=stderr))
    while not all((work / f"ready-{name}-{n}").exists() for n in range(args.nodes)):
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    (work / f"go-{name}").touch()
    reports = []
    for node, proc in enumerate(procs):
        proc.wait()
        out = work / f"{name}-{node}.json"
        if proc.returncode != 0 or not out.exists():
            log = (work / f"{name}-{node}.log").read_text(encoding="utf-8", errors="replace")[-2000:]
            reports.append({"rows": [], "kinds": [], "start": 0.0, "end": 0.0, "written": None, "phase": phase,
                            "error": f"node exited {proc.returncode}: {log}", "embeddings": np.zeros((0, 1))})
            continue
        report = json.loads(out.read_text(encoding="utf-8"))
        report["embeddings"] = np.load(work / f"{name}-{node}.npy")
        report["phase"] = phase
        reports.append(report)
    return reports


def _span(nodes: list[dict[str, Any]]) -> float:
    """Seconds the nodes of one run took together: first start to last end (0 if none ran)."""
    ran = [r for r in nodes if r["end"] > 0]
    return max(r["end"] for r in ran) - min(r["start"] for r in ran) if ran else 0.0


def _seconds(nodes: list[dict[str, Any]]) -> float:
    """Seconds of a variant's runs, each run's span summed (the training between halves left out)."""
    return sum(_span([r for r in nodes if r["phase"] == phase]) for phase in {r["phase"] for r in nodes})


def _in_stream_order(reports: list[dict[str, Any]], count: int) -> tuple[np.ndarray | None, list[str]]:
    kinds = [""] * count
    dim = max((r["embeddings"].shape[1] for r in reports if len(r["rows"])), default=0)
    out = np.zeros((count, dim), np.float32) if dim else None
    for r in reports:
        for k, row in enumerate(r["rows"]):
            kinds[row] = r["kinds"][k]
            if out is not None:
                out[row] = r["embeddings"][k]
    return out, kinds


def _summarise(args: argparse.Namespace, reports: dict[str, list[dict[str, Any]]], count: int,
               daemons: dict[str, dict[str, Any]], candidate: str | None) -> dict[str, Any]:
    plain, _ = _in_stream_order(reports["plain"], count)
    variants: dict[str, Any] = {}
    errors = 0
    for variant, nodes in reports.items():
        embeddings, kinds = _in_stream_order(nodes, count)
        failed = [r["error"] for r in nodes if r["error"]]
        errors += len(failed) + kinds.count("")  # a node that failed, rows no node answered
        seconds = _seconds(nodes)
        cosine = None
        if embeddings is not None and plain is not None and embeddings.shape == plain.shape:
            a = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
            b = plain / np.linalg.norm(plain, axis=1, keepdims=True)
            cosine = (a * b).sum(axis=1)
        variants[variant] = {
            "rows_per_s": count / seconds if seconds > 0 else 0.0, "seconds": seconds,
            "hit_rate": {k: kinds.count(k) / count for k in ("exact", "map", "miss", "fallback")},
            "frac_cos_099": None if cosine is None else float((cosine >= 0.99).mean()),
            "min_cos": None if cosine is None else float(cosine.min()),
            "written_back": [r["written"] for r in nodes if r["written"]], "errors": failed,
            "daemon": daemons.get(variant),
        }
    summary = {
        "stream_rows": count, "nodes": args.nodes, "batch": args.batch, "threads": args.threads,
        "model": args.model, "admit_after": args.admit_after, "build_lines": args.build_lines,
        "max_bytes": args.max_bytes, "dram_bytes": args.dram_bytes, "cold_start": args.cold_start,
        "candidate": candidate, "errors": errors, "variants": variants,
    }
    if candidate is None:
        return summary
    best, rate = variants[candidate], lambda v: variants[v]["rows_per_s"] or float("nan")
    daemon = daemons[candidate]
    # The daemon's growth must fit its caps: stored bytes are mapped (LMDB), decoded maps sit in the DRAM cache.
    caps = args.max_bytes + args.dram_bytes
    within = (None if daemon["rss_start_bytes"] is None or daemon["rss_end_bytes"] is None
              else daemon["rss_end_bytes"] - daemon["rss_start_bytes"] <= caps)
    return {
        **summary,
        "speedup_vs_plain": rate(candidate) / rate("plain"),
        "speedup_vs_dict": rate(candidate) / rate("dict") if "dict" in variants else None,
        "speedup_vs_redis_cache": rate(candidate) / rate("redis_cache") if "redis_cache" in variants else None,
        "frac_cos_099": best["frac_cos_099"], "min_cos": best["min_cos"],
        "store_bytes": daemon["store_bytes"], "daemon_rss_bytes": daemon["rss_end_bytes"],
        "daemon_rss_within_caps": within,
    }


def _rss_bytes(pid: int) -> int | None:
    try:
        return status_bytes(pid, "VmRSS").get("VmRSS")
    except OSError:
        return None


def _print(result: dict[str, Any]) -> None:
    print(f"{'variant':28} {'rows/s':>8} {'exact':>6} {'map':>6} {'miss':>6} {'cos>=.99':>8} {'min cos':>8}")
    for name, v in result["variants"].items():
        frac = "-" if v["frac_cos_099"] is None else f"{v['frac_cos_099']:.4f}"
        low = "-" if v["min_cos"] is None else f"{v['min_cos']:.4f}"
        rates = v["hit_rate"]
        print(f"{name:28} {v['rows_per_s']:8.1f} {rates['exact']:6.3f} {rates['map']:6.3f} {rates['miss']:6.3f}"
              f" {frac:>8} {low:>8}")
    redis = result["variants"].get("redis_cache", {}).get("redis")
    if redis:
        print(f"  redis_cache: {redis['keys']} keys at the end ({redis['prefilled_keys']} pre-filled),"
              f" {redis['used_memory_bytes']} B used, misses by {redis['peer'] or 'sentence-transformers'}")
    for phase in result["variants"].get(COLD_START, {}).get("phases", []):
        rates = phase["hit_rate"]
        print(f"  {COLD_START}, {phase['phase']}: {phase['rows_per_s']:.1f} rows/s, exact {rates['exact']:.3f},"
              f" map {rates['map']:.3f}, miss {rates['miss']:.3f}"
              + (f"; train-projector before it {phase['train_projector_seconds']:.1f} s"
                 if "train_projector_seconds" in phase else ""))
    if result["candidate"] is None:
        print(f"errors {result['errors']}")
        return
    versus = "".join(f", vs {base} {result[f'speedup_vs_{base}']:.3f}" for base in ("dict", "redis_cache")
                     if result[f"speedup_vs_{base}"] is not None)
    print(f"{result['candidate']}: speedup vs plain {result['speedup_vs_plain']:.3f}{versus};"
          f" store {result['store_bytes']} B, daemon RSS {result['daemon_rss_bytes']} B"
          f" (within caps: {result['daemon_rss_within_caps']}), errors {result['errors']}")


def _plot(reports: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for variant in [v for v in reports if v != "plain"]:
        count = sum(len(r["rows"]) for r in reports[variant])
        _, kinds = _in_stream_order(reports[variant], count)
        window = max(1, min(500, count // 10))
        for kind in ("exact", "map") if variant in STORE_VARIANTS else ("exact",):
            hits = np.array([k == kind for k in kinds], dtype=np.float64)
            if kind == "map" and not hits.any():
                continue
            ax.plot(np.convolve(hits, np.ones(window) / window, mode="valid"), label=f"{variant}: {kind} hits")
    ax.set_xlabel("stream position (rows)")
    ax.set_ylabel("hit rate (rolling mean)")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
