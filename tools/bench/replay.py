"""``attnstore bench replay``: prefill time of map replay against the sdpa and eager baselines.

Per length, one batch of ``--batch`` rows of exactly that many random token ids
(fixed seed) is captured once (fp32 maps kept in memory: the "maps already in
memory" case, no retrieval). Then, in one process on the same inputs, the sdpa
baseline, the eager baseline and the all-hit replay forward run round-robin
(so load from other processes hits all three alike) after a warm-up, and the
median of ``--repeats`` runs of each is reported. A separate, untimed sdpa pass
with forward hooks measures the share of block time spent in the attention
modules.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from attnstore.errors import ConfigError
from attnstore_tools.arguments import documented_parser, positive_ints
from attnstore_tools.machine import cpu_model
from attnstore_tools.output import write_json
from attnstore_tools.timing import add_timing_arguments, median_ms, time_rounds


@dataclass(frozen=True)
class ReplayTiming:
    """One length's medians (ms) and ratios."""

    length: int
    sdpa_ms: float
    eager_ms: float
    replay_ms: float
    speedup_vs_sdpa: float
    speedup_vs_eager: float
    speedup_vs_best: float  # against the faster of the two baselines
    attention_share: float  # of block time in the attention modules, sdpa baseline


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``replay`` to the ``bench`` group."""
    parser = documented_parser(
        subparsers, "replay", __doc__, summary="prefill time: map replay vs sdpa and eager baselines"
    )
    parser.add_argument("--model", default="smollm2", help="alias (minilm, smollm2) or local model path")
    parser.add_argument("--lengths", default="32,128,512", help="comma-separated token lengths (default: 32,128,512)")
    parser.add_argument("--batch", type=int, default=16, help="rows per batch (default: 16)")
    add_timing_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table, write the JSON; returns the exit code."""
    lengths = positive_ints(args.lengths, "--lengths")
    if args.batch < 1 or args.repeats < 5 or args.warmup < 0 or args.threads < 1:
        raise ConfigError(
            f"need --batch >= 1, --repeats >= 5, --warmup >= 0, --threads >= 1; got batch={args.batch}, "
            f"repeats={args.repeats}, warmup={args.warmup}, threads={args.threads}"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    from attnstore_client.adapters import adapter_for
    from attnstore_client.models import load_model

    loaded = load_model(args.model, attn_implementation="sdpa")
    adapter = adapter_for(loaded)
    max_positions = getattr(loaded.model.config, "max_position_embeddings", None)
    if max_positions is not None and max(lengths) > max_positions:
        raise ConfigError(f"--lengths {max(lengths)} exceeds the model's {max_positions} positions")
    results = []
    for length in lengths:
        results.append(_bench_length(adapter, length, args))
        _print_row(results[-1], header=len(results) == 1)
    report = {
        "machine": _machine(),
        "model": args.model,
        "batch": args.batch,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "seed": args.seed,
        "results": [asdict(result) for result in results],
    }
    if args.json is not None:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0


def _bench_length(adapter, length: int, args: argparse.Namespace) -> ReplayTiming:
    from attnstore_client.adapters.batch import batch_from_ids

    generator = torch.Generator().manual_seed(args.seed + length)
    vocab = adapter.loaded.model.config.vocab_size
    # Skip the low ids, where tokenizers keep their special tokens.
    ids = torch.randint(min(1000, vocab // 2), vocab, (args.batch, length), generator=generator)  # (B, L)
    batch = batch_from_ids(ids.tolist(), pad_id=0)
    maps = adapter.capture(batch).maps  # per row (layers, H, L, L) fp32
    replay = dict(enumerate(maps))
    model = adapter.loaded.model

    # Each returns None: the timing samples keep what a call returns, and the outputs are not needed.
    def sdpa() -> None:
        adapter.forward(batch)

    def eager() -> None:
        model.set_attn_implementation("eager")
        try:
            adapter.forward(batch)
        finally:
            model.set_attn_implementation("sdpa")

    def replayed() -> None:
        adapter.forward(batch, replay)

    variants: dict[str, Callable[[], None]] = {"sdpa": sdpa, "eager": eager, "replay": replayed}
    samples = time_rounds(variants, repeats=args.repeats, warmup=args.warmup)
    share = _attention_share(adapter, batch)
    sdpa_ms, eager_ms, replay_ms = (median_ms(s.seconds for s in samples[n]) for n in ("sdpa", "eager", "replay"))
    return ReplayTiming(
        length=length,
        # 4 decimals: the ratios recomputed from sub-millisecond times (tiny models) stay within 0.1%.
        sdpa_ms=round(sdpa_ms, 4),
        eager_ms=round(eager_ms, 4),
        replay_ms=round(replay_ms, 4),
        speedup_vs_sdpa=round(sdpa_ms / replay_ms, 3),
        speedup_vs_eager=round(eager_ms / replay_ms, 3),
        speedup_vs_best=round(min(sdpa_ms, eager_ms) / replay_ms, 3),
        attention_share=round(share, 3),
    )


def _attention_share(adapter, batch) -> float:
    """Share of block time spent in the attention modules, one untimed sdpa pass with hooks."""
    totals = {"block": 0.0, "attention": 0.0}
    starts: dict[int, float] = {}
    handles = []

    def before(module: torch.nn.Module, _inputs: object) -> None:
        starts[id(module)] = time.perf_counter()

    def after(kind: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, _inputs: object, _output: object) -> None:
            totals[kind] += time.perf_counter() - starts.pop(id(module))

        return hook

    try:
        for kind, modules in (("block", adapter.blocks), ("attention", adapter.attention_modules)):
            for module in modules:
                handles.append(module.register_forward_pre_hook(before))
                handles.append(module.register_forward_hook(after(kind)))
        adapter.forward(batch)
    finally:
        for handle in handles:
            handle.remove()
    return totals["attention"] / totals["block"] if totals["block"] else 0.0



def _machine() -> dict[str, object]:
    import transformers

    return {
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
    }


_COLUMNS: Sequence[tuple[str, str, int]] = (
    ("length", "L", 6),
    ("sdpa_ms", "sdpa ms", 11),
    ("eager_ms", "eager ms", 11),
    ("replay_ms", "replay ms", 11),
    ("speedup_vs_sdpa", "x sdpa", 8),
    ("speedup_vs_eager", "x eager", 8),
    ("attention_share", "attn share", 11),
)


def _print_row(result: ReplayTiming, *, header: bool) -> None:
    if header:
        print("".join(title.rjust(width) for _, title, width in _COLUMNS))
    values = asdict(result)
    print("".join(f"{values[key]}".rjust(width) for key, _, width in _COLUMNS))
    sys.stdout.flush()
