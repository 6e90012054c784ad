"""The entry record: what makes one entry visible, in the binary form every persistent backend stores.

LMDB keeps it as the value of the entry's key; Redis as one field of the entry's hash.
Struct-packed (never pickled), with a crc32c trailer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import crc32c
import numpy as np

from attnstore.errors import ChecksumError, MapsNotStoredError
from attnstore.protocol.keys import TokenHash
from attnstore.protocol.records import EntryInfo
from attnstore.store.arrays import NamespaceState

# magic, record version, flags, id, slot, length, n_crcs, feature_dim,
# outputs_crc, created, nbytes, token_hash
_ENTRY_HEAD = struct.Struct("<4sHHQQIIIIdQ32s")
_ENTRY_MAGIC = b"ASE1"
_ENTRY_VERSION = 1
_HAS_OUTPUTS = 1
_HAS_FEATURE = 2
_HAS_TOKENS = 4  # the token ids follow the feature: ``length`` little-endian uint32
_HAS_WRITER = 8  # the writer's name follows the token ids: one length byte, then UTF-8 (written-back entries)
_CRC_TAIL = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class EntryRecord:
    """What makes an entry visible: written in the same transaction as its stored objects.

    ``crcs`` holds one crc32c per stored object (``zarr_layout``), layer-major (for each layer, one
    per zarr array of the codec). The record carries its own crc32c as a trailer.
    """

    id: int
    slot: int  # row of the bucket's zarr arrays
    length: int
    created: float
    token_hash: TokenHash
    crcs: tuple[int, ...]
    nbytes: int  # stored bytes of all its objects (maps and outputs)
    outputs_crc: int | None
    feature: np.ndarray | None = field(compare=False)  # (feature_dim,) float32
    token_ids: np.ndarray | None = field(default=None, compare=False)  # (length,) uint32
    writer: str | None = None  # the name of the token that wrote it back; None: ingested by an admin

    def info(self, hits: int, last_hit: float) -> EntryInfo:
        """The entry's metadata, with its hit counts."""
        return EntryInfo(
            id=self.id, length=self.length, token_hash=self.token_hash, created=self.created, hits=hits,
            last_hit=last_hit, feature=self.feature, nbytes=self.nbytes, token_ids=self.token_ids,
            has_maps=bool(self.crcs), writer=self.writer,
        )

    def to_bytes(self) -> bytes:
        """Pack the record (struct, little-endian) with a crc32c trailer."""
        flags = (
            (_HAS_OUTPUTS if self.outputs_crc is not None else 0)
            | (_HAS_FEATURE if self.feature is not None else 0)
            | (_HAS_TOKENS if self.token_ids is not None else 0)
            | (_HAS_WRITER if self.writer is not None else 0)
        )
        feature = b"" if self.feature is None else np.ascontiguousarray(self.feature, dtype="<f4").tobytes()
        tokens = b"" if self.token_ids is None else np.ascontiguousarray(self.token_ids, dtype="<u4").tobytes()
        writer = b"" if self.writer is None else _writer_bytes(self.writer)
        body = (
            _ENTRY_HEAD.pack(
                _ENTRY_MAGIC,
                _ENTRY_VERSION,
                flags,
                self.id,
                self.slot,
                self.length,
                len(self.crcs),
                0 if self.feature is None else self.feature.shape[0],
                self.outputs_crc or 0,
                self.created,
                self.nbytes,
                self.token_hash,
            )
            + np.asarray(self.crcs, dtype="<u4").tobytes()
            + feature
            + tokens
            + writer
        )
        return body + _CRC_TAIL.pack(crc32c.crc32c(body))

    @classmethod
    def from_bytes(cls, raw: bytes | memoryview) -> EntryRecord:
        """Unpack a record; copies out of ``raw`` so it may be a transaction buffer.

        Raises:
            ChecksumError: the record is truncated, has a wrong magic or crc32c.
        """
        raw = memoryview(raw)
        if len(raw) < _ENTRY_HEAD.size + _CRC_TAIL.size:
            raise ChecksumError(f"entry record truncated ({len(raw)} bytes)")
        (stored_crc,) = _CRC_TAIL.unpack_from(raw, len(raw) - _CRC_TAIL.size)
        if crc32c.crc32c(raw[: -_CRC_TAIL.size]) != stored_crc:
            raise ChecksumError("entry record crc32c mismatch")
        magic, version, flags, entry_id, slot, length, n_crcs, feature_dim, outputs_crc, created, nbytes, th = (
            _ENTRY_HEAD.unpack_from(raw)
        )
        if magic != _ENTRY_MAGIC or version != _ENTRY_VERSION:
            raise ChecksumError(f"entry record has magic {magic!r} version {version}, expected {_ENTRY_MAGIC!r} 1")
        offset = _ENTRY_HEAD.size
        crcs = tuple(np.frombuffer(raw, dtype="<u4", count=n_crcs, offset=offset).tolist())
        offset += 4 * n_crcs
        feature = None
        if flags & _HAS_FEATURE:
            feature = np.frombuffer(raw, dtype="<f4", count=feature_dim, offset=offset).astype(np.float32)
            offset += 4 * feature_dim
        token_ids = None
        if flags & _HAS_TOKENS:
            token_ids = np.frombuffer(raw, dtype="<u4", count=length, offset=offset).astype(np.uint32)
            offset += 4 * length
        writer = None
        if flags & _HAS_WRITER:
            size = raw[offset]
            writer = bytes(raw[offset + 1 : offset + 1 + size]).decode("utf-8", errors="replace")
        return cls(
            id=entry_id,
            slot=slot,
            length=length,
            created=created,
            token_hash=TokenHash(bytes(th)),
            crcs=crcs,
            nbytes=nbytes,
            outputs_crc=outputs_crc if flags & _HAS_OUTPUTS else None,
            feature=feature,
            token_ids=token_ids,
            writer=writer,
        )


def _writer_bytes(writer: str) -> bytes:
    data = writer.encode()[:255]  # names are at most 64 characters (the token file's rule)
    return bytes([len(data)]) + data


def check_map_record(state: NamespaceState, record: EntryRecord, n_arrays: int) -> None:
    """Check, before reading them, that ``record`` stores maps in ``n_arrays`` arrays per layer (every backend).

    Raises:
        MapsNotStoredError: the entry stores outputs only (written back for the exact tier).
        ChecksumError: the record lists another number of crcs than the layout has stored objects.
    """
    if not record.crcs and record.outputs_crc is not None:
        raise MapsNotStoredError(
            f"entry {record.id} of namespace {state.name!r} stores outputs only (written back for the exact tier):"
            " it has no maps to replay"
        )
    if len(record.crcs) != state.layout.layers * n_arrays:
        raise ChecksumError(
            f"entry {record.id} of namespace {state.name!r}: record has {len(record.crcs)} crcs,"
            f" expected {state.layout.layers * n_arrays}"
        )
