"""``attnstore bench service``: the client's paths through a real daemon against the plain model.

One process, one batch of ``--batch`` rows of exactly ``--length`` random token
ids (fixed seed), the model's own maps and outputs ingested into a daemon
subprocess on loopback (``attnstore serve``, a temporary store). Variants, run
round-robin after a warm-up round, median of ``--repeats``:

- ``baseline``: the plain forward (the model's ``sdpa`` attention);
- ``replay_memory``: every row replays its maps, already in memory (fp16, as stored);
- ``hit``: projection + Search + maps streamed over gRPC (FetchMaps) + replay that
  starts as layers arrive, the daemon reading the maps from its store (the page
  cache: this daemon runs with ``--dram-bytes 0``) (``hit_wait_all``: the same,
  replay starting after the last layer);
- ``hit_dram``: the ``hit`` path against a second daemon with its default DRAM
  tier, warmed until the entries are admitted: the maps come decoded from DRAM;
- ``miss``: an exact-tier Lookup and projection + Search in a namespace of other
  inputs (nothing close) + the plain forward;
- ``exact``: an exact-tier Lookup by token hash (nothing projected) + the stored
  outputs (no forward at all).

The client's own exact tier is off and its cost model sends every row for maps,
so each variant's path runs in full every round.

The projector is untrained (random weights of the namespace's shape): it costs
what a trained one costs, and identical inputs still match at distance 0.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from attnstore.errors import ConfigError
from attnstore_tools.arguments import documented_parser
from attnstore_tools.launcher import ServeProcess
from attnstore_tools.machine import cpu_model
from attnstore_tools.output import write_json
from attnstore_tools.timing import Sample, add_timing_arguments, median_ms, time_rounds

if TYPE_CHECKING:
    from attnstore_client.stats import CacheStats

# Serves after which the daemon's DRAM cache holds an entry (its admission: docs/guides/operations.md).
_DRAM_ADMITTED_AFTER = 2
_VARIANTS = ("baseline", "replay_memory", "hit", "hit_dram", "hit_wait_all", "miss", "exact")


@dataclass(frozen=True)
class VariantTiming:
    """Medians of one variant, in ms (the split is zero for the variants without a store)."""

    variant: str
    total_ms: float
    projection_ms: float
    lookup_ms: float
    fetch_ms: float  # overlaps forward_ms when maps stream into the running forward
    forward_ms: float
    mib_fetched: float
    speedup_including_retrieval: float  # baseline / total
    speedup_excluding_retrieval: float | None  # baseline / forward; None without a forward
    max_abs_diff: float  # of the last hidden states from the baseline's (real tokens)
    total_ms_samples: tuple[float, ...]  # every timed round, for the spread


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``service`` to the ``bench`` group."""
    parser = documented_parser(
        subparsers, "service", __doc__, summary="client paths through a daemon (hit, miss, exact) vs the plain forward"
    )
    parser.add_argument("--model", default="smollm2", help="alias (minilm, smollm2) or local model path")
    parser.add_argument("--length", type=int, default=128, help="tokens per row (default: 128)")
    parser.add_argument("--batch", type=int, default=16, help="rows per batch (default: 16)")
    add_timing_arguments(parser, unit="rounds", seed_of="the token ids")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table, write the JSON; returns the exit code."""
    if args.batch < 1 or args.length < 2 or args.repeats < 5 or args.warmup < 0 or args.threads < 1:
        raise ConfigError(
            "need --batch >= 1, --length >= 2, --repeats >= 5, --warmup >= 0, --threads >= 1; got "
            f"{args.batch}, {args.length}, {args.repeats}, {args.warmup}, {args.threads}"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    from attnstore_client.adapters import adapter_for
    from attnstore_client.models import load_model

    loaded = load_model(args.model, attn_implementation="sdpa")
    adapter = adapter_for(loaded)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="attnstore-bench-service-") as scratch:
        folders = Path(scratch) / "page-cache", Path(scratch) / "dram"
        for folder in folders:
            folder.mkdir()
        # Without a DRAM cache every hit reads its maps from the store; with one, repeated hits come from DRAM.
        daemon = ServeProcess(folders[0] / "store", folders[0], args=["--dram-bytes", "0"]).start(timeout=120)
        try:
            dram_daemon = ServeProcess(folders[1] / "store", folders[1]).start(timeout=120)
            try:
                timings = _measure(adapter, daemon.target, dram_daemon.target, args)
            finally:
                dram_daemon.stop(timeout=60)
        finally:
            daemon.stop(timeout=60)
    load_after = os.getloadavg()
    report = {
        "benchmark": "service",
        "model": args.model,
        "family": adapter.family,
        "layers": adapter.num_layers,
        "heads": adapter.num_heads,
        "length": args.length,
        "batch": args.batch,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "torch": torch.__version__,
        "variants": [asdict(t) for t in timings],
        "targets": _targets(timings),
    }
    print(format_table(timings, report))
    if args.json is not None:
        write_json(args.json, report)
    return 0


def _measure(adapter, target: str, dram_target: str, args: argparse.Namespace) -> list[VariantTiming]:
    from attnstore.store import NamespaceLayout, NewEntry
    from attnstore_client.adapters.batch import batch_from_ids
    from attnstore_client.cache import AttnCache
    from attnstore_client.connection import connect
    from attnstore_client.connection.daemon import DaemonClient
    from attnstore_client.keys import model_fingerprint, token_hash
    from attnstore_client.projector import Projector, ProjectorConfig
    from attnstore_client.resilience import RetryPolicy
    from attnstore_client.stats import CacheStats
    from attnstore_client.tiers.cost_model import CostSettings

    loaded = adapter.loaded
    vocab = loaded.model.config.vocab_size
    generator = torch.Generator().manual_seed(args.seed)
    rows = torch.randint(10, vocab, (2 * args.batch, args.length), generator=generator).tolist()
    pad = loaded.tokenizer.pad_token_id
    batch, others = batch_from_ids(rows[: args.batch], pad), batch_from_ids(rows[args.batch :], pad)
    torch.manual_seed(args.seed)
    projector = Projector(ProjectorConfig(hidden=adapter.hidden_size)).eval()
    fingerprint = model_fingerprint(loaded.model, loaded.tokenizer)
    layout = NamespaceLayout(layers=adapter.num_layers, heads=adapter.num_heads, causal=adapter.causal,
                             hidden=adapter.hidden_size, feature_dim=projector.config.dim)
    memory_maps: dict[int, torch.Tensor] = {}
    for name, rows_batch, targets in (("hit", batch, (target, dram_target)), ("miss", others, (target,))):
        capture = adapter.capture(rows_batch)
        features = projector.project(adapter.feature_source(rows_batch))
        entries = [
            NewEntry(maps=maps.to(torch.float16).numpy(), token_hash=token_hash(rows_batch.row_ids(row)),
                     outputs=hidden.to(torch.float16).numpy(), feature=features[row])
            for row, (maps, hidden) in enumerate(zip(capture.maps, capture.hidden, strict=True))
        ]
        for address in targets:
            with DaemonClient(address, timeout=600) as admin:
                admin.create_namespace(name, model=loaded.name, fingerprint=fingerprint, layout=layout,
                                       projector=projector.to_safetensors_bytes())
                admin.ingest(name, fingerprint, entries)
        if name == "hit":
            memory_maps = {row: maps.to(torch.float16) for row, maps in enumerate(capture.maps)}
        del capture, entries
    connection, dram_connection = connect(f"grpc://{target}"), connect(f"grpc://{dram_target}")

    def prefill(namespace: str, exact: bool, stream: bool, *, dram: bool = False) -> AttnCache:
        # Every row asked for maps (the cost model never skips), nothing kept in this process.
        return AttnCache(loaded, dram_connection if dram else connection, namespace=namespace, max_distance=1e-3,
                         exact=exact, stream=stream, timeout=600.0, retry=RetryPolicy(attempts=1),
                         exact_cache_bytes=0, cost=CostSettings(min_samples=2**62))

    # Each call keeps its latest output here and returns its counts: the samples keep only the counts.
    outputs: dict[str, torch.Tensor] = {}

    tokens = [batch.row_ids(row).tolist() for row in range(batch.size)]

    def cached(name: str, runner: AttnCache) -> Callable[[], CacheStats]:
        def call() -> CacheStats:
            hidden = runner.hidden_states(tokens, batch_size=batch.size, show_progress_bar=False)
            outputs[name] = torch.stack(hidden)  # (B, L, hidden): rows are all L tokens
            return runner.last_stats
        return call

    def plain(name: str, replay: dict | None) -> Callable[[], CacheStats]:
        def call() -> CacheStats:
            outputs[name] = adapter.forward(batch, replay)
            return CacheStats(rows=batch.size)
        return call

    calls = {
        "baseline": plain("baseline", None),
        "replay_memory": plain("replay_memory", memory_maps),
        "hit": cached("hit", prefill("hit", False, True)),
        "hit_dram": cached("hit_dram", prefill("hit", False, True, dram=True)),
        "hit_wait_all": cached("hit_wait_all", prefill("hit", False, False)),
        "miss": cached("miss", prefill("miss", True, True)),
        "exact": cached("exact", prefill("hit", True, True)),
    }
    for _ in range(_DRAM_ADMITTED_AFTER):
        calls["hit_dram"]()  # the daemon admits an entry to DRAM on its second serve
    samples = time_rounds(calls, repeats=args.repeats, warmup=args.warmup)
    connection.close()
    dram_connection.close()
    _check_dram(target, dram_target)
    _check_kinds(samples)
    base_ms = median_ms(s.seconds for s in samples["baseline"])
    return [_timing(name, samples[name], base_ms, outputs[name], outputs["baseline"]) for name in _VARIANTS]


def _check_kinds(samples: dict[str, list[Sample[CacheStats]]]) -> None:
    """The cache variants must have served rows the way their names say."""
    expected = {"hit": "map_hits", "hit_dram": "map_hits", "hit_wait_all": "map_hits", "miss": "misses",
                "exact": "exact_hits"}
    for name, field in expected.items():
        for sample in samples[name]:
            if getattr(sample.value, field) != sample.value.rows:
                raise ConfigError(f"bench service: variant {name} served {sample.value} instead of all {field}")


def _check_dram(target: str, dram_target: str) -> None:
    """``hit`` must have read its maps from the store and ``hit_dram`` from DRAM, as their names say."""
    from attnstore_client.connection.daemon import DaemonClient

    with DaemonClient(target) as plain, DaemonClient(dram_target) as dram:
        plain_hits, dram_hits = plain.stats().dram_hits, dram.stats().dram_hits
    if plain_hits or not dram_hits:
        raise ConfigError(f"bench service: DRAM-cache layer reads {plain_hits} without a DRAM cache and {dram_hits} "
                          "with one; expected none and some")


def _timing(
    name: str, samples: list[Sample[CacheStats]], base_ms: float, hidden: torch.Tensor, baseline: torch.Tensor
) -> VariantTiming:
    def counts_ms(get: Callable[[CacheStats], float]) -> float:
        return median_ms(get(s.value) for s in samples)

    total = median_ms(s.seconds for s in samples)
    forward = counts_ms(lambda c: c.forward_s) if name not in ("baseline", "replay_memory") else total
    return VariantTiming(
        variant=name,
        total_ms=total,
        projection_ms=counts_ms(lambda c: c.projection_s),
        lookup_ms=counts_ms(lambda c: c.lookup_s),
        fetch_ms=counts_ms(lambda c: c.fetch_s),
        forward_ms=forward,
        mib_fetched=statistics.median(s.value.bytes_fetched for s in samples) / 2**20,
        speedup_including_retrieval=base_ms / total,
        speedup_excluding_retrieval=base_ms / forward if forward > 0 else None,
        max_abs_diff=(hidden.float() - baseline).abs().max().item(),
        total_ms_samples=tuple(round(s.seconds * 1000, 1) for s in samples),
    )


def _targets(timings: list[VariantTiming]) -> dict[str, dict[str, float | bool]]:
    by = {t.variant: t for t in timings}
    hit = by["hit"].total_ms / by["replay_memory"].total_ms
    miss = by["miss"].total_ms / by["baseline"].total_ms
    exact = by["baseline"].total_ms / by["exact"].total_ms
    return {
        "hit_vs_replay_memory": {"ratio": hit, "target": 1.10, "met": hit <= 1.10},
        "miss_vs_baseline": {"ratio": miss, "target": 1.03, "met": miss <= 1.03},
        "exact_speedup": {"ratio": exact, "target": 10.0, "met": exact >= 10.0},
    }


def format_table(timings: list[VariantTiming], report: dict) -> str:
    """The results as a plain-text table with the targets below."""
    lines = [
        f"model {report['model']} ({report['layers']} layers x {report['heads']} heads), L = {report['length']}, "
        f"batch {report['batch']}, {report['torch_threads']} torch threads, {report['cpu_count']} cores, "
        f"median of {report['repeats']}",
        f"{'variant':<14}{'total ms':>10}{'proj':>8}{'lookup':>8}{'fetch':>8}{'forward':>9}{'MiB':>8}"
        f"{'x incl':>8}{'x excl':>8}{'max diff':>10}",
    ]
    for t in timings:
        excl = "-" if t.speedup_excluding_retrieval is None else f"{t.speedup_excluding_retrieval:.2f}"
        lines.append(
            f"{t.variant:<14}{t.total_ms:>10.1f}{t.projection_ms:>8.1f}{t.lookup_ms:>8.1f}{t.fetch_ms:>8.1f}"
            f"{t.forward_ms:>9.1f}{t.mib_fetched:>8.1f}{t.speedup_including_retrieval:>8.2f}{excl:>8}"
            f"{t.max_abs_diff:>10.2e}"
        )
    for name, target in report["targets"].items():
        verdict = "met" if target["met"] else "NOT met"
        lines.append(f"{name}: {target['ratio']:.3f} (target {target['target']}) {verdict}")
    return "\n".join(lines)
