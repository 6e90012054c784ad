"""Chunk entries in their own LMDB sub-database, and what one transaction does with them.

Keys (the namespace name holds no NUL and is never empty, so no namespace's keys reach another's or the
total's)::

    ns NUL "L"                -> the namespace's ChunkLayout (JSON)
    ns NUL "R" key            -> ChunkRecord (created, length, writer, crc32c per layer)
    ns NUL "C" key layer(>H)  -> the layer's keys and values
    ns NUL "T" key            -> when the chunk was last read (float64; reads are noted in memory and
                                 written with the next write, as hits are)
    NUL "total"               -> bytes of every stored chunk's layers (uint64): what the byte cap adds
                                 to the entries' bytes, without a walk per write

A chunk's layers are written in the transaction that writes its record, so a
chunk is visible with all its bytes or not at all.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import lmdb

from attnstore.errors import ChecksumError
from attnstore.protocol.chunks import CHUNK_KEY_BYTES, ChunkLayout, StoredChunk
from attnstore.store.chunks.records import (
    ChunkRecord,
    chunk_pieces,
    chunk_problem,
    new_record,
    recorded_writer,
    stored_length,
    where,
)
from attnstore.store.eviction import ChunkCandidate
from attnstore.store.lmdb import layouts
from attnstore.store.lmdb.env import DbHandle, items_with_prefix
from attnstore.store.lmdb.records import ns_prefix
from attnstore.store.reports import CorruptChunk

_RECORD = b"R"
_PIECE = b"C"
_READ = b"T"
_TOTAL = b"\x00total"
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")


def record_key(namespace: str, key: bytes) -> bytes:
    """Key of one chunk's record."""
    return ns_prefix(namespace) + _RECORD + key


def piece_key(namespace: str, key: bytes, layer: int) -> bytes:
    """Key of one layer of one chunk."""
    return ns_prefix(namespace) + _PIECE + key + struct.pack(">H", layer)


def _read_key(namespace: str, key: bytes) -> bytes:
    return ns_prefix(namespace) + _READ + key


@dataclass(frozen=True, slots=True)
class _Parsed:
    namespace: str
    kind: bytes
    rest: bytes


def _parse(raw_key: bytes | memoryview) -> _Parsed | None:
    key = bytes(raw_key)
    sep = key.find(b"\x00")
    if sep <= 0:
        return None  # the total
    return _Parsed(key[:sep].decode(), key[sep + 1 : sep + 2], key[sep + 2 :])


def read_layout(txn: lmdb.Transaction, db: DbHandle | None, namespace: str) -> ChunkLayout | None:
    """The namespace's chunk layout in ``txn``, or None."""
    return layouts.read_layout(txn, db, namespace, ChunkLayout)


def read_record(txn: lmdb.Transaction, db: DbHandle | None, namespace: str, key: bytes) -> ChunkRecord | None:
    """One chunk's record in ``txn``, or None while it is not stored.

    Raises:
        ChecksumError: its record is damaged.
    """
    raw = None if db is None else txn.get(record_key(namespace, key), db=db)
    return None if raw is None else ChunkRecord.decode(raw, where(namespace, key))


def record_length(txn: lmdb.Transaction, db: DbHandle | None, namespace: str, key: bytes) -> int | None:
    """A chunk's length in ``txn``, or None while it is not stored or its record is damaged (``stored_length``)."""
    return stored_length(None if db is None else txn.get(record_key(namespace, key), db=db))


def record_writer(txn: lmdb.Transaction, db: DbHandle | None, namespace: str, key: bytes
                  ) -> tuple[bool, str | None]:
    """Whether a chunk has a record in ``txn``, and the writer it names (``recorded_writer``)."""
    return recorded_writer(None if db is None else txn.get(record_key(namespace, key), db=db))


def is_stored(txn: lmdb.Transaction, db: DbHandle | None, namespace: str, key: bytes) -> bool:
    """Whether a chunk has a record in ``txn``, sound or damaged."""
    return db is not None and txn.get(record_key(namespace, key), db=db) is not None


