"""``attnstore bench load``: many client processes against one daemon, mixed Lookup and Ingest.

Starts a real daemon on loopback (``attnstore serve``, its own token file, caps
set below) over a store seeded with synthetic entries, or uses ``--target``.
``--daemons N`` starts N daemons on one shared ``redis://`` store and gives
every client all their addresses (gRPC round_robin spreads the calls).
``--clients`` separate processes (multiprocessing spawn) then run for
``--duration`` seconds: Lookups of ``--batch`` rows with maps streamed (half
near-duplicates of seeded entries, a quarter exact duplicates, a quarter
misses) and, with probability ``--ingest-fraction``, an Ingest of two new
entries. Every served map and output is checked against the seeded entry it
must come from (crc32c of the bytes): a wrong or damaged row counts as an error
(``WRONG_ROW``), like a failed call (by its gRPC status code).

Reported: calls, throughput, p50/p99 latency per RPC, errors by code, rows by
kind, and the daemon's RSS sampled from ``/proc/PID/status`` over the run,
against its configured caps plus a stated fixed overhead.

``--kill-daemon-after SECONDS`` (with ``--daemons`` 2 or more) is a fault run:
the last daemon is SIGKILLed that far into the traffic, and the clients go on
with the others. Lookups broken mid-stream are sent again (counted as
``streams_retried``); an Ingest in flight on the killed daemon may fail
UNAVAILABLE (write-type calls are not sent again once under way), so a run that
must show 0 errors takes ``--ingest-fraction 0``.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import crc32c
import grpc
import numpy as np

from attnstore.errors import AttnStoreError
from attnstore.protocol.records import LookupBatch, NamespaceLayout, NewEntry
from attnstore.protocol.requests import lookup_request
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.store.redis.urls import is_redis_url, shown_location, store_location
from attnstore_client.connection.daemon import DaemonClient
from attnstore_tools.arguments import positive_int
from attnstore_tools.launcher import ServeProcess
from attnstore_tools.machine import RssSampler
from attnstore_tools.output import write_json

logger = logging.getLogger(__name__)

NAMESPACE = "load"
FINGERPRINT = "10ad" * 16
_MIB = 1 << 20
_SEED_BATCH = 32


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """What the clients send; shared by the parent and every client process."""

    entries: int = 256  # seeded entries
    length: int = 32  # tokens per entry
    layers: int = 6  # all-MiniLM-L6-v2's shape: 6 layers x 12 heads
    heads: int = 12
    hidden: int = 384
    feature_dim: int = 128
    batch: int = 8  # rows per Lookup
    ingest_fraction: float = 0.1  # share of calls that are an Ingest of two new entries
    max_distance: float = 1.0  # near-duplicates sit at ~0.1, other entries at ~16
    noise: float = 0.01  # std of the perturbation that makes a near-duplicate

    @property
    def layout(self) -> NamespaceLayout:
        """The namespace layout of the synthetic entries."""
        return NamespaceLayout(
            layers=self.layers, heads=self.heads, causal=True, hidden=self.hidden, feature_dim=self.feature_dim
        )


@dataclass(frozen=True, slots=True)
class DaemonCaps:
    """The caps the bench gives the daemon it starts; the RSS budget is built from them."""

    dram_bytes: int = 64 * _MIB  # DRAM cache of decoded maps
    max_bytes: int = 256 * _MIB  # stored bytes; ingest past it evicts the least recently hit
    max_ingest_bytes: int = 8 * _MIB  # staged bytes per Ingest stream (a stream here stages ~0.3 MiB)
    max_ingest_streams: int = 16  # Ingest streams at once: one per client, so none is refused for want of a slot
    workers: int = 32  # RPC threads
    fixed_overhead: int = 512 * _MIB  # interpreter, torch, faiss, grpc, indexes: see docs/BENCHMARKS.md

    @property
    def anon_budget(self) -> int:
        """Anonymous memory the daemon may use: fixed overhead + DRAM cache + staged ingest."""
        return self.fixed_overhead + self.dram_bytes + self.max_ingest_bytes * self.max_ingest_streams


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``load`` benchmark to the ``bench`` group."""
    spec, caps = LoadSpec(), DaemonCaps()
    p = subparsers.add_parser("load", help="N client processes, mixed Lookup/Ingest, against one daemon")
    p.add_argument("--clients", type=positive_int, default=16, help="client processes (default: 16)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of traffic (default: 60)")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--store", help="store directory or redis:// URL for the daemon (default: a temp dir, removed)")
    p.add_argument("--daemons", type=positive_int, default=1,
                   help="daemons on the store (more than one needs a redis:// --store); clients use them all")
    p.add_argument("--target", help="HOST:PORT of a running daemon instead (needs --token; no RSS figures)")
    p.add_argument("--token", help="admin token for --target")
    p.add_argument("--entries", type=positive_int, default=spec.entries, help="seeded entries")
    p.add_argument("--length", type=positive_int, default=spec.length, help="tokens per entry")
    p.add_argument("--batch", type=positive_int, default=spec.batch, help="rows per Lookup")
    p.add_argument("--ingest-fraction", type=float, default=spec.ingest_fraction, help="share of Ingest calls")
    p.add_argument("--dram-bytes", type=int, default=caps.dram_bytes, help="daemon DRAM cache (bytes)")
    p.add_argument("--max-bytes", type=int, default=caps.max_bytes, help="daemon stored-bytes cap")
    p.add_argument(
        "--max-ingest-streams", type=positive_int, default=caps.max_ingest_streams, help="daemon Ingest streams"
    )
    p.add_argument("--fixed-overhead", type=int, default=caps.fixed_overhead, help="stated fixed RSS overhead")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--kill-daemon-after", type=float, metavar="SECONDS",
                   help="fault run: SIGKILL the last daemon this far into the traffic (needs --daemons 2 or more)")
    p.set_defaults(func=run)


