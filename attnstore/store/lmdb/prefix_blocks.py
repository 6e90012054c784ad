"""Prefix blocks in the LMDB store: their own sub-database, one write transaction per call.

Keys (the namespace name holds no NUL, so no namespace's keys reach another's)::

    ns NUL "L"                       -> the namespace's PrefixLayout (JSON)
    ns NUL "R" chain_hash            -> BlockRecord (parent, crc32c per part)
    ns NUL "C" chain_hash layer(>H)  -> part bytes: layers 0..n-1, then n = the hidden states

A block's parts are adjacent in key order (layer-contiguous, like maps) and are
written in the transaction that writes its record, so a block is visible with
all its bytes or not at all; a call's blocks commit together, so a crash
mid-ingest leaves no partial chain. Lookups read records from a row's first
block on and stop at the first missing one.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import lmdb
import numpy as np

from attnstore.errors import FingerprintMismatchError, MapShapeError
from attnstore.protocol.keys import BLOCK_HASH_BYTES
from attnstore.protocol.prefix import PrefixBlock, PrefixLayout
from attnstore.store.lmdb import layouts
from attnstore.store.lmdb.env import DbHandle, Generation, items_with_prefix
from attnstore.store.lmdb.records import ns_prefix
from attnstore.store.prefix.interface import PrefixBlocks
from attnstore.store.prefix.records import (
    BlockRecord,
    block_parts,
    gather_parts,
    new_record,
    recorded_writer,
    writer_blocks,
)

if TYPE_CHECKING:
    from attnstore.protocol.records import NamespaceInfo
    from attnstore.store.lmdb.live import LiveGeneration

_RECORD = b"R"
_PART = b"C"


def record_key(namespace: str, chain_hash: bytes) -> bytes:
    """Key of one block's record."""
    return ns_prefix(namespace) + _RECORD + chain_hash


def part_key(namespace: str, chain_hash: bytes, part: int) -> bytes:
    """Key of one block's part ``part`` (a layer, or the layer count for the hidden states)."""
    return ns_prefix(namespace) + _PART + chain_hash + struct.pack(">H", part)


def read_layout(txn: lmdb.Transaction, db: DbHandle | None, namespace: str) -> PrefixLayout | None:
    """The namespace's prefix layout in ``txn``, or None."""
    return layouts.read_layout(txn, db, namespace, PrefixLayout)


def drop_prefix_keys(txn: lmdb.Transaction, db: DbHandle | None, namespace: str) -> int:
    """Delete the namespace's layout and blocks in ``txn`` (with the namespace); returns how many keys."""
    if db is None:
        return 0
    with txn.cursor(db=db) as cursor:
        keys = [key for key, _ in items_with_prefix(cursor, ns_prefix(namespace))]
    return sum(bool(txn.delete(key, db=db)) for key in keys)


def prefix_usage(txn: lmdb.Transaction, db: DbHandle | None) -> tuple[int, int]:
    """Blocks (records) and part bytes over every namespace."""
    if db is None:
        return 0, 0
    blocks = nbytes = 0
    with txn.cursor(db=db) as cursor:
        for raw_key, value in cursor.iternext():
            kind = _kind(bytes(raw_key))
            blocks += kind == _RECORD
            nbytes += len(value) if kind == _PART else 0
    return blocks, nbytes


def _kind(key: bytes) -> bytes:
    return key[key.index(b"\x00") + 1 : key.index(b"\x00") + 2]


def prefix_problems(txn: lmdb.Transaction, db: DbHandle | None) -> tuple[int, list[str]]:
    """Blocks checked, and a line naming each block whose part is missing or fails its crc32c."""
    if db is None:
        return 0, []
    import crc32c  # the store's checksum; imported here with the walk that needs it

    checked, problems = 0, []
    records: list[tuple[bytes, BlockRecord]] = []
    with txn.cursor(db=db) as cursor:
        for raw_key, value in cursor.iternext():
            key = bytes(raw_key)
            if _kind(key) == _RECORD:
                records.append((key, BlockRecord.decode(bytes(value))))
    for key, record in records:
        checked += 1
        name = key[: key.index(b"\x00")].decode()
        chain_hash = key[-BLOCK_HASH_BYTES:]
        for part, crc in enumerate(record.crcs):
            raw = txn.get(part_key(name, chain_hash, part), db=db)
            if raw is None or crc32c.crc32c(raw) != crc:
                why = "is missing" if raw is None else "fails its crc32c"
                problems.append(f"prefix block {chain_hash.hex()} of namespace {name!r}: part {part} {why}")
                break
    return checked, problems


