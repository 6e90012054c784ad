"""``attnstore bench burst``: a node's memory in steady traffic, under a burst of maximal requests, and after it.

One ``attnstore node`` over an embedded store built by ``attnstore build`` at its
defaults from the 8 Loghub systems' first 1,000 lines each (``bench encode``'s
store, kept under ``--work-dir``), with ``--memory-budget``, ``--max-inputs``,
``--max-call-rows`` and ``--max-queued-rows`` as given. Its memory (``VmRSS``, ``RssAnon``, ``RssFile`` of
the node's process, sampled every 20 ms):

0. **start**: once it is ready and warmed up (model, store and indexes loaded);

1. **steady**: after ``--steady-requests`` small requests (1 to 8 of the systems'
   last 1,000 lines each, at most ``--max-inputs``) from 8 clients, sent twice (the node's exact tier keeps a
   row from its second offer on), and a second of idle;
2. **burst**: ``--burst-clients`` clients each send ``--burst-rounds`` maximal
   requests at once: ``--max-inputs`` distinct texts of the model's whole length
   (held-out lines joined until they pass it; the node truncates them to it), the
   peak over the burst;
3. **after**: ``--settle`` seconds after the last answer, and again after the same
   steady traffic once more.

The peak is set beside the bound the node's settings give (docs/guides/http-node.md,
"Memory"): start + ``--memory-budget`` (the indexes, counted in start already, the
forwards in flight and the exact tier: ``attnstore_client.memory``) + the rows it
holds (a call's, ``--max-call-rows`` at most, and the queue's, ``--max-queued-rows``
at most; ``ROW_BYTES`` each: tokens, text, ticket, answer),
and the memory after the burst against the steady state (the target: within 10%).
"""

from __future__ import annotations

import argparse
import asyncio
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
from attnstore_tools.bench.encode import NAMESPACE, built_store, load_data
from attnstore_tools.bench.node.command import wait_ready
from attnstore_tools.bench.node.load import run_load
from attnstore_tools.corpus import DATA_HELP, data_dir
from attnstore_tools.machine import RssSampler, cpu_model
from attnstore_tools.output import write_json
from attnstore_tools.serve import parse_size

