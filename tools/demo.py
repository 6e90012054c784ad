"""``attnstore demo``: exact map replay on a real model, end to end in under a minute.

Loads all-MiniLM-L6-v2, takes held-out sentences (``sentence1`` of STS-B test),
captures their attention maps, then runs the normal forward and the replay
forward on the same right-padded batch, and prints how close the replayed outputs
are (max abs diff of the last hidden states, cosine of the mean-pooled sentence
embeddings) and both timings. Replaying a model's own maps must reproduce it.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
from pathlib import Path

import torch

from attnstore.errors import ConfigError

# The repository's sibling ``shared/data`` (see the data README), unless told otherwise.
_DEFAULT_DATA_DIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
_DATA_ENV = "ATTNSTORE_DATA"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the top-level ``demo`` command."""
    parser = subparsers.add_parser(
        "demo",
        help="replay a real model's own attention maps and compare with its normal forward",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="minilm", help="alias or local model path (default: minilm)")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help=f"evaluation data folder (default: ${_DATA_ENV}, else ../shared/data next to the repository)",
    )
    parser.add_argument("--sentences", type=int, default=64, help="held-out sentences in the batch (default: 64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each forward, median taken (default: 5)")
    parser.set_defaults(func=run)


def data_dir(explicit: Path | None) -> Path:
    """Resolve the data folder: ``explicit``, else ``$ATTNSTORE_DATA``, else the repository default.

    Raises:
        ConfigError: the folder does not exist.
    """
    chosen = explicit or (Path(os.environ[_DATA_ENV]) if os.environ.get(_DATA_ENV) else _DEFAULT_DATA_DIR)
    chosen = chosen.resolve()
    if not chosen.is_dir():
        raise ConfigError(f"data folder {chosen} does not exist; pass --data-dir or set {_DATA_ENV}")
    return chosen


def held_out_sentences(folder: Path, count: int) -> list[str]:
    """Return the first ``count`` ``sentence1`` values of STS-B test (held out from every store).

    Raises:
        ConfigError: the file is missing or has fewer sentences.
    """
    path = folder / "stsb_test.tsv"
    if not path.is_file():
        raise ConfigError(f"{path} not found; the data folder needs stsb_test.tsv (see its README)")
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        sentences = [row["sentence1"] for row, _ in zip(reader, range(count))]
    if len(sentences) < count:
        raise ConfigError(f"{path} has {len(sentences)} sentences, the demo asked for {count}")
    return sentences


def run(args: argparse.Namespace) -> int:
    """Run the demo and print its report; returns the exit code."""
    if args.sentences < 1 or args.repeats < 1:
        raise ConfigError(f"--sentences and --repeats must be >= 1, got {args.sentences} and {args.repeats}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from attnstore_client.adapters import adapter_for
    from attnstore_client.batch import tokenize
    from attnstore_client.models import load_model

    sentences = held_out_sentences(data_dir(args.data_dir), args.sentences)
    started = time.perf_counter()
    loaded = load_model(args.model)
    adapter = adapter_for(loaded)
    print(f"model {args.model} ({adapter.family}, {adapter.num_layers} layers x {adapter.num_heads} heads), "
          f"loaded in {time.perf_counter() - started:.1f} s")
    batch = tokenize(loaded.tokenizer, sentences)
    print(f"batch: {batch.size} held-out STS-B test sentences, lengths {min(batch.lengths)}..{max(batch.lengths)} "
          f"tokens, right-padded to {batch.padded_length}")

    started = time.perf_counter()
    maps = adapter.capture(batch).maps
    megabytes = sum(row.numel() * row.element_size() for row in maps) / 2**20
    print(f"captured maps: {megabytes:.1f} MiB fp32 in {time.perf_counter() - started:.2f} s")

    replay = dict(enumerate(maps))
    normal, normal_ms = _timed(lambda: adapter.forward(batch), args.repeats)
    replayed, replay_ms = _timed(lambda: adapter.forward(batch, replay), args.repeats)

    mask = batch.attention_mask.unsqueeze(-1).to(normal.dtype)  # (B, P, 1)
    max_diff = ((normal - replayed).abs() * mask).max().item()
    cosine = torch.nn.functional.cosine_similarity(_mean_pool(normal, mask), _mean_pool(replayed, mask), dim=-1)  # (B,)
    print(f"max abs diff of last hidden states (real tokens): {max_diff:.2e}")
    print(f"cosine of mean-pooled embeddings: min {cosine.min().item():.6f}, mean {cosine.mean().item():.6f}")
    print(f"normal forward (sdpa): {normal_ms:.1f} ms   replay forward: {replay_ms:.1f} ms   "
          f"speedup {normal_ms / replay_ms:.2f}x  (median of {args.repeats}, {torch.get_num_threads()} threads)")
    return 0


def _timed(forward, repeats: int) -> tuple[torch.Tensor, float]:
    output = forward()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        output = forward()
        times.append((time.perf_counter() - started) * 1000.0)
    return output, statistics.median(times)


def _mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1)  # (B, hidden)
