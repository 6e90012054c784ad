"""What the prefix tier costs calls that no stored prefix serves: AttnCache with it on vs off, same store.

    python scripts/prefix_tier_overhead.py [--tasks mmlu,sts,sst2] [--rounds 9] [--queries 64] [--json FILE]

For the 0-shot tasks of ``attnstore eval`` with SmolLM2 (mmlu, sts, sst2: the
stores ``attnstore eval`` built under runs/eval/stores, their namespaces), one
process, one torch thread: the first ``--queries`` held-out queries, tokenized
as the evaluation does, through ``AttnCache.hidden_states`` with the prefix
tier on and off, alternating call by call (the order flips every round), the
node-local exact tier and the map tier off so that every call does the same
work but for the prefix tier (map lookups explore at random, which would make
calls differ). Prints the median and the fastest seconds per call and their
ratios (on / off), and writes them, with every call's time, as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from attnstore_client.adapters.batch import tokenize
from attnstore_client.cache import AttnCache
from attnstore_client.models import load_model
from attnstore_tools.eval.tasks import load_task

ROOT = Path(__file__).resolve().parents[1]
STORES = {  # task -> (store folder, namespace) as `attnstore eval <task> --model smollm2` builds them
    "mmlu": ("smollm2-mmlu-0shot-n20", "mmlu-0shot"),
    "sts": ("smollm2-sts-n3000", "sts"),
    "sst2": ("smollm2-sst2-n2000", "sst2"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(STORES), help="comma-separated, of " + ", ".join(STORES))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--stores", type=Path, default=ROOT / "runs" / "eval" / "stores")
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model("smollm2")
    results = {}
    for task_name in args.tasks.split(","):
        folder, namespace = STORES[task_name]
        if not (args.stores / folder).exists():
            print(f"{task_name}: no store {args.stores / folder} (run `attnstore eval {task_name} --model smollm2`)")  # noqa: T201
            continue
        task = load_task(task_name, args.data, decoder=True)  # type: ignore[arg-type]
        batch = tokenize(loaded.tokenizer, task.queries[: args.queries])
        ids = [list(batch.row_ids(row)) for row in range(batch.size)]
        cache = AttnCache(loaded, f"local:{args.stores / folder}", namespace=namespace, exact_cache_bytes=0)
        cache.maps = False
        times: dict[bool, list[float]] = {True: [], False: []}
        prefix_hits = 0
        for round_ in range(args.rounds + 1):  # the first round warms up
            for prefix in (True, False) if round_ % 2 == 0 else (False, True):
                cache.prefix = prefix
                started = time.perf_counter()
                cache.hidden_states(ids, show_progress_bar=False)
                if round_:
                    times[prefix].append(time.perf_counter() - started)
                prefix_hits += cache.last_stats.prefix_hits if prefix else 0
        cache.close()
        on, off = statistics.median(times[True]), statistics.median(times[False])
        fastest = min(times[True]) / min(times[False])
        results[task_name] = {"queries": len(ids), "rounds": args.rounds, "on_s": on, "off_s": off,
                              "ratio": on / off, "ratio_fastest": fastest, "prefix_hits": prefix_hits,
                              "on_all_s": times[True], "off_all_s": times[False]}
        print(f"{task_name:5} {len(ids)} queries: prefix tier on {on:.3f} s, off {off:.3f} s (medians), "  # noqa: T201
              f"on/off {on / off:.3f} (fastest calls: {fastest:.3f}), prefix hits {prefix_hits}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
