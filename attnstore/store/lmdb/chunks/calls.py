"""Chunk entries of the LMDB store: one write transaction per ``put_chunks`` call.

A call's chunks commit together or not at all, so a process killed mid-call
leaves none of them. Reads are read transactions; when a chunk was read is noted
in memory and written with the next write (as buffered hits are), where the byte
cap's eviction reads it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import lmdb
import numpy as np

from attnstore.errors import EntryNotFoundError, FingerprintMismatchError
from attnstore.protocol.chunks import ChunkLayout, StoredChunk
from attnstore.store.chunks.interface import StoredChunks
from attnstore.store.chunks.records import chunks_to_evict, gather_layers, where
from attnstore.store.lmdb.chunks.keys import (
    delete_chunk,
    eviction_candidates,
    is_stored,
    note_reads,
    piece_key,
    put_chunk,
    read_layout,
    read_record,
    record_length,
    record_writer,
    total_bytes,
    writer_keys,
)
from attnstore.store.lmdb.env import DbHandle, Generation
from attnstore.store.lmdb.layouts import set_layout
from attnstore.store.lmdb.records import stored_bytes

if TYPE_CHECKING:
    from attnstore.protocol.records import NamespaceInfo
    from attnstore.store.lmdb.live import LiveGeneration
    from attnstore.store.lmdb.settings import StoreSettings

logger = logging.getLogger(__name__)


class ChunkReads:
    """When chunks were last read, noted by readers and written by the next write transaction."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, bytes], float] = {}

    def note(self, namespace: str, key: bytes) -> None:
        """Chunk ``key`` of ``namespace`` was just read."""
        with self._lock:
            self._pending[(namespace, key)] = time.time()

    def flush(self, txn: lmdb.Transaction, db: DbHandle | None) -> None:
        """Write the noted reads in ``txn`` (a write transaction about to evict)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        note_reads(txn, db, pending)


class LmdbChunks(StoredChunks):
    """Chunk entries of an LMDB store (its ``store.chunks``), in the live generation's chunk sub-database.

    ``reads`` notes when chunks were read; the store's ingest writes them too, before its byte-cap eviction.
    """

    def __init__(self, live: LiveGeneration, settings: StoreSettings, namespace: Callable[[str], NamespaceInfo]
                 ) -> None:
        """
        Args:
            live: the store's live generation.
            settings: the store's settings (its byte cap).
            namespace: the store's ``get_namespace`` (raises NamespaceNotFoundError).
        """
        self._live = live
        self._settings = settings
        self._namespace = namespace
        self.reads = ChunkReads()

    @contextmanager
    def _chunk_read(self, namespace: str) -> Iterator[tuple[Generation, lmdb.Transaction]]:
        self._namespace(namespace)
        with self._live.read() as (gen, txn):
            yield gen, txn

    def _set_layout(self, namespace: str, layout: ChunkLayout) -> ChunkLayout:
        self._namespace(namespace)
        with self._live.write() as (gen, txn):
            assert gen.db.chunks is not None  # a writer opens (creates) it
            set_layout(txn, gen.db.chunks, namespace, "chunks", layout)
        return layout

    def _layout(self, namespace: str) -> ChunkLayout | None:
        with self._chunk_read(namespace) as (gen, txn):
            return read_layout(txn, gen.db.chunks, namespace)

    def _put(self, namespace: str, layout: ChunkLayout, chunks: list[StoredChunk]) -> int:
        self._namespace(namespace)
        max_bytes = self._settings.max_bytes
        with self._live.write() as (gen, txn):
            db = gen.db.chunks
            assert db is not None
            if read_layout(txn, db, namespace) != layout:
                raise FingerprintMismatchError(f"namespace {namespace!r}: its chunk layout changed meanwhile")
            fresh = [c for c in chunks if not is_stored(txn, db, namespace, c.key)]
            incoming = sum(c.kv.nbytes for c in fresh)
            victims = []
            if max_bytes is not None and fresh:
                used = stored_bytes(txn, gen.db) + total_bytes(txn, db)
                if used + incoming > max_bytes:
                    self.reads.flush(txn, db)
                    protect = {(namespace, c.key) for c in chunks}
                    # Raising aborts the transaction: nothing of this call is written, nothing evicted.
                    victims = chunks_to_evict(used, incoming, max_bytes, self._settings.evict_low_water,
                                              eviction_candidates(txn, db, protect))
            for victim in victims:
                delete_chunk(txn, db, victim.namespace, victim.key)
            for chunk in fresh:
                put_chunk(txn, db, namespace, chunk)
        if victims:
            logger.warning("map store over its cap of %s bytes: evicted %s least recently read chunks (%s bytes)",
                           max_bytes, len(victims), sum(v.nbytes for v in victims))
        return len(fresh)

    def _lengths(self, namespace: str, keys: list[bytes]) -> list[int | None]:
        with self._chunk_read(namespace) as (gen, txn):
            return [record_length(txn, gen.db.chunks, namespace, key) for key in keys]

    def _read(self, namespace: str, layout: ChunkLayout, key: bytes, layers: list[int]) -> np.ndarray:
        with self._chunk_read(namespace) as (gen, txn):
            db = gen.db.chunks
            record = read_record(txn, db, namespace, key)
            if record is None:
                raise EntryNotFoundError(f"{where(namespace, key)} is not stored")
            # Copies out of the transaction's pages (zero-copy views) before it ends.
            out = gather_layers(namespace, layout, key, record, layers,
                                lambda layer: txn.get(piece_key(namespace, key, layer), db=db))
        self.reads.note(namespace, key)
        return out

    def _writer_keys(self, namespace: str, writer: str) -> list[bytes]:
        with self._chunk_read(namespace) as (gen, txn):
            return writer_keys(txn, gen.db.chunks, namespace, writer)

    def _writer_of(self, namespace: str, key: bytes) -> tuple[bool, str | None]:
        with self._chunk_read(namespace) as (gen, txn):
            return record_writer(txn, gen.db.chunks, namespace, key)

    def _delete(self, namespace: str, keys: list[bytes]) -> int:
        self._namespace(namespace)
        with self._live.write() as (gen, txn):
            db = gen.db.chunks
            assert db is not None
            return sum(delete_chunk(txn, db, namespace, key) is not None for key in keys)