# ---- synthetic entries ---------------------------------------------------------------


def synthetic_entry(spec: LoadSpec, key: int) -> NewEntry:
    """Entry number ``key``: causal softmax maps of random logits, outputs, feature, token hash; fp16."""
    rng = np.random.default_rng(key)
    logits = rng.normal(scale=3.0, size=(spec.layers, spec.heads, spec.length, spec.length))
    logits[..., ~np.tri(spec.length, dtype=bool)] = -np.inf
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))  # (layers, heads, L, L)
    maps = (weights / weights.sum(axis=-1, keepdims=True)).astype(np.float16)
    return NewEntry(
        maps=maps,
        token_hash=key.to_bytes(32, "little"),
        outputs=rng.normal(size=(spec.length, spec.hidden)).astype(np.float16),  # (L, hidden)
        feature=rng.normal(size=spec.feature_dim).astype(np.float32),
    )


# ---- the client process ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClientJob:
    """Everything one client process needs (plain values: it crosses a spawn)."""

    index: int
    target: str
    token: str
    spec: LoadSpec
    entry_ids: dict[int, int]  # seeded key -> entry id
    duration: float
    seed: int  # with ``index``, seeds this client's choices
    out: str  # JSON result path


def client_main(job: ClientJob, barrier: multiprocessing.synchronize.Barrier) -> None:
    """One client process: wait at the barrier, then send traffic for ``job.duration`` seconds."""
    spec = job.spec
    expected = {}  # entry id -> (key, crc of maps, crc of outputs)
    features = {}  # key -> feature
    for key, entry_id in job.entry_ids.items():
        entry = synthetic_entry(spec, key)
        expected[entry_id] = (key, crc32c.crc32c(entry.maps.tobytes()), crc32c.crc32c(entry.outputs.tobytes()))
        features[key] = entry.feature
    rng = np.random.default_rng((job.seed, job.index))
    latencies: dict[str, list[float]] = {"Lookup": [], "Ingest": []}
    errors: Counter[str] = Counter()
    rows: Counter[str] = Counter()
    next_key = (job.index + 1) * 10_000_000
    with DaemonClient(job.target, token=job.token, timeout=30) as remote:
        remote.health()
        barrier.wait()
        end = time.monotonic() + job.duration
        while time.monotonic() < end:
            ingest = rng.random() < spec.ingest_fraction
            if ingest:  # built before the clock starts: the latency is the daemon's, not numpy's
                new = [synthetic_entry(spec, next_key + i) for i in range(2)]
                next_key += 2
            start = time.perf_counter()
            try:
                if ingest:
                    remote.ingest(NAMESPACE, FINGERPRINT, new)
                else:
                    _lookup_and_check(remote, spec, features, expected, rng, rows, errors)
            except AttnStoreError as exc:
                errors[_code_of(exc)] += 1
                continue
            latencies["Ingest" if ingest else "Lookup"].append(time.perf_counter() - start)
        retried = remote.streams_retried
    Path(job.out).write_text(json.dumps({"latencies": latencies, "errors": errors, "rows": rows,
                                         "streams_retried": retried}))


