"""``attnstore admin quarantine list|release|drop``: what nodes' audits found wrong, judged by an admin.

A node that audits the rows it is served (``--audit-rate``) reports a stored row
whose outputs differ from its own forward; the daemon quarantines it (a miss for
every node) and records who wrote it and who reported it. ``list`` shows them;
``release`` serves an object again (the report was wrong: a node of another
build, say); ``drop`` deletes it from the store (a row or a chunk; a prefix
block, which others are chained after, is released or goes with its writer's
blocks: ``admin drop-writer``). Each names its writer, the token that stored it (a
row's, a prefix block's or a chunk's, read back from its record). A writer whose objects keep
being quarantined is a bad writer: revoke its token and ``admin drop-writer`` it.
Keys are given as the hex ``list`` prints.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from attnstore.errors import ConfigError
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore_client.connection.daemon import DaemonClient

ACTIONS = ("list", "release", "drop")


@dataclass(frozen=True, slots=True)
class QuarantineRow:
    """One quarantined object, as the table and the JSON show it."""

    namespace: str
    kind: str
    key: str  # hex
    writer: str  # "" for an admin's build
    entry_id: int | None
    reporter: str
    detail: str
    since: str  # local time of the report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``admin quarantine``."""
    parser.add_argument("action", choices=ACTIONS, help="list the quarantined objects, release one, or drop one")
    parser.add_argument("--namespace", default="", help="the namespace (list: every namespace when left out)")
    parser.add_argument("--kind", default="row", choices=("row", "prefix", "chunk"), help="release/drop: its kind")
    parser.add_argument("--key", help="release/drop: its key, in hex (as list prints it)")


def row_of(item: pb.QuarantinedObject) -> QuarantineRow:
    """A quarantined object's row."""
    return QuarantineRow(item.namespace, item.kind, bytes(item.key).hex(), item.writer,
                         int(item.entry_id) if item.has_entry_id else None, item.reporter, item.detail,
                         time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(item.since)))


def run(args: argparse.Namespace, remote: DaemonClient) -> list[QuarantineRow]:
    """List, release or drop, as ``args`` say; the objects listed, released or dropped.

    Raises:
        ConfigError: release or drop without --namespace and --key, or a key that is not hex.
        EntryNotFoundError: no such quarantined object.
        AuthError: not an admin token.
    """
    if args.action == "list":
        return [row_of(item) for item in remote.list_quarantine(args.namespace)]
    if not args.namespace or not args.key:
        raise ConfigError(f"admin quarantine {args.action} needs --namespace and --key (the hex list prints)")
    try:
        key = bytes.fromhex(args.key)
    except ValueError:
        raise ConfigError(f"--key must be hex, as admin quarantine list prints it; got {args.key!r}") from None
    reply = remote.release_quarantine(args.namespace, args.kind, key, drop=args.action == "drop")
    return [row_of(reply.object)]
