"""``attnstore backup``: copy a map store consistently, also while a daemon serves it.

Run it on the daemon's host against the store directory. The copy holds every
entry committed before it started (one LMDB read transaction) and is itself a
store: serve it with ``attnstore serve --store DEST`` to restore.

A Redis store (``--store redis://...``) is exported entry by entry into a new
LMDB store at ``--to`` (``--namespace`` picks namespaces; default all); restore
it with ``--store DIR --to redis://...``. That copy is not a snapshot (entries
written meanwhile may or may not be in it), and a restore gives new entry ids.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from attnstore.errors import ConfigError
from attnstore.store.base import MapStoreBase
from attnstore.store.lmdb.compaction import backup_store
from attnstore.store.redis.urls import is_redis_url, store_location
from attnstore_tools.output import write_json


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``backup`` subcommand."""
    p = subparsers.add_parser("backup", help="consistent copy of a map store (safe while serving)",
                              description=__doc__)
    p.add_argument("--store", required=True, help="store directory to copy, or a redis:// store URL")
    p.add_argument("--to", required=True,
                   help="new directory for the copy (must be empty), or a redis:// store URL to restore into")
    p.add_argument("--namespace", action="append", help="with a Redis store: copy only this namespace (repeatable)")
    p.add_argument("--no-compact", action="store_true", help="copy free pages too (faster, bigger)")
    p.add_argument("--json", type=Path, help="also write the report as JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Copy the store; print what was copied; returns 0."""
    source, destination = store_location(args.store), store_location(args.to)
    if is_redis_url(source) or is_redis_url(destination):
        return _transfer(args, source, destination)
    if args.namespace:
        raise ConfigError("--namespace applies to a copy from or to a Redis store; an LMDB backup copies every one")
    report = backup_store(args.store, args.to, compact=not args.no_compact)
    print(f"backup of {report.source} ({report.generation}) to {report.destination}:"
          f" {report.file_bytes} bytes in {report.seconds:.2f} s")
    if args.json:
        write_json(args.json, dataclasses.asdict(report))
    return 0


def _open(location: str | Path, *, create: bool) -> MapStoreBase:
    from attnstore.store.opening import open_store

    if create and not is_redis_url(location) and Path(location).exists() and any(Path(location).iterdir()):
        raise ConfigError(f"backup destination {location} is not empty; give a new directory")
    return open_store(location, create=create, dram_bytes=0).store


def _transfer(args: argparse.Namespace, source: str | Path, destination: str | Path) -> int:
    from attnstore.store.redis.urls import shown_location
    from attnstore.store.transfer import copy_namespaces

    with _open(source, create=False) as src, _open(destination, create=True) as dst:
        report = copy_namespaces(src, dst, args.namespace)
    print(f"copied {len(report.namespaces)} namespaces ({', '.join(report.namespaces)}) from"
          f" {shown_location(source)} to {shown_location(destination)}: {report.entries} entries"
          f" ({report.skipped} unreadable, skipped) in {report.seconds:.2f} s")
    if args.json:
        write_json(args.json, dataclasses.asdict(report))
    return 0
