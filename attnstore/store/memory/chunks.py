"""Chunk entries of MemoryMapStore: the same behaviour as the LMDB backend's, in dicts."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from attnstore.errors import EntryNotFoundError, FingerprintMismatchError
from attnstore.protocol.chunks import ChunkLayout, StoredChunk
from attnstore.protocol.records import NamespaceInfo
from attnstore.store.chunks.records import (
    ChunkCandidate,
    ChunkRecord,
    chunk_pieces,
    chunk_problem,
    chunks_to_evict,
    gather_layers,
    new_record,
    where,
)
from attnstore.store.reports import CorruptChunk

logger = logging.getLogger(__name__)


@dataclass
class _Chunks:
    layout: ChunkLayout
    records: dict[bytes, ChunkRecord] = field(default_factory=dict)
    pieces: dict[bytes, list[bytes]] = field(default_factory=dict)
    last_read: dict[bytes, float] = field(default_factory=dict)

    def nbytes(self, key: bytes) -> int:
        return sum(len(p) for p in self.pieces[key])

    def drop(self, key: bytes) -> bool:
        self.pieces.pop(key, None)
        self.last_read.pop(key, None)
        return self.records.pop(key, None) is not None


def _piece(pieces: list[bytes], layer: int) -> bytes | None:
    return pieces[layer] if layer < len(pieces) else None


class MemoryChunks:
    """The chunk hooks of ``MapStoreBase`` for the in-memory store (a mixin before ``MapStoreBase``: it needs
    the store's ``get_namespace``, ``_lock``, ``_max_bytes``, ``_entry_bytes`` and a ``_chunks`` dict)."""

    _lock: threading.RLock
    _chunks: dict[str, _Chunks]
    _max_bytes: int | None

    if TYPE_CHECKING:

        def get_namespace(self, name: str) -> NamespaceInfo: ...  # the store's

        def _entry_bytes(self) -> int: ...  # the store's: stored bytes of every live entry

    supports_chunks = True  # see ``ChunkCalls.supports_chunks``

    def _chunks_of(self, namespace: str) -> _Chunks | None:
        self.get_namespace(namespace)
        return self._chunks.get(namespace)

    def _set_chunk_layout(self, namespace: str, layout: ChunkLayout) -> ChunkLayout:
        with self._lock:
            chunks = self._chunks_of(namespace)
            if chunks is None:
                self._chunks[namespace] = _Chunks(layout)
            elif chunks.layout != layout:
                raise FingerprintMismatchError(
                    f"namespace {namespace!r} stores chunks as {chunks.layout}; asked for {layout}"
                )
            return layout

    def _chunk_layout(self, namespace: str) -> ChunkLayout | None:
        chunks = self._chunks_of(namespace)
        return None if chunks is None else chunks.layout

    def _put_chunks(self, namespace: str, layout: ChunkLayout, new: list[StoredChunk]) -> int:
        with self._lock:
            chunks = self._chunks_of(namespace)
            assert chunks is not None  # the base checked the layout
            fresh = [c for c in new if c.key not in chunks.records]
            incoming = sum(c.kv.nbytes for c in fresh)
            protect = {c.key for c in new}
            candidates = [c for c in self._chunk_candidates() if not (c.namespace == namespace and c.key in protect)]
            used = self._entry_bytes() + self._chunk_bytes()
            victims = chunks_to_evict(used, incoming, self._max_bytes, 0.9, candidates)  # raises before any change
            for victim in victims:
                self._chunks[victim.namespace].drop(victim.key)
            if victims:
                logger.warning("memory store over its cap of %s bytes: evicted %s least recently read chunks",
                               self._max_bytes, len(victims))
            for chunk in fresh:
                pieces = chunk_pieces(chunk)
                chunks.records[chunk.key] = new_record(chunk, pieces)
                chunks.pieces[chunk.key] = pieces
            return len(fresh)

    def _chunk_lengths(self, namespace: str, keys: list[bytes]) -> list[int | None]:
        chunks = self._chunks_of(namespace)
        assert chunks is not None
        with self._lock:
            return [None if (r := chunks.records.get(key)) is None else r.length for key in keys]

    def _read_chunk(self, namespace: str, layout: ChunkLayout, key: bytes, layers: list[int]) -> np.ndarray:
        chunks = self._chunks_of(namespace)
        assert chunks is not None
        with self._lock:
            record = chunks.records.get(key)
            if record is None:
                raise EntryNotFoundError(f"{where(namespace, key)} is not stored")
            pieces = chunks.pieces[key]
            chunks.last_read[key] = time.time()
        return gather_layers(namespace, layout, key, record, layers, lambda layer: pieces[layer])

    def _delete_chunks(self, namespace: str, keys: list[bytes]) -> int:
        with self._lock:
            chunks = self._chunks_of(namespace)
            assert chunks is not None
            return sum(chunks.drop(key) for key in keys)

    def _chunk_bytes(self) -> int:
        return sum(c.nbytes(key) for c in self._chunks.values() for key in c.records)

    def _chunk_candidates(self) -> list[ChunkCandidate]:
        """Every stored chunk, with its recency, for the byte cap."""
        return [
            ChunkCandidate(max(record.created, chunks.last_read.get(key, 0.0)), name, key, chunks.nbytes(key))
            for name, chunks in self._chunks.items()
            for key, record in chunks.records.items()
        ]

    def _evict_chunk(self, namespace: str, key: bytes) -> int:
        """Drop one chunk for the byte cap (an ingest's eviction); returns its bytes."""
        chunks = self._chunks[namespace]
        nbytes = chunks.nbytes(key)
        chunks.drop(key)
        return nbytes

    def _chunk_usage(self) -> dict[str, tuple[int, int]]:
        """Chunk entries and their bytes per namespace."""
        return {name: (len(c.records), sum(c.nbytes(key) for key in c.records)) for name, c in self._chunks.items()}

    def _chunk_findings(self) -> tuple[int, list[CorruptChunk]]:
        """Chunks checked, and each damaged one."""
        checked, corrupt = 0, []
        for name, chunks in sorted(self._chunks.items()):
            for key, record in chunks.records.items():
                checked += 1
                problem = chunk_problem(chunks.layout, record, partial(_piece, chunks.pieces[key]))
                if problem is not None:
                    corrupt.append(CorruptChunk(name, key.hex(), problem))
        return checked, corrupt
