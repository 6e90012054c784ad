"""Chunks from the namespace's store: ``StoreChunkSource``, a daemon or an embedded store behind a local cache.

Chunks are looked up in a node-local ``MemoryChunkSource`` first, then fetched
from the store through the client's connection (``FetchChunks`` from a daemon,
read in process in embedded mode) and kept in the local one. The store keeps a
chunk as one array ``(layers, 2, KVH, C, d)`` of keys (before RoPE) and values
(``StoredChunk``); the chunk tier works on ``ChunkKV`` tensors.

On first use the source reads the namespace: its fingerprint must be the
model's, and its ``ChunkLayout`` (the model's, recorded by ``admin create-namespace`` or a build) must be the
model's layers, KV heads, head size and the dtype asked for, or every call
that fuses chunks raises ``FingerprintMismatchError`` naming both. A chunk the
store holds damaged raises ``ChecksumError`` from ``get`` (``get_many`` reports
it), so the chunk tier leaves the prompt for the other tiers; a store that
cannot be reached is a miss (the chunk is computed in place). Chunks the tier
computed are written back (``writer.ChunkWriter``) where write-back is on and the
namespace records a chunk layout (the daemon refuses a writer's chunks into one
that records none).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from attnstore.errors import (
    AttnStoreError,
    ChecksumError,
    EntryNotFoundError,
    FingerprintMismatchError,
    NamespaceNotFoundError,
)
from attnstore.protocol.chunks import ChunkDtype, ChunkLayout, StoredChunk
from attnstore_client.adapters import Adapter
from attnstore_client.connection import StoreConnection
from attnstore_client.tiers.chunks.source import ChunkKV, ChunkSource, ChunkTokens, MemoryChunkSource
from attnstore_client.tiers.chunks.writer import ChunkWriter, ChunkWriterSettings, ChunkWriterStats

log = logging.getLogger(__name__)

# How often a namespace without chunks is read again (another node's write-back or a build may add them).
_REREAD_S = 60.0
_TORCH_DTYPES = {"float16": torch.float16, "float32": torch.float32}


def model_chunk_layout(adapter: Adapter, dtype: ChunkDtype) -> ChunkLayout:
    """The chunk layout of ``adapter``'s model with chunks kept in ``dtype``."""
    return ChunkLayout(adapter.num_layers, adapter.num_kv_heads, adapter.head_dim, dtype)


def chunk_kv_of(kv: np.ndarray) -> ChunkKV:
    """A stored chunk's ``(layers, 2, KVH, C, d)`` array as ``ChunkKV`` tensors (views, no copy)."""
    array = torch.from_numpy(np.ascontiguousarray(kv))  # (layers, 2, KVH, C, d)
    return ChunkKV(array[:, 0], array[:, 1])


def stored_kv_of(chunk: ChunkKV, dtype: ChunkDtype) -> np.ndarray:
    """``chunk`` as the store keeps it: ``(layers, 2, KVH, C, d)`` in ``dtype``."""
    kv = torch.stack([chunk.keys, chunk.values], dim=1)  # (layers, 2, KVH, C, d)
    return kv.to("cpu", _TORCH_DTYPES[dtype]).numpy()