def _lookup_and_check(
    remote: DaemonClient,
    spec: LoadSpec,
    features: dict[int, np.ndarray],
    expected: dict[int, tuple[int, int, int]],
    rng: np.random.Generator,
    rows: Counter[str],
    errors: Counter[str],
) -> None:
    """One Lookup of ``spec.batch`` rows; counts rows by kind and wrong rows as errors."""
    picks = rng.choice(list(features), size=spec.batch)
    roles = rng.choice(["near", "exact", "near", "miss"], size=spec.batch)
    rows_features, hashes = [], []
    for key, role in zip(picks, roles, strict=True):
        feature = features[int(key)]
        if role == "miss":
            feature = rng.normal(size=spec.feature_dim).astype(np.float32) * 4.0
        elif role == "near":
            feature = feature + rng.normal(scale=spec.noise, size=spec.feature_dim).astype(np.float32)
        rows_features.append(feature)
        hashes.append(int(key).to_bytes(32, "little") if role == "exact" else None)
    request = lookup_request(LookupBatch(
        NAMESPACE, FINGERPRINT, np.stack(rows_features), [spec.length] * spec.batch,
        token_hashes=hashes, max_distance=spec.max_distance,
    ))
    result = remote.lookup(request)
    for row, (match, key, role) in enumerate(zip(result.matches, picks, roles, strict=True)):
        kind = {pb.MATCH_KIND_EXACT: "exact", pb.MATCH_KIND_MAP: "map"}.get(match.kind, "miss")
        rows[kind] += 1
        if kind == "miss":
            continue  # evicted by the byte cap, or a deliberate miss: never wrong
        want = expected.get(match.entry_id)
        if role == "miss" or want is None or want[0] != int(key):
            errors["WRONG_ROW"] += 1  # a hit on another entry than the one the row came from
        elif (kind == "exact" and crc32c.crc32c(result.outputs[row].tobytes()) != want[2]) or (
            kind == "map" and row not in result.row_errors and crc32c.crc32c(result.maps[row].tobytes()) != want[1]
        ):
            errors["WRONG_ROW"] += 1
    for error in result.row_errors.values():
        errors[f"ROW_{error.code}"] += 1


def _code_of(exc: AttnStoreError) -> str:
    cause = exc.__cause__
    return cause.code().name if isinstance(cause, grpc.Call) else type(exc).__name__


# ---- the daemon under test ------------------------------------------------------------------


def _start_daemon(
    store: Path | str, workdir: Path, caps: DaemonCaps, admin: str | None = None
) -> tuple[ServeProcess, str]:
    """``attnstore serve`` with ``caps`` and a fresh token file; returns it, serving, and its admin token.

    Raises:
        DaemonProcessError: it exited or did not serve within a minute (its log is in the message).
    """
    admin = admin or secrets.token_hex(16)
    workdir.mkdir(parents=True, exist_ok=True)
    tokens = workdir / "tokens.txt"
    tokens.write_text(f"admin {admin}\n", encoding="utf-8")
    tokens.chmod(0o600)
    daemon = ServeProcess(store, workdir, args=[
        "--token-file", str(tokens),
        "--dram-bytes", str(caps.dram_bytes), "--max-bytes", str(caps.max_bytes),
        "--max-ingest-bytes", str(caps.max_ingest_bytes), "--max-ingest-streams", str(caps.max_ingest_streams),
        "--workers", str(caps.workers),
    ])
    return daemon.start(timeout=60), admin


def _seed(target: str, token: str, spec: LoadSpec) -> dict[int, int]:
    """Create the namespace and ingest the seeded entries; returns key -> entry id."""
    ids: dict[int, int] = {}
    with DaemonClient(target, token=token, timeout=120) as remote:
        remote.create_namespace(NAMESPACE, model="synthetic-load", fingerprint=FINGERPRINT, layout=spec.layout)
        for start in range(0, spec.entries, _SEED_BATCH):
            keys = list(range(start, min(start + _SEED_BATCH, spec.entries)))
            summary = remote.ingest(NAMESPACE, FINGERPRINT, [synthetic_entry(spec, k) for k in keys])
            ids.update(zip(keys, summary.entry_ids, strict=True))
    return ids


