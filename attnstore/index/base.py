"""The ``VectorIndex`` interface, input validation and the byte format shared by every backend.

An index holds feature vectors under ``uint64`` entry ids and answers k-nearest
neighbour queries with L2 (not squared) distances. Search results come back as
``int64`` ids, ``-1`` meaning "no neighbour" (faiss's convention), so entry ids
must stay below 2**63; the store allocates ids from a counter, far below that.

Serialised form (no pickle): ``MAGIC``, a little-endian ``uint32`` header length,
a JSON header (format version, backend kind, dim, backend metadata and the byte
length of each section) and the raw sections back to back.
"""

from __future__ import annotations

import json
import struct
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

from attnstore.errors import FormatVersionError, VectorIndexError

MAGIC = b"ASVI"
FORMAT_VERSION = 1
MAX_ID = 2**63 - 1

_HEADER_LEN = struct.Struct("<I")


class VectorIndex(ABC):
    """k-nearest-neighbour index of fixed-dimension float32 vectors under uint64 ids.

    One instance serves one (namespace, length bucket). Implementations are not
    thread-safe for writes; the caller serialises ``add``/``remove``.
    """

    kind: ClassVar[str]
    dim: int

    @abstractmethod
    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Add ``vectors`` (n, dim) under ``ids`` (n,).

        Raises:
            VectorIndexError: bad shape or dtype, NaN/Inf, an id out of range, repeated
                in ``ids`` or already present.
        """

    @abstractmethod
    def remove(self, ids: np.ndarray) -> int:
        """Remove ``ids``; ids not present are ignored. Returns how many were removed."""

    @abstractmethod
    def search(self, queries: np.ndarray, k: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` nearest stored vectors of each query.

        Args:
            queries: (q, dim) float vectors.
            k: neighbours per query, >= 1.
        Returns:
            ``(distances, ids)``, both (q, k): float32 L2 distances (not squared),
            ascending, ``inf`` where there is no neighbour; int64 ids, ``-1`` there.
        Raises:
            VectorIndexError: bad shape, NaN/Inf or ``k < 1``.
        """

    @abstractmethod
    def __len__(self) -> int:
        """Number of live vectors."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Memory the index holds, estimated from its sizes (vectors, ids, graph links, bookkeeping): what a
        process keeps per indexed entry, for memory budgets (``attnstore_client.memory``)."""

    @abstractmethod
    def _meta(self) -> tuple[dict[str, object], dict[str, bytes]]:
        """Backend metadata (JSON-able) and raw byte sections for ``to_bytes``."""

    @classmethod
    @abstractmethod
    def _from_meta(cls, dim: int, meta: dict[str, Any], sections: dict[str, bytes]) -> VectorIndex:
        """Rebuild an index from what ``_meta`` returned (``meta`` decoded from JSON)."""

    def to_bytes(self) -> bytes:
        """Serialise the index (vectors, ids, settings) without pickle."""
        meta, sections = self._meta()
        header = {
            "format": FORMAT_VERSION,
            "kind": self.kind,
            "dim": self.dim,
            "meta": meta,
            "sections": [[name, len(blob)] for name, blob in sections.items()],
        }
        head = json.dumps(header, sort_keys=True).encode()
        return b"".join([MAGIC, _HEADER_LEN.pack(len(head)), head, *sections.values()])

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> VectorIndex:
        """Rebuild an index from ``to_bytes`` output.

        Called on ``VectorIndex`` it returns whichever backend wrote the bytes; called
        on a backend it insists on that backend.

        Raises:
            FormatVersionError: not index bytes, or a format version this code does not read.
            VectorIndexError: the bytes are truncated or name an unknown backend.
        """
        view = memoryview(data).cast("B")
        if bytes(view[:4]) != MAGIC:
            raise FormatVersionError(f"{cls.__name__}.from_bytes(): data does not start with {MAGIC!r}")
        (head_len,) = _HEADER_LEN.unpack(view[4:8])
        header = json.loads(bytes(view[8 : 8 + head_len]))
        if header.get("format") != FORMAT_VERSION:
            raise FormatVersionError(
                f"{cls.__name__}.from_bytes(): index format {header.get('format')!r}, this code reads {FORMAT_VERSION}"
            )
        backend = _backend(cls, header["kind"])
        sections: dict[str, bytes] = {}
        offset = 8 + head_len
        for name, size in header["sections"]:
            if offset + size > len(view):
                raise VectorIndexError(f"{cls.__name__}.from_bytes(): section {name!r} is truncated")
            sections[name] = bytes(view[offset : offset + size])
            offset += size
        return backend._from_meta(int(header["dim"]), header["meta"], sections)


