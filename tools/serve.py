"""``attnstore serve``: run the store daemon (gRPC) over one map store.

Binds 127.0.0.1:50051 by default. Health (grpc.health.v1) says NOT_SERVING
while the store loads and while draining; SIGTERM/SIGINT drain and exit 0,
SIGHUP reloads the token file. Sizes accept binary suffixes: 512MiB, 8GiB.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from pathlib import Path

from attnstore.server.config import DEFAULT_LISTEN, DaemonConfig, ServerLimits
from attnstore.server.log_format import use_log_format
from attnstore_tools.arguments import DefaultsHelpFormatter

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from ``123``, ``64KiB``, ``512M``, ``8GiB`` or ``1T`` (binary units).

    Raises:
        argparse.ArgumentTypeError: not a size.
    """
    match = _SIZE_RE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use bytes or a suffix such as 512MiB, 8GiB")
    unit = (match.group(2) or "").upper()[:1]
    return int(match.group(1)) * _UNITS[unit]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    limits = ServerLimits()
    p = subparsers.add_parser(
        "serve",
        help="run the store daemon (gRPC)",
        description=__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument(
        "--store", required=True,
        help="map store directory, or redis://HOST:PORT/ (one Redis server) or redis://HOST:PORT/?cluster=1"
        " (a Redis Cluster; any node) shared by any number of daemons; &prefix=NAME picks the store within it",
    )
    p.add_argument("--listen", default=DEFAULT_LISTEN, help="HOST:PORT to bind; port 0 picks a free port")
    p.add_argument("--create", action="store_true", help="create the store if it does not exist")
    p.add_argument(
        "--readonly",
        action="store_true",
        help="serve the store read-only: admin writes fail, and entries another writer adds later are not searched"
        " until a restart (the index is built at start)",
    )
    p.add_argument("--dram-bytes", type=parse_size, help="DRAM cache of decoded maps (default: the store's, 1GiB)")
    p.add_argument("--max-bytes", type=parse_size, help="cap on stored bytes; least recently hit entries are evicted")
    p.add_argument("--map-size", type=parse_size, help="LMDB map size (default: the store's, 1TiB of address space)")
    p.add_argument(
        "--token-file", type=Path, help="'role token' lines (roles: read, write, admin); without it auth is OFF"
    )
    p.add_argument(
        "--admit-after", type=int, default=2,
        help="exact-tier asks before a missed row is admitted for write-back (1: every miss; 0: write-back off)",
    )
    p.add_argument(
        "--quarantine-file", type=Path,
        help="where the objects nodes' audits found wrong are kept across restarts (default: quarantine.json in"
        " an LMDB store's folder; a Redis store's daemon keeps them in memory)",
    )
    p.add_argument("--tls-cert", type=Path, help="server certificate chain (PEM); needs --tls-key")
    p.add_argument("--tls-key", type=Path, help="server private key (PEM)")
    p.add_argument("--tls-client-ca", type=Path, help="require client certificates signed by this CA (mTLS)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (0: any free port)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="metrics bind address")
    p.add_argument("--grace", type=float, default=10.0, help="seconds calls in flight get to finish on SIGTERM")
    p.add_argument("--max-message-bytes", type=parse_size, default=limits.max_message_bytes, help="gRPC message cap")
    p.add_argument("--workers", type=int, default=limits.max_workers, help="RPC threads (one per running stream)")
    p.add_argument("--max-concurrent-rpcs", type=int, default=limits.max_concurrent_rpcs, help="calls admitted at once")
    p.add_argument(
        "--max-queries", type=int, default=limits.max_queries,
        help="queries per Lookup/Search call, ids per Fetch/Prefetch call",
    )
    p.add_argument(
        "--max-ingest-bytes", type=parse_size, default=limits.max_ingest_bytes, help="staged bytes per Ingest stream"
    )
    p.add_argument("--max-ingest-streams", type=int, default=limits.max_ingest_streams, help="Ingest streams at once")
    p.add_argument(
        "--ingest-idle-seconds", type=int, default=limits.ingest_idle_seconds,
        help="end an Ingest stream that sends nothing for this long (it frees its slot; nothing is written)",
    )
    p.add_argument("--ready-file", type=Path, help="write {address, port, metrics_port, pid} as JSON here once serving")
    p.add_argument("--log-format", choices=["text", "json"], default="text", help="key=value text or JSON lines")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> DaemonConfig:
    """The daemon settings of parsed ``serve`` arguments.

    Raises:
        ConfigError: invalid combination or value.
    """
    return DaemonConfig(
        store=args.store,
        listen=args.listen,
        create=args.create,
        readonly=args.readonly,
        dram_bytes=args.dram_bytes,
        max_bytes=args.max_bytes,
        map_size=args.map_size,
        token_file=args.token_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        admit_after=args.admit_after,
        quarantine_file=args.quarantine_file,
        limits=ServerLimits(
            max_message_bytes=args.max_message_bytes,
            max_workers=args.workers,
            max_concurrent_rpcs=args.max_concurrent_rpcs,
            max_queries=args.max_queries,
            max_ingest_bytes=args.max_ingest_bytes,
            max_ingest_streams=args.max_ingest_streams,
            ingest_idle_seconds=args.ingest_idle_seconds,
        ),
        grace_seconds=args.grace,
        ready_file=args.ready_file,
    )


def run(args: argparse.Namespace) -> int:
    """Run the daemon until SIGTERM/SIGINT; returns its exit code."""
    # A daemon's lifecycle events are INFO: raise the CLI's default WARNING level
    # (an explicit --log-level ERROR still quiets it).
    if getattr(args, "log_level", "WARNING") == "WARNING":
        logging.getLogger().setLevel(logging.INFO)
    use_log_format(args.log_format)
    config = config_from_args(args)
    from attnstore.server.daemon import run_daemon  # loads the service (faiss, lmdb) only when serving

    code = run_daemon(config)
    if code != 0:
        # Calls stuck past the grace period hold pool threads the interpreter would wait for at exit.
        logging.shutdown()
        os._exit(code)
    return code
