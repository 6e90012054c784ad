"""``attnstore bench store``: map store read latency, ingest rate and bytes per codec.

One entry of SmolLM2's shape (30 layers x 9 heads x 128 x 128, 8.8 MB fp16) with
softmax maps from random logits (causal), so codec ratios are realistic. Reads
are timed from the DRAM cache, from the page cache (no DRAM cache) and cold
(``posix_fadvise(DONTNEED)`` on the data file with the store closed, so the
pages come from disk), each beside a memcpy of the same bytes in the same run.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import numpy as np
import torch

from attnstore.protocol.records import CODECS, NamespaceLayout, NewEntry
from attnstore.store.base import MapStoreBase
from attnstore.store.codecs import q8_error_bound
from attnstore.store.lmdb.env import DATA_FILE, read_current
from attnstore.store.opening import open_store
from attnstore_tools.output import write_json
from attnstore_tools.timing import median_ms, time_rounds

_TARGETS = {"pagecache_over_memcpy": 2.0, "dram_over_memcpy": 1.2, "q8_zstd_over_fp16": 0.30}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``store`` benchmark parser."""
    parser = subparsers.add_parser("store", help="map store: read latency per tier, ingest rate, bytes per codec")
    parser.add_argument("--json", type=Path, required=True, help="write the results as JSON here")
    parser.add_argument("--dir", type=Path, default=None, help="directory for the bench store (default: a temp dir)")
    parser.add_argument("--layers", type=int, default=30, help="layers per entry (default: 30, SmolLM2)")
    parser.add_argument("--heads", type=int, default=9, help="heads per layer (default: 9, SmolLM2)")
    parser.add_argument("--length", type=int, default=128, help="token length L (default: 128)")
    parser.add_argument("--entries", type=int, default=8, help="distinct entries ingested per codec (default: 8)")
    parser.add_argument("--runs", type=int, default=21, help="timed runs per figure, median reported (default: 21)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first (default: 3)")
    parser.add_argument("--logit-std", type=float, default=3.0, help="std of the random logits (default: 3.0)")
    parser.set_defaults(func=run)


