"""The ceiling of ``attnstore bench encode --data logs --rows 8000`` against its dict: the rows both compute.

    python scripts/encode_ceiling.py [--rounds 3] [--threads 2] [--json out.json]

The dict and AttnCache compute the same distinct rows of that call (the held-out
lines no stored line equals), so AttnCache's margin is only in how fast those rows
run. In one process, warm, interleaved: sentence-transformers' ``encode`` of those
rows (``batch_size`` 32, what the dict runs), AttnCache's packed forwards of them
(32 rows a forward, longest first), the same as the compute tier runs them now
(forwards of at least ``LEAST_TOKENS`` side by side, one thread each) and, with
``--engines``, on each installed graph engine as the compute tier runs it (its
streams side by side, right-padded batches of at most 1,024 tokens: unpadded, one
token count a batch, and within ``GRAPH_PADDING``). Prints the medians and the
GFLOP/s at all-MiniLM-L6-v2's 21.2 MFLOP a token (its linear layers); ``--json``
writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch

from attnstore_client.adapters import adapter_for
from attnstore_client.adapters.batch import batch_from_ids, within_padding
from attnstore_client.adapters.packed import pack
from attnstore_client.models import load_model
from attnstore_client.tiers.compute import GRAPH_PADDING, LEAST_TOKENS
from attnstore_client.tiers.engines.graphs import GRAPH_ENGINES, export_graph, installed
from attnstore_client.tiers.engines.runtimes import open_engine
from attnstore_client.tiers.forward_pool import ForwardPool
from attnstore_tools.bench.encode import load_data
from attnstore_tools.corpus import data_dir

T = TypeVar("T")

FLOP_PER_TOKEN = 6 * 2 * (4 * 384 * 384 + 2 * 384 * 1536)  # all-MiniLM-L6-v2's linear layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--engines", action="store_true", help="also each installed graph engine's forwards")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    stored, queries, _, _ = load_data("logs", data_dir(None))
    known = set(stored)
    misses = list(dict.fromkeys(text for text in queries if text not in known))
    loaded = load_model("minilm")
    model = loaded.sentence_transformer
    assert model is not None
    adapter = adapter_for(loaded)
    ids = sorted((loaded.tokenizer(text, truncation=True, max_length=256)["input_ids"] for text in misses),
                 key=len, reverse=True)
    tokens = sum(map(len, ids))

    def packed() -> None:
        with torch.inference_mode():
            for start in range(0, len(ids), 32):
                adapter.forward_packed(pack(ids[start:start + 32]))

    def encode() -> None:
        model.encode(misses, batch_size=32, show_progress_bar=False)

    pool = ForwardPool()
    side_by_side = _least_tokens(ids, LEAST_TOKENS)

    def packed_forward(rows: list[list[int]]) -> None:
        with torch.inference_mode():
            adapter.forward_packed(pack(rows))

    methods: dict[str, Callable[[], None]] = {
        "sentence_transformers_encode": encode, "packed_forwards": packed,
        "packed_side_by_side": partial(_run_all, pool, packed_forward, side_by_side, args.threads)}
    for graph_engine in (GRAPH_ENGINES if args.engines else ()):
        if not installed(graph_engine):
            continue
        engine = open_engine(graph_engine, export_graph(graph_engine, loaded), threads=args.threads,
                             streams=args.threads)
        pad = loaded.tokenizer.pad_token_id
        for label, waste in (("unpadded", 0.0), ("padded", GRAPH_PADDING)):
            parts = within_padding([len(row) for row in ids], waste=waste, max_tokens=LEAST_TOKENS // args.threads)
            batches = [batch_from_ids(ids[part], pad) for part in parts]
            methods[f"{graph_engine}_{label}"] = partial(_run_all, pool, engine.forward, batches, args.threads)
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    for run in methods.values():  # warm-up: every shape built once
        run()
    for _ in range(args.rounds):
        for name, run in methods.items():
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)
    pool.close()
    report: dict = {"rows": len(misses), "tokens": tokens, "threads": args.threads, "methods": {}}
    lines = []
    for name, runs in seconds.items():
        median = statistics.median(runs)
        rate = tokens * FLOP_PER_TOKEN / median / 1e9
        report["methods"][name] = {"seconds": median, "runs": runs, "gflop_per_s": rate}
        lines.append(f"{name:30s} {median:7.2f} s  {rate:6.1f} GFLOP/s  runs {' '.join(f'{x:.2f}' for x in runs)}")
    ratio = statistics.median(seconds["sentence_transformers_encode"]) / statistics.median(seconds["packed_forwards"])
    lines.append(f"{len(misses)} rows, {tokens} tokens: packed forwards {ratio:.2f}x sentence-transformers' encode")
    for line in lines:
        print(line)  # noqa: T201 (a measurement script prints its figures)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1), encoding="utf-8")


def _least_tokens(ids: list[list[int]], least: int) -> list[list[list[int]]]:
    """``ids`` in order, cut into forwards of at least ``least`` tokens (the last may hold fewer)."""
    forwards: list[list[list[int]]] = [[]]
    for row in ids:
        if sum(map(len, forwards[-1])) >= least:
            forwards.append([])
        forwards[-1].append(row)
    return forwards


def _run_all(pool: ForwardPool, forward: Callable[[T], object], inputs: list[T], workers: int) -> None:
    """``forward`` of every input, ``workers`` side by side on ``pool`` (as the compute tier runs its forwards)."""
    for _ in pool.run([partial(forward, one) for one in inputs], workers):
        pass


if __name__ == "__main__":
    main()
