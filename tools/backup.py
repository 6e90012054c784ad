"""``attnstore backup``: copy a map store consistently, also while a daemon serves it.

Run it on the daemon's host against the store directory. The copy holds every
entry committed before it started (one LMDB read transaction) and is itself a
store: serve it with ``attnstore serve --store DEST`` to restore.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from attnstore.store.lmdb.backup import backup_store
from attnstore_tools.output import write_json


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``backup`` subcommand."""
    p = subparsers.add_parser("backup", help="consistent copy of a map store (safe while serving)",
                              description=__doc__)
    p.add_argument("--store", type=Path, required=True, help="store directory to copy")
    p.add_argument("--to", type=Path, required=True, help="new directory for the copy (must be empty)")
    p.add_argument("--no-compact", action="store_true", help="copy free pages too (faster, bigger)")
    p.add_argument("--json", type=Path, help="also write the report as JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Copy the store; print what was copied; returns 0."""
    report = backup_store(args.store, args.to, compact=not args.no_compact)
    print(f"backup of {report.source} ({report.generation}) to {report.destination}:"
          f" {report.file_bytes} bytes in {report.seconds:.2f} s")
    if args.json:
        write_json(args.json, dataclasses.asdict(report))
    return 0