class LmdbPrefixBlocks(PrefixBlocks):
    """Prefix blocks of an LMDB store (its ``store.prefixes``), in the live generation's prefix sub-database."""

    def __init__(self, live: LiveGeneration, namespace: Callable[[str], NamespaceInfo]) -> None:
        """
        Args:
            live: the store's live generation.
            namespace: the store's ``get_namespace`` (raises NamespaceNotFoundError).
        """
        self._live = live
        self._namespace = namespace

    @contextmanager
    def _prefix_read(self, namespace: str) -> Iterator[tuple[Generation, lmdb.Transaction, PrefixLayout | None]]:
        self._namespace(namespace)
        with self._live.read() as (gen, txn):
            yield gen, txn, read_layout(txn, gen.db.prefix, namespace)

    def _set_layout(self, namespace: str, layout: PrefixLayout) -> PrefixLayout:
        self._namespace(namespace)
        with self._live.write() as (gen, txn):
            assert gen.db.prefix is not None  # a writer opens (creates) it
            layouts.set_layout(txn, gen.db.prefix, namespace, "prefix blocks", layout)
        return layout

    def _layout(self, namespace: str) -> PrefixLayout | None:
        with self._prefix_read(namespace) as (_, _, layout):
            return layout

    def _put(self, namespace: str, layout: PrefixLayout, blocks: list[PrefixBlock]) -> int:
        self._namespace(namespace)
        added = 0
        with self._live.write() as (gen, txn):
            db = gen.db.prefix
            assert db is not None
            if read_layout(txn, db, namespace) != layout:
                raise FingerprintMismatchError(f"namespace {namespace!r}: its prefix layout changed meanwhile")
            for position, block in enumerate(blocks):
                if txn.get(record_key(namespace, block.chain_hash), db=db) is not None:
                    continue
                if block.parent is not None and txn.get(record_key(namespace, block.parent), db=db) is None:
                    # Raising aborts the transaction: none of this call's blocks stay.
                    raise MapShapeError(f"prefix block {position}: its parent {block.parent.hex()} is not stored")
                parts = block_parts(block)
                for part, raw in enumerate(parts):
                    txn.put(part_key(namespace, block.chain_hash, part), raw, db=db)
                txn.put(record_key(namespace, block.chain_hash), new_record(block, parts).encode(), db=db)
                added += 1
        return added

    def _drop_writer(self, namespace: str, writer: str, dry_run: bool) -> int:
        self._namespace(namespace)
        with self._live.write() as (gen, txn):
            db = gen.db.prefix
            assert db is not None
            start = ns_prefix(namespace) + _RECORD
            with txn.cursor(db=db) as cursor:
                records = [(bytes(key)[len(start):], BlockRecord.decode(bytes(value)))
                           for key, value in items_with_prefix(cursor, start)]
            doomed = writer_blocks(records, writer)
            if dry_run:
                return len(doomed)
            layout = read_layout(txn, db, namespace)
            parts = 0 if layout is None else layout.layers + 1
            for chain_hash in doomed:
                for part in range(parts):
                    txn.delete(part_key(namespace, chain_hash, part), db=db)
                txn.delete(record_key(namespace, chain_hash), db=db)
        return len(doomed)

    def _writer_of(self, namespace: str, chain_hash: bytes) -> tuple[bool, str | None]:
        with self._prefix_read(namespace) as (gen, txn, _):
            return recorded_writer(txn.get(record_key(namespace, chain_hash), db=gen.db.prefix))

    def _match(self, namespace: str, chain_hashes: list[bytes]) -> int:
        with self._prefix_read(namespace) as (gen, txn, layout):
            if layout is None:
                return 0
            count = 0
            for chain_hash in chain_hashes:
                if txn.get(record_key(namespace, chain_hash), db=gen.db.prefix) is None:
                    break
                count += 1
            return count

    def _read_parts(self, namespace: str, layout: PrefixLayout, chain_hashes: list[bytes], part: int
                     ) -> np.ndarray:
        with self._prefix_read(namespace) as (gen, txn, _):
            db = gen.db.prefix

            def read(chain_hash: bytes) -> tuple[BlockRecord, bytes | memoryview] | None:
                record = txn.get(record_key(namespace, chain_hash), db=db)
                raw = txn.get(part_key(namespace, chain_hash, part), db=db)
                return None if record is None or raw is None else (BlockRecord.decode(record), raw)

            # Copies out of the transaction's pages (zero-copy views) before it ends.
            return gather_parts(namespace, layout, chain_hashes, part, read)
