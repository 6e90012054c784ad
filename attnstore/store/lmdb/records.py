"""Binary records and keys of the LMDB sub-databases (struct-packed, never pickled).

Keys start with ``namespace + NUL`` so one namespace's keys form one contiguous
range; integers in keys are big-endian so key order is numeric order.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import lmdb

if TYPE_CHECKING:
    from attnstore.store.lmdb.env import Databases


_SEP = b"\x00"


def ns_prefix(namespace: str) -> bytes:
    """Key prefix shared by every record of ``namespace``."""
    return namespace.encode() + _SEP


def entry_key(namespace: str, entry_id: int) -> bytes:
    """Key of an entry record (``entries`` db) and its hit counters (``hits`` db)."""
    return ns_prefix(namespace) + entry_id.to_bytes(8, "big")


def split_entry_key(key: bytes | memoryview) -> tuple[str, int]:
    """Inverse of :func:`entry_key`."""
    raw = bytes(key)
    return raw[:-9].decode(), int.from_bytes(raw[-8:], "big")


def hash_key(namespace: str, token_hash: bytes) -> bytes:
    """Key of the exact-tier index (``hashes`` db): token hash -> entry id."""
    return ns_prefix(namespace) + token_hash


def bucket_key(namespace: str, length: int) -> bytes:
    """Key of a length bucket record (``buckets`` db)."""
    return ns_prefix(namespace) + length.to_bytes(4, "big")


def length_key(namespace: str, length: int, entry_id: int) -> bytes:
    """Key of the by-length index (``lengths`` db), empty value."""
    return bucket_key(namespace, length) + entry_id.to_bytes(8, "big")


def split_length_key(key: bytes | memoryview) -> tuple[int, int]:
    """Length and entry id of a by-length index key."""
    raw = bytes(key)
    return int.from_bytes(raw[-12:-8], "big"), int.from_bytes(raw[-8:], "big")


def encode_u64(value: int) -> bytes:
    """8-byte big-endian unsigned int (ids, counters)."""
    return value.to_bytes(8, "big")


def decode_u64(raw: bytes | memoryview) -> int:
    """Inverse of :func:`encode_u64`."""
    return int.from_bytes(raw, "big")


# Counters of the ``meta`` db: the next entry id (ids are never reused) and what eviction removed.
META_NEXT_ID = b"next_id"
META_EVICTED_ENTRIES = b"evicted_entries"
META_EVICTED_BYTES = b"evicted_bytes"


def read_counter(txn: lmdb.Transaction, db: Databases, key: bytes, default: int = 0) -> int:
    """A uint64 counter of the ``meta`` db."""
    raw = txn.get(key, db=db.meta)
    return default if raw is None else decode_u64(raw)


def write_counter(txn: lmdb.Transaction, db: Databases, key: bytes, value: int) -> None:
    """Set a uint64 counter of the ``meta`` db."""
    txn.put(key, encode_u64(value), db=db.meta)


_BUCKET = struct.Struct("<QQQQQ")


@dataclass(frozen=True, slots=True)
class BucketRecord:
    """One length bucket of a namespace: slot allocation and live totals."""

    next_slot: int  # slots are handed out in order and reused only by compaction
    capacity: int  # first dimension of the bucket's zarr arrays
    live: int  # live entries
    stored_bytes: int
    raw_bytes: int

    def to_bytes(self) -> bytes:
        """Pack the record."""
        return _BUCKET.pack(self.next_slot, self.capacity, self.live, self.stored_bytes, self.raw_bytes)

    @classmethod
    def from_bytes(cls, raw: bytes | memoryview) -> BucketRecord:
        """Unpack a record."""
        return cls(*_BUCKET.unpack(bytes(raw)))


_HITS = struct.Struct("<Qd")


@dataclass(frozen=True, slots=True)
class HitRecord:
    """Hit counters of one entry (kept apart so entry records stay immutable)."""

    hits: int
    last_hit: float

    def to_bytes(self) -> bytes:
        """Pack the record."""
        return _HITS.pack(self.hits, self.last_hit)

    @classmethod
    def from_bytes(cls, raw: bytes | memoryview | None) -> HitRecord:
        """Unpack a record; ``None`` (never hit) gives zero counters."""
        if raw is None:
            return cls(0, 0.0)
        return cls(*_HITS.unpack(bytes(raw)))


def stored_bytes(txn: lmdb.Transaction, db: Databases) -> int:
    """Stored bytes of every live entry (sum over buckets)."""
    with txn.cursor(db=db.buckets) as cursor:
        return sum(BucketRecord.from_bytes(v).stored_bytes for _, v in cursor.iternext())
