"""``attnstore admin drop-writer``: delete every entry one token wrote back (a bad or revoked writer).

The daemon records each written-back entry with the name of the token that
wrote it (the token file's ``name=``, or ``token-`` and 8 hex digits of its
sha256). This lists a namespace's entries of that writer (``ListEntries`` with
its filter) and deletes them in ``Delete`` calls of ``--batch-ids`` ids; the
indexes drop them with the delete, on every daemon of a shared store. Revoke
the token first (remove its line, SIGHUP the daemons), or it may write again.
Entries an admin ingested, or another writer stored first, are kept.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass

from attnstore.errors import ConfigError
from attnstore_client.connection.daemon import RemoteStore


@dataclass(frozen=True, slots=True)
class DropReport:
    """What one drop-writer run found and deleted."""

    namespace: str
    writer: str
    found: int  # entries of the writer listed
    deleted: int  # of those, the ones deleted (0 with --dry-run; fewer when some went meanwhile)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``admin drop-writer``."""
    parser.add_argument("--namespace", required=True, help="the namespace to clean")
    parser.add_argument("--writer", required=True, help="the token name whose entries go (see admin stats / logs)")
    parser.add_argument("--batch-ids", type=int, default=1000, help="entry ids per Delete call")
    parser.add_argument("--dry-run", action="store_true", help="count the writer's entries, delete nothing")


def _batches(ids: Iterator[int], size: int) -> Iterator[list[int]]:
    batch: list[int] = []
    for entry_id in ids:
        batch.append(entry_id)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def drop_writer(remote: RemoteStore, namespace: str, writer: str, *, batch_ids: int = 1000,
                dry_run: bool = False) -> DropReport:
    """Delete every entry of ``namespace`` that ``writer`` wrote back (see the module docstring).

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
    return DropReport(namespace, writer, len(ids), deleted)


def run(args: argparse.Namespace, remote: RemoteStore) -> DropReport:
    """Drop the entries ``args`` name."""
    return drop_writer(remote, args.namespace, args.writer, batch_ids=args.batch_ids, dry_run=args.dry_run)
