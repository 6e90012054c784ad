"""The ceiling of ``attnstore bench encode --data logs --rows 8000`` against its dict: the rows both compute.

    python scripts/encode_ceiling.py [--rounds 3] [--threads 2] [--json out.json]

The dict and AttnCache compute the same distinct rows of that call (the held-out
lines no stored line equals), so AttnCache's margin is only in how fast those rows
run. In one process, warm, interleaved: sentence-transformers' ``encode`` of those
rows (``batch_size`` 32, what the dict runs) and AttnCache's packed forwards of them
(32 rows a forward, longest first). Prints the medians and the GFLOP/s at
all-MiniLM-L6-v2's 21.2 MFLOP a token (its linear layers); ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from attnstore_client.adapters import adapter_for
from attnstore_client.adapters.packed import pack
from attnstore_client.models import load_model
from attnstore_tools.bench.encode import load_data
from attnstore_tools.corpus import data_dir

FLOP_PER_TOKEN = 6 * 2 * (4 * 384 * 384 + 2 * 384 * 1536)  # all-MiniLM-L6-v2's linear layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
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

    methods: dict[str, Callable[[], None]] = {"sentence_transformers_encode": encode, "packed_forwards": packed}
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    for run in methods.values():  # warm-up: every shape built once
        run()
    for _ in range(args.rounds):
        for name, run in methods.items():
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)
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


if __name__ == "__main__":
    main()
