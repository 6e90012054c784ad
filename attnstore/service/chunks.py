"""The service's chunk part, the daemon's side of the chunk tier: which chunks a namespace stores,
their keys and values, and chunks put.

A chunk is the keys (before RoPE) and values of every layer of a text chunk
computed on its own after the namespace's instruction, stored under its
``chunk_key`` (32 bytes, see ``attnstore.protocol.chunks``). A namespace records
one ``ChunkLayout`` (layers, KV heads, head size, dtype) with its first chunks:
every request states the layout it expects, and one of another model, KV layout
or dtype is refused as a whole, naming both, so no client fuses keys and values
computed by another model into its prompts.

Chunks are put whole and all-or-nothing per call (a build's batch, a node's
write-back): a chunk is either absent or readable in full.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from attnstore.errors import FingerprintMismatchError, MapShapeError
from attnstore.protocol.chunks import CHUNK_KEY_BYTES, ChunkLayout, StoredChunk
from attnstore.store.base import MapStoreBase

if TYPE_CHECKING:
    from attnstore.protocol.records import NamespaceInfo


@dataclass(frozen=True, slots=True)
class ChunkPutResult:
    """What one put of chunks did."""

    stored: int  # chunks new to the store
    duplicates: int  # chunks it had already (another node, or an earlier build, was first)
    bytes: int  # bytes of the new ones


def check_chunk_layout(stored: ChunkLayout | None, namespace: str, layout: ChunkLayout) -> ChunkLayout:
    """``stored``, once it equals the request's ``layout``.

    Raises:
        FingerprintMismatchError: the namespace stores no chunks, or chunks of another layout (both named).
    """
    if stored is None:
        raise FingerprintMismatchError(f"namespace {namespace!r} stores no chunks (the request expects {layout})")
    if stored != layout:
        raise FingerprintMismatchError(
            f"namespace {namespace!r} stores chunks of {stored}; the request's are {layout}"
            " (another model, KV layout or dtype: its keys and values would be wrong)"
        )
    return stored


def check_chunk_keys(keys: Sequence[bytes]) -> None:
    """Raises ``MapShapeError`` for a key that is not ``CHUNK_KEY_BYTES`` long."""
    bad = next((key for key in keys if len(key) != CHUNK_KEY_BYTES), None)
    if bad is not None:
        raise MapShapeError(f"a chunk key is {CHUNK_KEY_BYTES} bytes, got {len(bad)}")


class ServiceChunks:
    """The service's chunk part: its stored chunks (over the store), matched, read and put; thread-safe."""

    def __init__(self, store: MapStoreBase, check_fingerprint: Callable[[str, str], NamespaceInfo]) -> None:
        """
        Args:
            store: the service's map store.
            check_fingerprint: the service's check that a request's model is the namespace's
                (``AttnStoreService.check_fingerprint``).
        """
        self._store = store
        self._check_fingerprint = check_fingerprint

    def layout(self, namespace: str) -> ChunkLayout | None:
        """How the namespace stores chunks; None when it stores none (or its store cannot hold chunks)."""
        return None if self._store.chunks is None else self._store.chunks.layout(namespace)

    def check_request(self, namespace: str, fingerprint: str, layout: ChunkLayout) -> ChunkLayout:
        """The namespace's chunk layout, once the request's model and layout are its own.

        Raises:
            NamespaceNotFoundError: no such namespace.
            FingerprintMismatchError: another model, or another chunk layout (or none stored).
        """
        self._check_fingerprint(namespace, fingerprint)
        return check_chunk_layout(self.layout(namespace), namespace, layout)

    def lengths(self, namespace: str, fingerprint: str, layout: ChunkLayout, keys: Sequence[bytes]) -> list[int | None]:
        """Each key's stored chunk length in tokens; None where it is not stored.

        Raises:
            FingerprintMismatchError: see :meth:`check_request`.
            MapShapeError: a key that is not 32 bytes.
        """
        self.check_request(namespace, fingerprint, layout)
        check_chunk_keys(keys)
        return self._store.require_chunks("chunks.lengths()").lengths(namespace, list(keys))

    def read_layer(self, namespace: str, key: bytes, layer: int) -> np.ndarray:
        """One chunk's keys and values of one layer ``(2, KVH, C, d)`` (the request is checked by the caller).

        Raises:
            EntryNotFoundError: the chunk is not stored; ChecksumError: it is damaged (the message names it).
        """
        return self._store.require_chunks("chunks.read_layer()").read_layer(namespace, key, layer)

    def read(self, namespace: str, key: bytes) -> np.ndarray:
        """One chunk's keys and values of every layer ``(layers, 2, KVH, C, d)`` (checked by the caller).

        Raises:
            EntryNotFoundError, ChecksumError: as :meth:`read_layer`.
        """
        return self._store.require_chunks("chunks.read()").read(namespace, key)

    def put(
        self, namespace: str, fingerprint: str, layout: ChunkLayout, chunks: Sequence[StoredChunk]
    ) -> ChunkPutResult:
        """Store ``chunks`` (all or none); the namespace takes ``layout`` when it records none yet.

        Raises:
            NamespaceNotFoundError, FingerprintMismatchError: another model, or another chunk layout.
            MapShapeError: a key that is not 32 bytes, or keys and values that are not finite or do not fit
                ``layout`` (nothing is stored).
            StoreFullError: the store is full (nothing is stored).
        """
        self._check_fingerprint(namespace, fingerprint)
        for chunk in chunks:
            _check_chunk(chunk, layout)
        check_chunk_keys([chunk.key for chunk in chunks])
        recorded = self.layout(namespace)
        if recorded is not None:
            check_chunk_layout(recorded, namespace, layout)
        if not chunks:
            return ChunkPutResult(0, 0, 0)
        stored_chunks = self._store.require_chunks("chunks.put()")
        if recorded is None:  # the first put's layout (refused when another put set another one meanwhile)
            stored_chunks.set_layout(namespace, layout)
        unique = list({chunk.key: chunk for chunk in chunks}.values())
        known = stored_chunks.lengths(namespace, [chunk.key for chunk in unique])
        stored = stored_chunks.put(namespace, unique)
        fresh = sum(chunk.kv.nbytes for chunk, length in zip(unique, known, strict=True) if length is None)
        return ChunkPutResult(stored, len(chunks) - stored, fresh)


def _check_chunk(chunk: StoredChunk, layout: ChunkLayout) -> None:
    kv = chunk.kv
    length = kv.shape[3] if kv.ndim == 5 else 0
    if length < 1 or kv.shape != (layout.layers, *layout.layer_shape(length)) or kv.dtype != np.dtype(layout.dtype):
        raise MapShapeError(f"chunk {bytes(chunk.key).hex()[:16]}: {kv.dtype} {kv.shape} does not fit {layout}"
                            " ((layers, 2, kv_heads, C, head_dim), C >= 1)")
    if not np.isfinite(kv).all():
        raise MapShapeError(f"chunk {bytes(chunk.key).hex()[:16]}: keys or values that are not finite")