# ---- the run -----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Run the load, print the table, write JSON; returns 0 with zero errors, 1 otherwise."""
    spec = LoadSpec(entries=args.entries, length=args.length, batch=args.batch, ingest_fraction=args.ingest_fraction)
    caps = DaemonCaps(
        dram_bytes=args.dram_bytes, max_bytes=args.max_bytes, max_ingest_streams=args.max_ingest_streams,
        fixed_overhead=args.fixed_overhead,
    )
    if args.target is not None and not args.token:
        raise SystemExit("attnstore bench load: --target needs --token (an admin token)")
    if args.kill_daemon_after is not None and (args.daemons < 2 or args.target is not None):
        raise SystemExit("attnstore bench load: --kill-daemon-after needs --daemons 2 or more (its own daemons)"
                         f" to go on with, got --daemons {args.daemons}" + (" and --target" if args.target else ""))
    store = None if args.store is None else store_location(args.store)
    if args.daemons > 1 and not is_redis_url(store):
        raise SystemExit("attnstore bench load: --daemons > 1 needs a shared store: --store redis://HOST:PORT/...")
    with tempfile.TemporaryDirectory(prefix="attnstore-load-") as scratch:
        workdir = Path(scratch)
        daemons: list[ServeProcess] = []
        daemon = victim = None
        try:
            if args.target is None:
                token = secrets.token_hex(16)
                for i in range(args.daemons):
                    daemons.append(_start_daemon(store or workdir / "store", workdir / f"daemon-{i}", caps, token)[0])
                daemon = daemons[0]
                target = ",".join(d.target for d in daemons)
            else:
                target, token = args.target, args.token
            entry_ids = _seed(target, token, spec)
            if len(daemons) > 1:
                from attnstore.service.follower import FOLLOW_SECONDS  # here: client processes never load the service

                time.sleep(FOLLOW_SECONDS + 1.0)  # every daemon's index has the seeded entries: past the bound
            sampler = RssSampler(daemon.pid) if daemon else None
            idle = sampler.read() if sampler else None
            victim = daemons[-1] if args.kill_daemon_after is not None else None
            fault = None if victim is None else threading.Timer(args.kill_daemon_after, _kill, (victim,))
            results = _run_clients(
                args.clients, args.duration, args.seed, target, token, spec, entry_ids, workdir, sampler, fault
            )
            report = _report(args, spec, caps, results, sampler, idle, daemon is not None)
        finally:
            for process in daemons:
                code = process.stop(timeout=60)
                if code != 0 and process is not victim:
                    logger.error("the daemon exited with %s; see %s", code, process.log_path)
    _print_table(report)
    if args.json:
        write_json(args.json, report)
    return 0 if report["errors_total"] == 0 else 1


def _kill(daemon: ServeProcess) -> None:
    """A fault run's fault: SIGKILL ``daemon`` (the clients go on with the others)."""
    daemon.stop(signal.SIGKILL)
    logger.warning("fault: SIGKILLed the daemon at %s", daemon.target)


def _run_clients(
    clients: int, duration: float, seed: int, target: str, token: str, spec: LoadSpec,
    entry_ids: dict[int, int], workdir: Path, sampler: RssSampler | None, fault: threading.Timer | None = None,
) -> list[dict]:
    """Start the client processes, release them together, wait; their results in client order.

    ``fault`` (a fault run's kill) is started with the traffic.
    """
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(clients + 1)
    jobs = [
        ClientJob(i, target, token, spec, entry_ids, duration, seed, str(workdir / f"client-{i}.json"))
        for i in range(clients)
    ]
    processes = [context.Process(target=client_main, args=(job, barrier), name=f"load-client-{job.index}")
                 for job in jobs]
    for process in processes:
        process.start()
    barrier.wait(timeout=300)  # every client has imported, built its expectations and connected
    if sampler is not None:
        sampler.start()
    if fault is not None:
        fault.start()
    for process in processes:
        process.join(duration + 120)
    if fault is not None:
        fault.cancel()
        fault.join()
    if sampler is not None:
        sampler.stop()
    failed = [p.name for p in processes if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"client processes failed: {failed}")
    return [json.loads(Path(job.out).read_text(encoding="utf-8")) for job in jobs]