def _backend(cls: type[VectorIndex], kind: str) -> type[VectorIndex]:
    """The class among ``cls`` and its subclasses whose ``kind`` is ``kind``."""
    pending = [cls]
    known = []
    while pending:
        candidate = pending.pop()
        if getattr(candidate, "kind", None) == kind:
            return candidate
        known.append(getattr(candidate, "kind", None))
        pending.extend(candidate.__subclasses__())
    choices = sorted(k for k in known if k)
    raise VectorIndexError(f"{cls.__name__}.from_bytes(): backend {kind!r} is not one of {choices}")


def check_dim(dim: int) -> int:
    """Validate an index dimension; returns it as ``int``."""
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
        raise VectorIndexError(f"VectorIndex: dim must be a positive int, got {dim!r}")
    return int(dim)


def check_vectors(where: str, vectors: np.ndarray, dim: int) -> np.ndarray:
    """``vectors`` as a C-contiguous float32 (n, dim) array.

    Raises:
        VectorIndexError: not 2-D, wrong width, not floats, or NaN/Inf.
    """
    array = np.asarray(vectors)
    if array.ndim != 2 or array.shape[1] != dim:
        raise VectorIndexError(f"{where}: expected shape (n, {dim}), got {array.shape}")
    if not np.issubdtype(array.dtype, np.floating):
        raise VectorIndexError(f"{where}: expected float vectors, got dtype {array.dtype}")
    array = np.ascontiguousarray(array, dtype=np.float32)
    if not np.isfinite(array).all():
        bad = int(np.flatnonzero(~np.isfinite(array).all(axis=1))[0])
        raise VectorIndexError(f"{where}: row {bad} holds NaN or Inf")
    return array


def check_ids(where: str, ids: np.ndarray, n: int | None = None) -> np.ndarray:
    """``ids`` as a 1-D uint64 array of distinct ids in [0, 2**63).

    Raises:
        VectorIndexError: not 1-D integers, negative, too large, repeated, or not ``n`` long.
    """
    array = np.asarray(ids)
    if array.ndim != 1:
        raise VectorIndexError(f"{where}: ids must be 1-D, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise VectorIndexError(f"{where}: ids must be integers, got dtype {array.dtype}")
    if n is not None and array.shape[0] != n:
        raise VectorIndexError(f"{where}: {array.shape[0]} ids for {n} vectors")
    if array.size and np.issubdtype(array.dtype, np.signedinteger) and array.min() < 0:
        raise VectorIndexError(f"{where}: ids must be >= 0, got {int(array.min())}")
    array = array.astype(np.uint64)
    if array.size and array.max() > MAX_ID:
        raise VectorIndexError(f"{where}: ids must be < 2**63, got {int(array.max())}")
    if np.unique(array).size != array.size:
        raise VectorIndexError(f"{where}: ids repeat within one call")
    return array


def check_k(where: str, k: int) -> int:
    """Validate a neighbour count."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise VectorIndexError(f"{where}: k must be an int >= 1, got {k!r}")
    return int(k)


def empty_result(q: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Search result with no neighbours: ``inf`` distances, ``-1`` ids."""
    return np.full((q, k), np.inf, dtype=np.float32), np.full((q, k), -1, dtype=np.int64)
