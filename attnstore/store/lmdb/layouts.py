"""The layout a namespace keeps its chunk entries or its prefix blocks in, in LMDB: set once per namespace.

Each part's sub-database holds it as one JSON value under the namespace's ``L`` key
(``chunks.keys``, ``prefix_blocks``); the rule of setting it again is ``namespace_rules``'.
"""

from __future__ import annotations

import json
from typing import TypeVar

import lmdb

from attnstore.protocol.chunks import ChunkLayout
from attnstore.protocol.prefix import PrefixLayout
from attnstore.store.lmdb.env import DbHandle
from attnstore.store.lmdb.records import ns_prefix
from attnstore.store.namespace_rules import check_same_layout

Layout = TypeVar("Layout", ChunkLayout, PrefixLayout)


def layout_key(namespace: str) -> bytes:
    """Key of the namespace's layout in a part's sub-database."""
    return ns_prefix(namespace) + b"L"


def read_layout(txn: lmdb.Transaction, db: DbHandle | None, namespace: str, kind: type[Layout]) -> Layout | None:
    """The namespace's layout of ``kind`` in ``txn``, or None (none set, or no sub-database yet)."""
    raw = None if db is None else txn.get(layout_key(namespace), db=db)
    return None if raw is None else kind.from_dict(json.loads(bytes(raw)))


def set_layout(txn: lmdb.Transaction, db: DbHandle, namespace: str, part: str, layout: Layout) -> None:
    """Record the namespace's layout of ``part`` ("chunks", "prefix blocks"), or check it is the one recorded.

    Raises:
        FingerprintMismatchError: the namespace keeps ``part`` in another layout.
    """
    stored = read_layout(txn, db, namespace, type(layout))
    check_same_layout(namespace, part, stored, layout)
    if stored is None:
        txn.put(layout_key(namespace), json.dumps(layout.to_dict()).encode(), db=db)