_SAMPLE_S = 0.02
_STEADY_CLIENTS = 8


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``burst`` to the ``bench`` group."""
    p = documented_parser(subparsers, "burst", __doc__, summary="a node's memory under a burst of maximal requests")
    p.add_argument("--model", default="minilm", help="a sentence-transformers model alias or path")
    p.add_argument("--threads", type=int, default=2, help="the node's torch threads")
    p.add_argument("--max-inputs", type=int, default=32, help="the node's --max-inputs: inputs of a maximal request")
    p.add_argument("--memory-budget", type=parse_size, default=256 * 2**20, help="the node's --memory-budget")
    p.add_argument("--max-call-rows", type=int, default=1024, help="the node's --max-call-rows")
    p.add_argument("--max-queued-rows", type=int, default=2048, help="the node's --max-queued-rows")
    p.add_argument("--steady-requests", type=int, default=1000, help="small requests before and after the burst")
    p.add_argument("--burst-clients", type=int, default=32, help="clients sending maximal requests at once")
    p.add_argument("--burst-rounds", type=int, default=2, help="maximal requests each burst client sends")
    p.add_argument("--settle", type=float, default=3.0, help="idle seconds after the burst before reading memory")
    p.add_argument("--seed", type=int, default=0, help="seed of the requests' texts")
    p.add_argument("--data-dir", type=Path, default=None, help=DATA_HELP)
    p.add_argument("--work-dir", type=Path, default=Path("runs/bench-encode"), help="where the built store is kept")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; prints a table, writes JSON when asked."""
    for name in ("threads", "max_inputs", "memory_budget", "max_call_rows", "max_queued_rows", "steady_requests",
                 "burst_clients", "burst_rounds"):
        if getattr(args, name) < 1:
            raise ConfigError(f"bench burst: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.settle < 0:
        raise ConfigError(f"bench burst: --settle must be >= 0, got {args.settle}")
    stored, queries, _, _ = load_data("logs", data_dir(args.data_dir))
    store = built_store(args.model, stored, args.work_dir / "logs")
    rng = random.Random(args.seed)
    steady = [rng.sample(queries, rng.randint(1, min(8, args.max_inputs))) for _ in range(args.steady_requests)]
    burst = [[_long_text(rng, queries) for _ in range(args.max_inputs)]
             for _ in range(args.burst_clients * args.burst_rounds)]
    with tempfile.TemporaryDirectory(prefix="bench-burst-") as tmp:
        result = _measure(args, store, Path(tmp), steady, burst)
    result.update({"model": args.model, "cpu": cpu_model(), "threads": args.threads, "settings": {
        name: getattr(args, name) for name in ("max_inputs", "memory_budget", "max_call_rows", "max_queued_rows",
                                               "steady_requests", "burst_clients", "burst_rounds", "settle")}})
    _print(result)
    if args.json is not None:
        write_json(args.json, result)
    return 0


def _long_text(rng: random.Random, lines: list[str]) -> str:
    """Held-out lines joined until the text passes every model's length here (the node truncates it)."""
    parts: list[str] = []
    while sum(len(part) for part in parts) < 4000:
        parts.append(rng.choice(lines))
    return " ".join(parts)


def _measure(
    args: argparse.Namespace, store: Path, scratch: Path, steady: list[list[str]], burst: list[list[str]]
) -> dict[str, Any]:
    ready = scratch / "ready.json"
    command = [sys.executable, "-m", "attnstore_tools.cli", "node", "--model", args.model, "--store",
               f"local:{store}", "--namespace", NAMESPACE, "--listen", "127.0.0.1:0", "--ready-file", str(ready),
               "--threads", str(args.threads), "--max-inputs", str(args.max_inputs),
               "--memory-budget", str(args.memory_budget), "--max-call-rows", str(args.max_call_rows),
               "--max-queued-rows", str(args.max_queued_rows)]
    log = scratch / "node.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        url = wait_ready(process, ready, log, bench="bench burst")
        asyncio.run(run_load(url, args.model, steady[:8], 1))  # warm-up, untimed
        sampler = RssSampler(process.pid, interval=_SAMPLE_S)
        started = sampler.read()
        # Twice: this node's exact tier keeps a row from its second offer on, so the steady state has them.
        first = asyncio.run(run_load(url, args.model, steady, _STEADY_CLIENTS))
        asyncio.run(run_load(url, args.model, steady, _STEADY_CLIENTS))
        time.sleep(1.0)
        steady_memory = sampler.read()
        sampler.start()
        loaded = asyncio.run(run_load(url, args.model, burst, args.burst_clients))
        sampler.stop()
        peak = sampler.peaks()
        time.sleep(args.settle)
        after = sampler.read()
        again = asyncio.run(run_load(url, args.model, steady, _STEADY_CLIENTS))
        time.sleep(1.0)
        after_steady = sampler.read()
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        code = process.wait(120)
    errors = first["errors"] + loaded["errors"] + again["errors"]
    if code != 0 or errors:
        raise ConfigError(f"bench burst: the node exited {code} with {errors} failed requests"
                          f" ({(first['error_samples'] + loaded['error_samples'] + again['error_samples'])[:3]});"
                          f" its log: {log.read_text()[-2000:]}")
    bound = {"start": int(started["rss"]), "memory_budget": args.memory_budget,
             "rows": (args.max_call_rows + args.max_queued_rows) * ROW_BYTES}
    bound["rss"] = sum(bound.values())
    return {
        "memory": {"start": _kinds(started), "steady": _kinds(steady_memory),
                   "burst_peak": {k: peak[f"{k}_peak"] for k in ("rss", "anon", "file")},
                   "after": _kinds(after), "after_steady": _kinds(after_steady)},
        "bound": bound,
        "peak_within_bound": peak["rss_peak"] <= bound["rss"],
        "after_vs_steady": after["rss"] / steady_memory["rss"],
        "after_steady_vs_steady": after_steady["rss"] / steady_memory["rss"],
        "burst": {k: loaded[k] for k in ("wall_s", "rows", "requests", "rows_per_s", "p50_ms", "p99_ms")},
        "steady_rows_per_s": first["rows_per_s"], "errors": errors,
    }


def _kinds(sample: dict[str, float]) -> dict[str, int]:
    return {k: int(sample[k]) for k in ("rss", "anon", "file")}


# A row the node holds (in a call or queued), up to MiniLM's 256 tokens: its token ids (Python ints), text, ticket
# and JSON answer. Measured: 2,048 rows of 256 tokens held about 130 MB beyond the forwards.
ROW_BYTES = 64 * 2**10


def _print(result: dict[str, Any]) -> None:
    mib = 2**20
    print(f"{'MiB':24} {'VmRSS':>8} {'RssAnon':>8} {'RssFile':>8}")
    for name, kinds in result["memory"].items():
        print(f"{name:24} {kinds['rss'] / mib:8.0f} {kinds['anon'] / mib:8.0f} {kinds['file'] / mib:8.0f}")
    bound = result["bound"]
    print("bound = " + " + ".join(f"{k} {v / mib:.0f}" for k, v in bound.items() if k != "rss")
          + f" = {bound['rss'] / mib:.0f} MiB; burst peak {'within' if result['peak_within_bound'] else 'OVER'} it")
    print(f"after the burst: {result['after_vs_steady']:.3f}x steady; after steady traffic again:"
          f" {result['after_steady_vs_steady']:.3f}x; burst: {result['burst']['rows']} rows in"
          f" {result['burst']['wall_s']:.1f} s, p99 {result['burst']['p99_ms']:.0f} ms; errors {result['errors']}")
    sys.stdout.flush()
