"""Chunk entries of MemoryMapStore (``store.chunks``): the same behaviour as the LMDB backend's, in dicts."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from attnstore.errors import EntryNotFoundError
from attnstore.protocol.chunks import ChunkLayout, StoredChunk
from attnstore.protocol.records import NamespaceInfo
from attnstore.store.chunks.interface import StoredChunks
from attnstore.store.chunks.records import (
    ChunkRecord,
    chunk_pieces,
    chunk_problem,
    chunks_to_evict,
    gather_layers,
    new_record,
    where,
)
from attnstore.store.eviction import ChunkCandidate
from attnstore.store.namespace_rules import check_same_layout
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


class MemoryChunks(StoredChunks):
    """Chunk entries of the in-memory store (its ``store.chunks``), per namespace in a dict."""

    def __init__(self, lock: threading.RLock, max_bytes: int | None, low_water: float,
                 namespace: Callable[[str], NamespaceInfo], entry_bytes: Callable[[], int]) -> None:
        """
        Args:
            lock: the store's lock (a write of chunks is atomic with the store's own writes).
            max_bytes: the store's byte cap, over its entries and chunks together.
            low_water: the fraction of the cap eviction goes down to.
            namespace: the store's ``get_namespace`` (raises NamespaceNotFoundError).
            entry_bytes: the stored bytes of every live entry of the store.
        """
        self._lock = lock
        self._max_bytes = max_bytes
        self._low_water = low_water
        self._namespace = namespace
        self._entry_bytes = entry_bytes
        self._chunks: dict[str, _Chunks] = {}  # namespace -> its chunk entries

    def forget(self, namespace: str) -> None:
        """Drop a dropped namespace's chunks."""
        self._chunks.pop(namespace, None)

    def _chunks_of(self, namespace: str) -> _Chunks | None:
        self._namespace(namespace)
        return self._chunks.get(namespace)

    def _set_layout(self, namespace: str, layout: ChunkLayout) -> ChunkLayout:
        with self._lock:
            chunks = self._chunks_of(namespace)
            if chunks is None:
                self._chunks[namespace] = _Chunks(layout)
            else:
                check_same_layout(namespace, "chunks", chunks.layout, layout)
            return layout

    def _layout(self, namespace: str) -> ChunkLayout | None:
        chunks = self._chunks_of(namespace)
        return None if chunks is None else chunks.layout

    def _put(self, namespace: str, layout: ChunkLayout, new: list[StoredChunk]) -> int:
        with self._lock:
            chunks = self._chunks_of(namespace)
            assert chunks is not None  # the base checked the layout
            fresh = [c for c in new if c.key not in chunks.records]
            incoming = sum(c.kv.nbytes for c in fresh)
            protect = {c.key for c in new}
            candidates = [c for c in self.candidates() if not (c.namespace == namespace and c.key in protect)]
            used = self._entry_bytes() + self.total_bytes()
            # Raises (StoreFullError) before anything changes.
            victims = chunks_to_evict(used, incoming, self._max_bytes, self._low_water, candidates)
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

    def _lengths(self, namespace: str, keys: list[bytes]) -> list[int | None]:
        chunks = self._chunks_of(namespace)
        assert chunks is not None
        with self._lock:
            return [None if (r := chunks.records.get(key)) is None else r.length for key in keys]

    def _read(self, namespace: str, layout: ChunkLayout, key: bytes, layers: list[int]) -> np.ndarray:
        chunks = self._chunks_of(namespace)
        assert chunks is not None
        with self._lock:
            record = chunks.records.get(key)
            if record is None:
                raise EntryNotFoundError(f"{where(namespace, key)} is not stored")
            pieces = chunks.pieces[key]
            chunks.last_read[key] = time.time()
        return gather_layers(namespace, layout, key, record, layers, lambda layer: pieces[layer])

    def _writer_keys(self, namespace: str, writer: str) -> list[bytes]:
        with self._lock:
            chunks = self._chunks_of(namespace)
            assert chunks is not None
            return [key for key, record in chunks.records.items() if record.writer == writer]

    def _writer_of(self, namespace: str, key: bytes) -> tuple[bool, str | None]:
        with self._lock:
            chunks = self._chunks_of(namespace)
            assert chunks is not None
            record = chunks.records.get(key)
            return record is not None, None if record is None else record.writer

    def _delete(self, namespace: str, keys: list[bytes]) -> int:
        with self._lock:
            chunks = self._chunks_of(namespace)
            assert chunks is not None
            return sum(chunks.drop(key) for key in keys)

    def total_bytes(self) -> int:
        return sum(c.nbytes(key) for c in self._chunks.values() for key in c.records)

    def candidates(self) -> list[ChunkCandidate]:
        """Every stored chunk, with its recency, for the byte cap."""
        return [
            ChunkCandidate(max(record.created, chunks.last_read.get(key, 0.0)), name, key, chunks.nbytes(key))
            for name, chunks in self._chunks.items()
            for key, record in chunks.records.items()
        ]

    def evict(self, namespace: str, key: bytes) -> int:
        """Drop one chunk for the byte cap (an ingest's eviction); returns its bytes."""
        chunks = self._chunks[namespace]
        nbytes = chunks.nbytes(key)
        chunks.drop(key)
        return nbytes

    def usage(self) -> dict[str, tuple[int, int]]:
        """Chunk entries and their bytes per namespace."""
        return {name: (len(c.records), sum(c.nbytes(key) for key in c.records)) for name, c in self._chunks.items()}

    def findings(self) -> tuple[int, list[CorruptChunk]]:
        """Chunks checked, and each damaged one."""
        checked, corrupt = 0, []
        for name, chunks in sorted(self._chunks.items()):
            for key, record in chunks.records.items():
                checked += 1
                problem = chunk_problem(chunks.layout, record, partial(_piece, chunks.pieces[key]))
                if problem is not None:
                    corrupt.append(CorruptChunk(name, key.hex(), problem))
        return checked, corrupt