class StoreChunkSource(ChunkSource):
    """The chunks of ``namespace`` in ``connection``'s store, behind a node-local cache.

    Args:
        connection: the store (a daemon, or embedded).
        namespace: the namespace whose chunks are read.
        fingerprint: the model's fingerprint (the namespace's must be the same).
        adapter: the model's adapter: its layers, KV heads and head size must be the namespace's.
        dtype: the chunk dtype expected (None: the namespace's).
        front: the node-local cache in front of the store (default: a new ``MemoryChunkSource``).
        write_back: put the chunks the tier computes in the store (needs a daemon and a write token).
        timeout: deadline in seconds of one store call.
        writer: queue and call sizes of the write-back.
    """

    def __init__(
        self, connection: StoreConnection, namespace: str, fingerprint: str, adapter: Adapter, *,
        dtype: ChunkDtype | None = None, front: MemoryChunkSource | None = None, write_back: bool = False,
        timeout: float | None = 30.0, writer: ChunkWriterSettings = ChunkWriterSettings(),
    ) -> None:
        self.front = front if front is not None else MemoryChunkSource()
        self._connection, self._namespace, self._fingerprint = connection, namespace, fingerprint
        self._adapter, self._dtype, self._timeout = adapter, dtype, timeout
        self._lock = threading.Lock()
        self._layout: ChunkLayout | None = None  # the namespace's, once read and checked
        self._read_at = -_REREAD_S
        self._writer: ChunkWriter | None = None
        if write_back:
            self._writer = ChunkWriter(connection, namespace, fingerprint, self._write_layout, writer)
            weakref.finalize(self, self._writer.close)

    @property
    def layout(self) -> ChunkLayout | None:
        """The namespace's chunk layout, checked against the model's; None while it stores no chunks.

        Raises:
            FingerprintMismatchError: the namespace belongs to another model, or stores chunks of another
                layout or dtype.
        """
        with self._lock:
            if self._layout is None and time.monotonic() - self._read_at >= _REREAD_S:
                self._read_at = time.monotonic()
                self._layout = self._read_layout()
            return self._layout

    def _read_layout(self) -> ChunkLayout | None:
        try:
            handle = self._connection.namespace(self._namespace)
        except NamespaceNotFoundError:
            raise
        except AttnStoreError as exc:
            log.warning("chunks of namespace %r unreadable for now (%s): computing them", self._namespace, exc)
            self._read_at -= _REREAD_S / 2  # try again sooner than for a namespace without chunks
            return None
        if handle.fingerprint != self._fingerprint:
            raise FingerprintMismatchError(
                f"namespace {self._namespace!r} belongs to model {handle.model!r} with fingerprint"
                f" {handle.fingerprint[:16]}...; this model's is {self._fingerprint[:16]}...: its chunks would be wrong"
            )
        stored = handle.chunks
        if stored is None:
            return None
        expected = model_chunk_layout(self._adapter, self._dtype or stored.dtype)
        if stored != expected:
            raise FingerprintMismatchError(
                f"namespace {self._namespace!r} stores chunks of {stored}; {self._adapter.loaded.name!r} with"
                f" chunks in {expected.dtype} needs {expected} (another model, KV layout or dtype)"
            )
        return stored

    def _write_layout(self) -> ChunkLayout:
        """The layout written-back chunks are sent in: the namespace's (``put`` queues none while it has none).

        Raises:
            FingerprintMismatchError: the namespace records no chunk layout (or another model's).
        """
        layout = self.layout
        if layout is None:
            raise FingerprintMismatchError(f"namespace {self._namespace!r} records no chunk layout: a writer's chunks"
                                           " go only into one that does (attnstore admin create-namespace)")
        return layout

    def get(self, key: bytes) -> ChunkKV | None:
        """See :meth:`ChunkSource.get`.

        Raises:
            ChecksumError: the store holds the chunk damaged (the message names it).
            FingerprintMismatchError: see :attr:`layout`.
        """
        damaged: set[bytes] = set()
        chunk = self.get_many([key], damaged).get(key)
        if key in damaged:
            raise ChecksumError(f"chunk {key.hex()[:16]} of namespace {self._namespace!r} is damaged in the store")
        return chunk

    def get_many(self, keys: Sequence[bytes], damaged: set[bytes] | None = None) -> dict[bytes, ChunkKV]:
        """See :meth:`ChunkSource.get_many`: the local cache first, the rest in one store call."""
        found: dict[bytes, ChunkKV] = {}
        for key in keys:
            chunk = self.front.get(key)
            if chunk is not None:
                found[key] = chunk
        absent = [key for key in dict.fromkeys(keys) if key not in found]
        layout = self.layout if absent else None
        if layout is None:
            return found
        try:
            fetched = self._connection.fetch_chunks(self._namespace, self._fingerprint, layout, absent,
                                                    timeout=self._timeout)
        except FingerprintMismatchError:
            raise
        except AttnStoreError as exc:
            log.warning("chunks of namespace %r not fetched (%s): computing them", self._namespace, exc)
            return found
        for key, kv in zip(absent, fetched, strict=True):
            if isinstance(kv, np.ndarray):
                found[key] = chunk_kv_of(kv)
                self.front.put(key, found[key])
            elif isinstance(kv, EntryNotFoundError):
                continue
            elif damaged is not None:
                log.warning("chunk %s of namespace %r unusable: %s", key.hex()[:16], self._namespace, kv)
                damaged.add(key)
        return found

    def put(self, key: bytes, chunk: ChunkKV, tokens: ChunkTokens | None = None) -> None:
        """See :meth:`ChunkSource.put`: kept locally, and queued for the store where write-back is on (with its
        ``tokens``: a chunk without them is kept locally only, since the daemon files chunks by their ids)."""
        self.front.put(key, chunk)
        if self._writer is not None and tokens is not None and self.layout is not None:
            context = None if tokens.context is None else np.asarray(tokens.context, dtype=np.int64)
            self._writer.put(StoredChunk(key, stored_kv_of(chunk, self._write_layout().dtype),
                                         token_ids=np.asarray(tokens.ids, dtype=np.int64), context_ids=context))

    def contains(self, key: bytes) -> bool:
        """See :meth:`ChunkSource.contains` (one store call for a chunk not held locally)."""
        if self.front.contains(key):
            return True
        layout = self.layout
        if layout is None:
            return False
        lengths = self._connection.match_chunks(self._namespace, self._fingerprint, layout, [key],
                                                timeout=self._timeout)
        return lengths[0] is not None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the chunks queued for the store were sent; True at once without write-back."""
        return self._writer is None or self._writer.flush(timeout)

    def writer_stats(self) -> ChunkWriterStats | None:
        """What the write-back of chunks did so far; None without write-back."""
        return None if self._writer is None else self._writer.stats()

    def close(self) -> None:
        """Send the chunks queued for the store (a few seconds at most) and stop the writer."""
        if self._writer is not None:
            self._writer.close()