def total_bytes(txn: lmdb.Transaction, db: DbHandle | None) -> int:
    """Bytes of every stored chunk."""
    raw = None if db is None else txn.get(_TOTAL, db=db)
    return 0 if raw is None else int(_U64.unpack(raw)[0])


def _add_total(txn: lmdb.Transaction, db: DbHandle, delta: int) -> None:
    txn.put(_TOTAL, _U64.pack(max(0, total_bytes(txn, db) + delta)), db=db)


def put_chunk(txn: lmdb.Transaction, db: DbHandle, namespace: str, chunk: StoredChunk) -> None:
    """Write one checked chunk not stored yet: its layers, then its record."""
    pieces = chunk_pieces(chunk)
    for layer, piece in enumerate(pieces):
        txn.put(piece_key(namespace, chunk.key, layer), piece, db=db)
    txn.put(record_key(namespace, chunk.key), new_record(chunk, pieces).encode(), db=db)
    _add_total(txn, db, sum(len(p) for p in pieces))


def delete_chunk(txn: lmdb.Transaction, db: DbHandle, namespace: str, key: bytes) -> int | None:
    """Delete one chunk (a damaged record too); its bytes, or None when it was not stored."""
    if not is_stored(txn, db, namespace, key):
        return None
    layers: int | None = None  # a damaged record's layers are 0, 1, ... up to the first missing one
    try:
        record = read_record(txn, db, namespace, key)
        layers = None if record is None else len(record.crcs)
    except ChecksumError:
        pass
    nbytes, layer = 0, 0
    while layers is None or layer < layers:
        piece = txn.pop(piece_key(namespace, key, layer), db=db)
        if piece is None and layers is None:
            break
        nbytes += 0 if piece is None else len(piece)
        layer += 1
    txn.delete(record_key(namespace, key), db=db)
    txn.delete(_read_key(namespace, key), db=db)
    _add_total(txn, db, -nbytes)
    return nbytes


def drop_chunk_keys(txn: lmdb.Transaction, db: DbHandle | None, namespace: str) -> int:
    """Delete the namespace's layout and chunks in ``txn`` (with the namespace); returns how many keys."""
    if db is None:
        return 0
    nbytes = 0
    with txn.cursor(db=db) as cursor:
        keys = []
        for key, value in items_with_prefix(cursor, ns_prefix(namespace)):
            keys.append(key)
            parsed = _parse(key)
            nbytes += len(value) if parsed is not None and parsed.kind == _PIECE else 0
    removed = sum(bool(txn.delete(key, db=db)) for key in keys)
    if nbytes:
        _add_total(txn, db, -nbytes)
    return removed


def note_reads(txn: lmdb.Transaction, db: DbHandle | None, reads: Mapping[tuple[str, bytes], float]) -> None:
    """Write when chunks were last read (chunks deleted meanwhile are skipped)."""
    if db is None:
        return
    for (namespace, key), when in reads.items():
        if txn.get(record_key(namespace, key), db=db) is None:
            continue
        old = txn.get(_read_key(namespace, key), db=db)
        txn.put(_read_key(namespace, key), _F64.pack(max(when, 0.0 if old is None else _F64.unpack(old)[0])), db=db)


def _records(txn: lmdb.Transaction, db: DbHandle) -> list[tuple[str, bytes, ChunkRecord | ChecksumError]]:
    """Every chunk's record, or the error its damaged record raises."""
    found: list[tuple[str, bytes, ChunkRecord | ChecksumError]] = []
    with txn.cursor(db=db) as cursor:
        for raw_key, value in cursor.iternext():
            parsed = _parse(raw_key)
            if parsed is not None and parsed.kind == _RECORD and len(parsed.rest) == CHUNK_KEY_BYTES:
                try:
                    record: ChunkRecord | ChecksumError = ChunkRecord.decode(
                        bytes(value), where(parsed.namespace, parsed.rest))
                except ChecksumError as exc:
                    record = exc
                found.append((parsed.namespace, parsed.rest, record))
    return found


