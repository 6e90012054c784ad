"""``attnstore bench prefix``: the forward on the suffix with a stored prefix against the full forward.

For every prefix length × suffix length, ``--batch`` rows share one random
prefix (fixed seed) and have their own random suffixes. The prefix's blocks are
stored in a real LMDB store in a temporary folder (the model's dtype, blocks of
``--block-size`` tokens). Then, round-robin in one process on the same inputs
after a warm-up, the full sdpa forward of the whole rows and the prefix path
(the store's keys and values read layer by layer as the forward reaches each
layer, plus the prefix's hidden states: retrieval included) run, and the
median of ``--repeats`` runs of each is reported with the bytes read per row.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from attnstore.errors import ConfigError
from attnstore_tools.arguments import documented_parser, positive_ints
from attnstore_tools.machine import cpu_model
from attnstore_tools.output import write_json
from attnstore_tools.timing import add_timing_arguments, median_ms, time_rounds


@dataclass(frozen=True)
class PrefixTiming:
    """One cell's medians (ms) and ratio."""

    prefix: int  # tokens taken from the store
    suffix: int  # tokens computed
    full_ms: float
    prefix_ms: float  # retrieval included
    speedup: float
    bytes_per_row: int


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``prefix`` to the ``bench`` group."""
    parser = documented_parser(subparsers, "prefix", __doc__,
                               summary="forward on the suffix with stored keys and values vs the full forward")
    parser.add_argument("--model", default="smollm2", help="alias or local model path of a causal model")
    parser.add_argument("--prefixes", default="128,512,1024", help="prefix lengths (default: 128,512,1024)")
    parser.add_argument("--suffixes", default="16,64,256", help="suffix lengths (default: 16,64,256)")
    parser.add_argument("--batch", type=int, default=1, help="rows per forward (default: 1)")
    parser.add_argument("--block-size", type=int, default=32, help="tokens per prefix block (default: 32)")
    add_timing_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table, write the JSON; returns the exit code."""
    prefixes, suffixes = positive_ints(args.prefixes, "--prefixes"), positive_ints(args.suffixes, "--suffixes")
    if args.batch < 1 or args.repeats < 5 or args.warmup < 0 or args.threads < 1 or args.block_size < 1:
        raise ConfigError("need --batch >= 1, --repeats >= 5, --warmup >= 0, --threads >= 1, --block-size >= 1")
    bad = [p for p in prefixes if p % args.block_size]
    if bad:
        raise ConfigError(f"--prefixes must be multiples of --block-size {args.block_size}; {bad} are not")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    from attnstore_client.adapters import adapter_for
    from attnstore_client.models import load_model

    adapter = adapter_for(load_model(args.model))
    results = []
    with tempfile.TemporaryDirectory(prefix="attnstore-bench-prefix-") as folder:
        for prefix in prefixes:
            for suffix in suffixes:
                results.append(_cell(adapter, Path(folder) / f"p{prefix}-s{suffix}", prefix, suffix, args))
                _print_row(results[-1], header=len(results) == 1)
    report = {
        "machine": {"cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "cpu_model": cpu_model()},
        "model": args.model, "batch": args.batch, "block_size": args.block_size, "repeats": args.repeats,
        "warmup": args.warmup, "seed": args.seed, "results": [asdict(r) for r in results],
    }
    if args.json is not None:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0


def _cell(adapter, path: Path, prefix: int, suffix: int, args: argparse.Namespace) -> PrefixTiming:
    from attnstore.protocol.records import NamespaceLayout
    from attnstore.service import AttnStoreService
    from attnstore_client.adapters.batch import batch_from_ids
    from attnstore_client.connection.local import LocalConnection
    from attnstore_client.keys import model_fingerprint
    from attnstore_client.tiers.prefix import capture_prefix_blocks, forward_with_prefix, prefix_layout_of

    generator = torch.Generator().manual_seed(args.seed + prefix * 7919 + suffix)
    vocab = adapter.loaded.model.config.vocab_size
    low = min(1000, vocab // 2)  # skip the low ids, where tokenizers keep their special tokens
    shared = torch.randint(low, vocab, (prefix,), generator=generator).tolist()
    rows = [shared + torch.randint(low, vocab, (suffix,), generator=generator).tolist() for _ in range(args.batch)]
    fingerprint = model_fingerprint(adapter.loaded.model, adapter.loaded.tokenizer)
    with AttnStoreService.open(path, create=True) as service:
        service.create_namespace("bench", model=str(args.model), fingerprint=fingerprint, layout=NamespaceLayout(
            layers=adapter.num_layers, heads=adapter.num_heads, causal=True, hidden=adapter.hidden_size,
            feature_dim=16))
        layout = service.store.prefixes.set_layout("bench", prefix_layout_of(adapter, block_size=args.block_size))
        for blocks in capture_prefix_blocks(adapter, [shared], layout, pad_id=0):
            service.store.prefixes.put("bench", blocks)
        connection = LocalConnection("local:bench", service)
        chain = _chain(shared, layout.block_size)
        full_batch = batch_from_ids(rows, 0)
        suffix_batch = batch_from_ids([row[prefix:] for row in rows], 0)
        fetched = [0]

        def full() -> None:
            adapter.forward(full_batch)

        def stored() -> None:
            stream = connection.fetch_prefix("bench", fingerprint, layout.block_size, [chain] * len(rows), timeout=None)
            forward_with_prefix(adapter, suffix_batch, prefix, stream)
            for row in range(len(rows)):
                stream.hidden(row)
            fetched[0] = stream.bytes_fetched // len(rows)

        samples = time_rounds({"full": full, "prefix": stored}, repeats=args.repeats, warmup=args.warmup)
    full_ms, prefix_ms = (median_ms(s.seconds for s in samples[name]) for name in ("full", "prefix"))
    return PrefixTiming(prefix, suffix, round(full_ms, 2), round(prefix_ms, 2), round(full_ms / prefix_ms, 3),
                        fetched[0])


def _chain(ids: list[int], block_size: int) -> list[bytes]:
    from attnstore.protocol.prefix import chain_hashes

    return chain_hashes(ids, block_size)



def _print_row(result: PrefixTiming, *, header: bool) -> None:
    if header:
        print(f"{'prefix':>7} {'suffix':>7} {'full ms':>10} {'prefix ms':>10} {'speedup':>8} {'MiB/row':>8}")
    print(f"{result.prefix:>7} {result.suffix:>7} {result.full_ms:>10.1f} {result.prefix_ms:>10.1f} "
          f"{result.speedup:>7.2f}x {result.bytes_per_row / 2**20:>8.1f}")
