"""``attnstore admin drop-writer``: delete every row, prefix block and chunk one token wrote (a bad or revoked
writer).

The daemon records each written-back entry, prefix block and chunk with the
name of the token that wrote it (the token file's ``name=``, or ``token-`` and 8
hex digits of its sha256). This lists a namespace's entries of that writer
(``ListEntries`` with its filter) and deletes them in ``Delete`` calls of
``--batch-ids`` ids (the indexes drop them with the delete, on every daemon of a
shared store), then removes the writer's prefix blocks, every block chained
after them (computed after their keys and values), and its chunks in one
``DropWriter`` call. Revoke the token first (remove its line, SIGHUP the
daemons), or it may write again. What an admin ingested or built, or another
writer stored first, is kept.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass

from attnstore.errors import ConfigError
from attnstore_client.connection.daemon import DaemonClient


@dataclass(frozen=True, slots=True)
class DropReport:
    """What one drop-writer run found and deleted."""

    namespace: str
    writer: str
    found: int  # entries of the writer listed
    deleted: int  # of those, the ones deleted (0 with --dry-run; fewer when some went meanwhile)
    prefix_blocks: int = 0  # prefix blocks removed (with --dry-run: found), the writer's and those chained after
    chunks: int = 0  # chunks removed (with --dry-run: found)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``admin drop-writer``."""
    parser.add_argument("--namespace", required=True, help="the namespace to clean")
    parser.add_argument("--writer", required=True, help="the token name whose entries go (see admin stats / logs)")
    parser.add_argument("--batch-ids", type=int, default=1000, help="entry ids per Delete call")
    parser.add_argument("--dry-run", action="store_true",
                        help="count the writer's entries, prefix blocks and chunks, delete nothing")


def _batches(ids: Iterator[int], size: int) -> Iterator[list[int]]:
    batch: list[int] = []
    for entry_id in ids:
        batch.append(entry_id)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def drop_writer(remote: DaemonClient, namespace: str, writer: str, *, batch_ids: int = 1000,
                dry_run: bool = False) -> DropReport:
    """Delete every entry, prefix block and chunk of ``namespace`` that ``writer`` wrote (see the module
    docstring).

    Raises:
        ConfigError: an empty writer name or a batch size below 1.
        NamespaceNotFoundError, AuthError: see the daemon (an admin token is needed).
    """
    if not writer:
        raise ConfigError("drop-writer needs a writer name: an empty one would match every admin-ingested entry")
    if batch_ids < 1:
        raise ConfigError(f"--batch-ids must be >= 1, got {batch_ids}")
    ids = [int(e.entry_id) for e in remote.iter_entries(namespace, writer=writer)]
    deleted = 0
    if not dry_run:
        for batch in _batches(iter(ids), batch_ids):
            deleted += remote.delete(namespace, batch)
    removed = remote.drop_writer(namespace, writer, dry_run=dry_run)
    return DropReport(namespace, writer, len(ids), deleted, int(removed.prefix_blocks), int(removed.chunks))


def run(args: argparse.Namespace, remote: DaemonClient) -> DropReport:
    """Drop the entries ``args`` name."""
    return drop_writer(remote, args.namespace, args.writer, batch_ids=args.batch_ids, dry_run=args.dry_run)