def synthetic_maps(layers: int, heads: int, length: int, seed: int, logit_std: float) -> np.ndarray:
    """Causal softmax maps ``(layers, heads, L, L)`` fp32 from random normal logits."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=logit_std, size=(layers, heads, length, length)).astype(np.float32)
    logits[..., ~np.tri(length, dtype=bool)] = -np.inf
    logits -= logits.max(axis=-1, keepdims=True)
    weights = np.exp(logits)  # (layers, heads, L, L)
    return weights / weights.sum(axis=-1, keepdims=True)


def _timed_pair(
    read: Callable[[], object],
    src: np.ndarray,
    dst: np.ndarray,
    runs: int,
    warmup: int,
    each_round: Callable[[], AbstractContextManager[object]] | None = None,
) -> tuple[float, float]:
    """Median ms of ``read()`` and of a memcpy of ``src`` into ``dst``, interleaved in one loop.

    ``each_round`` is entered around every round, untimed (the cold figure's reopen).
    """

    def read_and_drop() -> None:  # samples keep what a call returns: not the maps of every run
        read()

    samples = time_rounds(
        {"memcpy": lambda: np.copyto(dst, src), "read": read_and_drop}, repeats=runs, warmup=warmup,
        each_round=each_round,
    )
    return median_ms(s.seconds for s in samples["read"]), median_ms(s.seconds for s in samples["memcpy"])


def _drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _namespace(codec: str) -> str:
    return "bench-" + codec.replace("+", "-")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table and write JSON. Returns the exit code."""
    own_dir = args.dir is None
    base = Path(tempfile.mkdtemp(prefix="attnstore-bench-")) if own_dir else args.dir
    root = base / "store"
    if root.exists():
        shutil.rmtree(root)
    try:
        result = _bench(root, args)
    finally:
        if own_dir:
            shutil.rmtree(base, ignore_errors=True)
    write_json(args.json, result)
    _print_table(result)
    return 0


def _bench(root: Path, args: argparse.Namespace) -> dict:
    layers, heads, length, runs, warmup = args.layers, args.heads, args.length, args.runs, args.warmup
    maps = [synthetic_maps(layers, heads, length, seed, args.logit_std) for seed in range(args.entries)]
    entries = [NewEntry(maps=m, token_hash=hashlib.sha256(str(i).encode()).digest()) for i, m in enumerate(maps)]
    nbytes = 2 * maps[0].size
    result: dict = {
        "entry_shape": [layers, heads, length, length],
        "entry_bytes_fp16": nbytes,
        "entries": args.entries,
        "runs": runs,
        "warmup": warmup,
        "logit_std": args.logit_std,
        "cores": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
    }

    # Ingest, one durable transaction per entry; then the other codecs for bytes and decode times.
    ids: dict[str, list[int]] = {}
    with open_store(root, create=True, dram_bytes=0).store as store:
        for codec in CODECS:
            layout = NamespaceLayout(layers=layers, heads=heads, causal=True, hidden=8, codec=codec)
            store.create_namespace(_namespace(codec), model="bench", fingerprint="bench", layout=layout)
            t0 = time.perf_counter()
            ids[codec] = [store.ingest(_namespace(codec), [e]).entry_ids[0] for e in entries]
            seconds = time.perf_counter() - t0
            key = codec.replace("+", "_")
            result[f"ingest_{key}_entries_per_s"] = args.entries / seconds
            result[f"ingest_{key}_mb_per_s"] = args.entries * nbytes / seconds / 1e6
            bucket = store.stats()
            ns_stats = next(n for n in bucket.namespaces if n.name == _namespace(codec))
            result[f"bytes_{key}"] = ns_stats.stored_bytes // ns_stats.entries
        result["ingest_entries_per_s"] = result["ingest_fp16_entries_per_s"]
        result["ingest_mb_per_s"] = result["ingest_fp16_mb_per_s"]
        for codec in ("q8", "q8+zstd"):
            decoded = store.read_maps(_namespace(codec), ids[codec][0]).astype(np.float32)
            bound = q8_error_bound(maps[0].max(axis=-1))[..., None]
            result[f"{codec.replace('+', '_')}_max_error"] = float(np.abs(decoded - maps[0]).max())
            result[f"{codec.replace('+', '_')}_within_bound"] = bool((np.abs(decoded - maps[0]) <= bound).all())

        # Page cache: no DRAM cache, data warm; every codec, round robin over the entries.
        src = maps[0].astype(np.float16)
        dst = np.empty_like(src)
        for codec in CODECS:
            cycle = iter(ids[codec] * (warmup + runs + 1))
            read_ms, copy_ms = _timed_pair(
                lambda c=codec, it=cycle: store.read_maps(_namespace(c), next(it)), src, dst, runs, warmup
            )
            result[f"pagecache_{codec.replace('+', '_')}_ms"] = read_ms
            if codec == "fp16":
                result["pagecache_ms"], result["memcpy_ms"] = read_ms, copy_ms

    # DRAM cache: admit once, then every read is a hit (a copy out of the cache).
    with open_store(root, dram_bytes=4 * nbytes).store as store:
        entry_id = ids["fp16"][0]
        store.read_maps(_namespace("fp16"), entry_id)
        read_ms, copy_ms = _timed_pair(lambda: store.read_maps(_namespace("fp16"), entry_id), src, dst, runs, warmup)
        result["dram_ms"], result["dram_memcpy_ms"] = read_ms, copy_ms
        result["dram_hits"] = store.stats().dram.hits

    # Cold: store closed (pages unmapped), data file dropped from the page cache, reopened, one read.
    data_file = root / read_current(root) / DATA_FILE
    opened: dict[str, MapStoreBase] = {}
    cycle = iter(ids["fp16"] * (warmup + runs))

    @contextmanager
    def reopened_cold() -> Iterator[None]:
        _drop_page_cache(data_file)
        with open_store(root, dram_bytes=0).store as store:
            opened["store"] = store
            yield

    result["cold_ms"], result["cold_memcpy_ms"] = _timed_pair(
        lambda: opened["store"].read_maps(_namespace("fp16"), next(cycle)), src, dst, runs, warmup, reopened_cold
    )

    for tier in ("dram", "pagecache", "cold", "memcpy"):
        result[f"{tier}_gb_per_s"] = nbytes / (result[f"{tier}_ms"] / 1e3) / 1e9
    result["pagecache_over_memcpy"] = result["pagecache_ms"] / result["memcpy_ms"]
    result["dram_over_memcpy"] = result["dram_ms"] / result["dram_memcpy_ms"]
    result["q8_zstd_over_fp16"] = result["bytes_q8_zstd"] / result["bytes_fp16"]
    result["targets"] = {k: {"target": v, "value": result[k], "met": result[k] <= v} for k, v in _TARGETS.items()}
    return result


def _print_table(r: dict) -> None:
    mb = r["entry_bytes_fp16"] / 1e6
    print(f"map store bench: entry {r['entry_shape']} = {mb:.1f} MB fp16, {r['cores']} cores, median of {r['runs']}")
    print(f"{'read path':<26}{'ms':>9}{'GB/s':>9}{'x memcpy':>10}")
    rows = [
        ("DRAM cache", r["dram_ms"], r["dram_memcpy_ms"]),
        ("page cache (fp16)", r["pagecache_ms"], r["memcpy_ms"]),
        ("cold, from disk (fp16)", r["cold_ms"], r["cold_memcpy_ms"]),
        ("memcpy", r["memcpy_ms"], r["memcpy_ms"]),
    ]
    for name, ms, copy_ms in rows:
        print(f"{name:<26}{ms:>9.3f}{r['entry_bytes_fp16'] / ms / 1e6:>9.2f}{ms / copy_ms:>10.2f}")
    print(f"{'codec':<12}{'bytes/entry':>13}{'of fp16':>9}{'read ms':>9}{'ingest/s':>10}")
    for codec in CODECS:
        key = codec.replace("+", "_")
        print(
            f"{codec:<12}{r[f'bytes_{key}']:>13,}{r[f'bytes_{key}'] / r['bytes_fp16']:>9.1%}"
            f"{r[f'pagecache_{key}_ms']:>9.2f}{r[f'ingest_{key}_entries_per_s']:>10.1f}"
        )
    for name, target in r["targets"].items():
        print(f"target {name}: {target['value']:.2f} <= {target['target']}: {'met' if target['met'] else 'NOT met'}")