def _percentiles_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50_ms": None, "p99_ms": None, "mean_ms": None}
    array = np.asarray(values) * 1000.0
    return {"p50_ms": round(float(np.percentile(array, 50)), 2), "p99_ms": round(float(np.percentile(array, 99)), 2),
            "mean_ms": round(float(array.mean()), 2)}


def _report(
    args: argparse.Namespace, spec: LoadSpec, caps: DaemonCaps, results: list[dict],
    sampler: RssSampler | None, idle: dict[str, float] | None, own_daemon: bool,
) -> dict:
    errors: Counter[str] = Counter()
    rows: Counter[str] = Counter()
    rpcs = {}
    for name in ("Lookup", "Ingest"):
        values = [v for r in results for v in r["latencies"][name]]
        rpcs[name] = {"calls": len(values), "calls_per_s": round(len(values) / args.duration, 1),
                      **_percentiles_ms(values)}
    for r in results:
        errors.update(r["errors"])
        rows.update(r["rows"])
    report = {
        "command": "attnstore bench load " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "load"] else []),
        "clients": args.clients,
        "daemons": args.daemons if own_daemon else None,
        "store": "lmdb" if args.store is None or not is_redis_url(args.store) else shown_location(args.store),
        "duration_s": args.duration,
        "cpu_count": os.cpu_count(),
        "load_average_after": os.getloadavg(),
        "spec": asdict(spec),
        "rpcs": rpcs,
        "rows": dict(rows),
        "rows_served_per_s": round((rows["exact"] + rows["map"]) / args.duration, 1),
        "errors": dict(errors),
        "errors_total": sum(errors.values()),
        "killed_daemon_after_s": args.kill_daemon_after,
        "streams_retried": sum(r["streams_retried"] for r in results),
    }
    if own_daemon and sampler is not None and idle is not None:
        samples = sampler.samples
        peak_anon = max(s["anon"] for s in samples)
        report["daemon"] = {  # the first daemon's, when there are several
            "caps": asdict(caps),
            "anon_budget_bytes": caps.anon_budget,
            "rss_idle": idle,
            "rss_peak_bytes": max(s["rss"] for s in samples),
            "anon_peak_bytes": peak_anon,
            "file_peak_bytes": max(s["file"] for s in samples),
            "anon_within_budget": peak_anon <= caps.anon_budget,
            "samples": samples,
        }
    return report


def _print_table(report: dict) -> None:
    print(f"load: {report['clients']} client processes for {report['duration_s']:g} s against"
          f" {report['daemons'] or 'a running'} daemon(s) on {report['store']},"
          f" {report['cpu_count']} cores, batch {report['spec']['batch']}, L={report['spec']['length']}")
    print(f"{'rpc':<8} {'calls':>7} {'calls/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for name, r in report["rpcs"].items():
        cells = [f"{r[k]:>8.2f}" if r[k] is not None else f"{'-':>8}" for k in ("p50_ms", "p99_ms", "mean_ms")]
        print(f"{name:<8} {r['calls']:>7} {r['calls_per_s']:>8.1f} {' '.join(cells)}")
    rows = report["rows"]
    print(f"rows: exact {rows.get('exact', 0)}, map {rows.get('map', 0)}, miss {rows.get('miss', 0)};"
          f" {report['rows_served_per_s']} served rows/s")
    print(f"errors: {report['errors_total']}" + (f" {report['errors']}" if report["errors"] else ""))
    if report["killed_daemon_after_s"] is not None:
        print(f"fault: one daemon SIGKILLed {report['killed_daemon_after_s']:g} s in;"
              f" {report['streams_retried']} streams sent again")
    daemon = report.get("daemon")
    if daemon:
        mib = 1 << 20
        idle = daemon["rss_idle"]
        print(f"daemon RSS: idle {idle['rss'] / mib:.0f} MiB (anon {idle['anon'] / mib:.0f}),"
              f" peak {daemon['rss_peak_bytes'] / mib:.0f} MiB (anon {daemon['anon_peak_bytes'] / mib:.0f},"
              f" file-backed {daemon['file_peak_bytes'] / mib:.0f});"
              f" anon budget {daemon['anon_budget_bytes'] / mib:.0f} MiB:"
              f" {'within' if daemon['anon_within_budget'] else 'OVER'}")
