"""What grouping forwards by length saves on the misses of ``attnstore bench stream``.

    python scripts/stream_padding.py [--every 3] [--json out.json]

The rows a per-node dict computes on the bench's stream (the 8 Loghub systems,
first 500 lines of each in the dicts, 4 nodes, batches of 32): each batch's
distinct misses, longest first, as sentence-transformers batches them. Every
``--every``-th such batch is run through all-MiniLM-L6-v2's forward (1 torch
thread) two ways, in alternating order: one forward padded to its longest row,
and the forwards ``group_by_length`` cuts it into with forward times fitted by
the cost model from a sweep of forward shapes timed first (the fit the client
makes from its own forwards). Prints the tokens and the medians of 3 timings per
batch, summed; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from attnstore_client.adapters import adapter_for
from attnstore_client.adapters.batch import batch_from_ids, group_by_length
from attnstore_client.models import load_model
from attnstore_client.tiers.cost_model import CostModel, CostSettings
from attnstore_tools.bench.stream import LOGHUB, load_stream

NODES, BATCH, REPEATS = 4, 32, 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--every", type=int, default=3, help="time every N-th batch with misses")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    build, stream = load_stream(LOGHUB, 500, 12_000)
    loaded = load_model("minilm")
    adapter = adapter_for(loaded)
    tokenizer = loaded.tokenizer
    limit = loaded.sentence_transformer.max_seq_length if loaded.sentence_transformer is not None else 256

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, truncation=True, max_length=limit)["input_ids"])

    # The per-node dicts' misses, batch by batch (duplicates within a batch computed once).
    tables = [set(build) for _ in range(NODES)]
    missed: list[list[list[int]]] = []
    for k, start in enumerate(range(0, len(stream), BATCH)):
        table = tables[k % NODES]
        misses = list(dict.fromkeys(t for t in stream[start : start + BATCH] if t not in table))
        table.update(misses)
        if misses:
            missed.append(sorted((ids(t) for t in misses), key=len, reverse=True))

    def forward_seconds(rows: list[list[int]]) -> float:
        batch = batch_from_ids(rows, tokenizer.pad_token_id)
        started = time.perf_counter()
        with torch.inference_mode():
            adapter.forward(batch)
        return time.perf_counter() - started

    # The fit, as the client makes it: the cost model fed timed forwards of a sweep of shapes.
    model = CostModel(CostSettings(decay=1.0))
    rng = np.random.default_rng(0)
    for rows, padded in [(n, p) for n in (1, 4, 16, 32) for p in (8, 24, 64, 128)] * 2:
        row = [int(t) for t in rng.integers(1000, 2000, size=padded)]
        model.record_forward(padded, computed_tokens=rows * padded, replayed_tokens=0,
                             seconds=forward_seconds([row] * rows))
    cost = model.forward_cost()
    assert cost is not None

    one_s: list[float] = []
    grouped_s: list[float] = []
    real = padded_one = padded_grouped = forwards = 0
    for k, rows in enumerate(missed[:: args.every]):
        lengths = [len(r) for r in rows]
        groups = group_by_length(lengths, BATCH, cost.seconds)
        real += sum(lengths)
        padded_one += len(rows) * lengths[0]
        padded_grouped += sum((g.stop - g.start) * lengths[g.start] for g in groups)
        forwards += len(groups)
        times: dict[str, list[float]] = {"one": [], "grouped": []}
        for repeat in range(REPEATS):
            for way in (("one", "grouped") if (k + repeat) % 2 == 0 else ("grouped", "one")):
                if way == "one":
                    times[way].append(forward_seconds(rows))
                else:
                    times[way].append(sum(forward_seconds(rows[g]) for g in groups))
        one_s.append(statistics.median(times["one"]))
        grouped_s.append(statistics.median(times["grouped"]))
    batches = len(one_s)
    result = {
        "batches_timed": batches, "batches_with_misses": len(missed), "real_tokens": real,
        "padded_tokens_one_forward": padded_one, "padded_tokens_grouped": padded_grouped,
        "forwards_grouped": forwards, "seconds_one_forward": sum(one_s), "seconds_grouped": sum(grouped_s),
        "speedup": sum(one_s) / sum(grouped_s),
        "fit": {"fixed_s": cost.fixed, "per_token_s": cost.per_token,
                "per_token_position_s": cost.per_token_position},
    }
    lines = [
        f"{'way':14} {'forwards':>8} {'padded tokens':>13} {'x real':>6} {'seconds':>8}",
        f"{'one forward':14} {batches:8d} {padded_one:13d} {padded_one / real:6.2f} {sum(one_s):8.2f}",
        f"{'grouped':14} {forwards:8d} {padded_grouped:13d} {padded_grouped / real:6.2f} {sum(grouped_s):8.2f}",
        f"grouped is {result['speedup']:.3f}x faster on {batches} of {len(missed)} miss batches ({real} real tokens);"
        f" fit: {1000 * cost.fixed:.2f} ms a forward, {1e6 * cost.per_token:.1f} us a padded token,"
        f" {1e9 * cost.per_token_position:.1f} ns a token x position",
    ]
    for line in lines:
        print(line)  # noqa: T201 (a measurement script prints its figures)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
