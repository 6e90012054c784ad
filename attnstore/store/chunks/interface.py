"""The chunk-entry calls of the map store interface (see ``attnstore.protocol.chunks``).

``MapStoreBase`` inherits them: every store answers them, and one whose
``supports_chunks`` is False has no chunk layout for any namespace, stores no
chunk and refuses to. Arguments are checked here, before a backend's ``_``
method runs (the in-memory, LMDB and Redis backends implement those).

Chunks count towards the store's byte cap (``max_bytes``) with its entries:
``put_chunks`` makes room by evicting the least recently read chunks (never
entries: those must leave the daemon's indexes, which only an ingest reports),
and an ingest over the cap evicts the least recently used of both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from attnstore.errors import ConfigError, FingerprintMismatchError, MapShapeError
from attnstore.protocol.chunks import CHUNK_KEY_BYTES, ChunkLayout, StoredChunk, check_chunk
from attnstore.protocol.records import NamespaceInfo


def _checked_keys(method: str, keys: Sequence[bytes]) -> list[bytes]:
    checked = []
    for position, value in enumerate(keys):
        if not isinstance(value, bytes | bytearray | memoryview) or len(value) != CHUNK_KEY_BYTES:
            raise MapShapeError(f"{method}(): chunk key {position} must be {CHUNK_KEY_BYTES} bytes, got {value!r:.80}")
        checked.append(bytes(value))
    return checked


class ChunkCalls(ABC):
    """Chunk entries of a namespace: stored, looked up, read layer by layer and deleted by key."""

    @property
    def supports_chunks(self) -> bool:
        """Whether namespaces may store chunk entries (``set_chunk_layout`` and the calls after it)."""
        return False

    @abstractmethod
    def get_namespace(self, name: str) -> NamespaceInfo:
        """See :meth:`MapStoreBase.get_namespace`."""

    def set_chunk_layout(self, namespace: str, layout: ChunkLayout) -> ChunkLayout:
        """Record how ``namespace`` stores chunk entries; its own layout again changes nothing.

        Raises:
            ConfigError: ``layout`` is not a ChunkLayout, or the store keeps no chunks.
            NamespaceNotFoundError: no such namespace.
            FingerprintMismatchError: the namespace records another layout (another model's, say).
        """
        if not isinstance(layout, ChunkLayout):
            raise ConfigError(f"set_chunk_layout(): layout must be a ChunkLayout, got {type(layout).__name__}")
        return self._set_chunk_layout(namespace, layout)

    def chunk_layout(self, namespace: str) -> ChunkLayout | None:
        """The namespace's chunk layout, or None while it stores no chunks.

        Raises:
            NamespaceNotFoundError: no such namespace.
        """
        return self._chunk_layout(namespace)

    def put_chunks(self, namespace: str, chunks: Sequence[StoredChunk]) -> int:
        """Store chunks, all or nothing; returns how many were new (a stored key is kept as it is, and a key
        given twice is stored once, from its first chunk). A crash mid-call leaves none of the call's chunks.

        Raises:
            NamespaceNotFoundError: no such namespace.
            FingerprintMismatchError: the namespace has no chunk layout.
            MapShapeError: a chunk that does not fit the layout (the message names its position).
            StoreFullError: no room, even after evicting every other chunk (nothing is written).
        """
        layout = self.chunk_layout(namespace)
        if layout is None:
            raise FingerprintMismatchError(f"put_chunks(): namespace {namespace!r} has no chunk layout")
        checked: dict[bytes, StoredChunk] = {}
        for position, chunk in enumerate(chunks):
            good = check_chunk(layout, chunk, position)
            checked.setdefault(good.key, good)
        return self._put_chunks(namespace, layout, list(checked.values()))

    def chunk_lengths(self, namespace: str, keys: Sequence[bytes]) -> list[int | None]:
        """The stored length (tokens) of each key's chunk, or None where none is stored; one read for the lot.

        Raises:
            MapShapeError: a key that is not 32 bytes.
            NamespaceNotFoundError: no such namespace.
        """
        checked = _checked_keys("chunk_lengths", keys)
        if self.chunk_layout(namespace) is None:
            return [None] * len(checked)
        return self._chunk_lengths(namespace, checked)

    def read_chunk_layer(self, namespace: str, key: bytes, layer: int) -> np.ndarray:
        """One layer of a chunk: keys (before RoPE) and values ``(2, kv_heads, C, head_dim)`` in the layout's
        dtype, a new array.

        Raises:
            EntryNotFoundError: the chunk is not stored (or was evicted meanwhile).
            ChecksumError: its stored bytes are damaged (the message names the chunk by its hex key).
            FingerprintMismatchError: the namespace stores no chunks.
            MapShapeError: a bad key or ``layer``.
            NamespaceNotFoundError: no such namespace.
        """
        (checked,) = _checked_keys("read_chunk_layer", [key])
        layout = self._chunk_layout_or_refuse(namespace)
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layout.layers:
            raise MapShapeError(f"read_chunk_layer(): layer must be in 0..{layout.layers - 1}, got {layer!r}")
        return self._read_chunk(namespace, layout, checked, [layer])[0]

    def read_chunk(self, namespace: str, key: bytes) -> np.ndarray:
        """A whole chunk: ``(layers, 2, kv_heads, C, head_dim)`` in the layout's dtype, a new array.

        Raises:
            EntryNotFoundError, ChecksumError, FingerprintMismatchError, MapShapeError, NamespaceNotFoundError:
                as :meth:`read_chunk_layer`.
        """
        (checked,) = _checked_keys("read_chunk", [key])
        layout = self._chunk_layout_or_refuse(namespace)
        return self._read_chunk(namespace, layout, checked, list(range(layout.layers)))

    def delete_chunks(self, namespace: str, keys: Sequence[bytes]) -> int:
        """Delete chunks; returns how many were stored. Every key is checked before anything is deleted.

        Raises:
            MapShapeError: a key that is not 32 bytes (nothing is deleted).
            NamespaceNotFoundError: no such namespace.
        """
        checked = list(dict.fromkeys(_checked_keys("delete_chunks", keys)))
        if self.chunk_layout(namespace) is None:
            return 0
        return self._delete_chunks(namespace, checked)

    def _chunk_layout_or_refuse(self, namespace: str) -> ChunkLayout:
        layout = self.chunk_layout(namespace)
        if layout is None:
            raise FingerprintMismatchError(f"namespace {namespace!r} stores no chunks (it has no chunk layout)")
        return layout

    def _refuse_chunks(self, call: str) -> ConfigError:
        return ConfigError(f"{type(self).__name__}.{call}: this store lacks chunk entries (supports_chunks)")

    def _set_chunk_layout(self, namespace: str, layout: ChunkLayout) -> ChunkLayout:
        raise self._refuse_chunks(f"set_chunk_layout({namespace!r})")

    def _chunk_layout(self, namespace: str) -> ChunkLayout | None:
        self.get_namespace(namespace)
        return None  # a backend without chunks: every namespace has none

    def _put_chunks(self, namespace: str, layout: ChunkLayout, chunks: list[StoredChunk]) -> int:
        raise self._refuse_chunks(f"put_chunks({namespace!r})")

    def _chunk_lengths(self, namespace: str, keys: list[bytes]) -> list[int | None]:
        return [None] * len(keys)

    def _read_chunk(self, namespace: str, layout: ChunkLayout, key: bytes, layers: list[int]) -> np.ndarray:
        """Layers ``layers`` of the chunk ``key``, checked: ``(len(layers), 2, kv_heads, C, head_dim)``; marks
        the chunk read (its recency for eviction)."""
        raise self._refuse_chunks(f"read_chunk({namespace!r})")

    def _delete_chunks(self, namespace: str, keys: list[bytes]) -> int:
        return 0