def writer_keys(txn: lmdb.Transaction, db: DbHandle | None, namespace: str, writer: str) -> list[bytes]:
    """The keys of ``namespace``'s chunks whose record names ``writer``."""
    if db is None:
        return []
    return [key for name, key, record in _records(txn, db)
            if name == namespace and isinstance(record, ChunkRecord) and record.writer == writer]


def eviction_candidates(txn: lmdb.Transaction, db: DbHandle | None, protect: set[tuple[str, bytes]]
                        ) -> list[ChunkCandidate]:
    """Every stored chunk but those in ``protect``, with its recency (the later of its storing and last read)."""
    if db is None:
        return []
    layouts: dict[str, ChunkLayout | None] = {}
    candidates = []
    for namespace, key, record in _records(txn, db):
        if (namespace, key) in protect:
            continue
        layout = layouts.setdefault(namespace, read_layout(txn, db, namespace))
        if isinstance(record, ChecksumError):  # a damaged chunk goes first, with the bytes of its layers
            candidates.append(ChunkCandidate(0.0, namespace, key, _layer_bytes(txn, db, namespace, key)))
            continue
        last = txn.get(_read_key(namespace, key), db=db)
        recency = max(record.created, 0.0 if last is None else _F64.unpack(last)[0])
        nbytes = 0 if layout is None else layout.chunk_bytes(record.length)
        candidates.append(ChunkCandidate(recency, namespace, key, nbytes))
    return candidates


def _layer_bytes(txn: lmdb.Transaction, db: DbHandle, namespace: str, key: bytes) -> int:
    """Bytes of a chunk's layers 0, 1, ... up to the first missing one."""
    nbytes, layer = 0, 0
    while (piece := txn.get(piece_key(namespace, key, layer), db=db)) is not None:
        nbytes, layer = nbytes + len(piece), layer + 1
    return nbytes


def _piece(txn: lmdb.Transaction, db: DbHandle, namespace: str, key: bytes, layer: int) -> bytes | memoryview | None:
    return txn.get(piece_key(namespace, key, layer), db=db)


def chunk_usage(txn: lmdb.Transaction, db: DbHandle | None) -> dict[str, tuple[int, int]]:
    """Chunk entries and their bytes per namespace."""
    usage: dict[str, tuple[int, int]] = {}
    if db is None:
        return usage
    with txn.cursor(db=db) as cursor:
        for raw_key, value in cursor.iternext():
            parsed = _parse(raw_key)
            if parsed is None or parsed.kind not in (_RECORD, _PIECE):
                continue
            count, nbytes = usage.get(parsed.namespace, (0, 0))
            usage[parsed.namespace] = (count + 1, nbytes) if parsed.kind == _RECORD else (count, nbytes + len(value))
    return usage


def chunk_findings(txn: lmdb.Transaction, db: DbHandle | None) -> tuple[int, list[CorruptChunk]]:
    """Chunks checked, and each one whose record or layers are damaged or missing."""
    if db is None:
        return 0, []
    corrupt = []
    records = _records(txn, db)
    layouts: dict[str, ChunkLayout | None] = {}
    for namespace, key, record in records:
        layout = layouts.setdefault(namespace, read_layout(txn, db, namespace))
        if layout is None:
            corrupt.append(CorruptChunk(namespace, key.hex(), "its namespace has no chunk layout"))
            continue
        if isinstance(record, ChecksumError):
            corrupt.append(CorruptChunk(namespace, key.hex(), str(record)))
            continue
        problem = chunk_problem(layout, record, partial(_piece, txn, db, namespace, key))
        if problem is not None:
            corrupt.append(CorruptChunk(namespace, key.hex(), problem))
    return len(records), corrupt
