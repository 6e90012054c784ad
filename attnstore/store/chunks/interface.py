"""Stored chunks, an optional part of a map store (chunk entries; see ``attnstore.protocol.chunks``).

A store that keeps them offers one ``StoredChunks`` as ``store.chunks``; a store
that does not has ``store.chunks`` None. Arguments are checked here, before an
implementation's ``_`` method runs (the in-memory, LMDB and Redis backends
implement those), so the backends cannot drift apart on what they accept.

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


def _checked_keys(method: str, keys: Sequence[bytes]) -> list[bytes]:
    checked = []
    for position, value in enumerate(keys):
        if not isinstance(value, bytes | bytearray | memoryview) or len(value) != CHUNK_KEY_BYTES:
            raise MapShapeError(f"{method}(): chunk key {position} must be {CHUNK_KEY_BYTES} bytes, got {value!r:.80}")
        checked.append(bytes(value))
    return checked


class StoredChunks(ABC):
    """Chunk entries of a store's namespaces: stored, looked up, read layer by layer and deleted by key."""

    def set_layout(self, namespace: str, layout: ChunkLayout) -> ChunkLayout:
        """Record how ``namespace`` stores chunk entries; its own layout again changes nothing.

        Raises:
            ConfigError: ``layout`` is not a ChunkLayout, or the store takes no writes.
            NamespaceNotFoundError: no such namespace.
            FingerprintMismatchError: the namespace records another layout (another model's, say).
        """
        if not isinstance(layout, ChunkLayout):
            raise ConfigError(f"chunks.set_layout(): layout must be a ChunkLayout, got {type(layout).__name__}")
        return self._set_layout(namespace, layout)

    def layout(self, namespace: str) -> ChunkLayout | None:
        """The namespace's chunk layout, or None while it stores no chunks.

        Raises:
            NamespaceNotFoundError: no such namespace.
        """
        return self._layout(namespace)

    def put(self, namespace: str, chunks: Sequence[StoredChunk]) -> int:
        """Store chunks, all or nothing; returns how many were new (a stored key is kept as it is, and a key
        given twice is stored once, from its first chunk). A crash mid-call leaves none of the call's chunks.

        Raises:
            NamespaceNotFoundError: no such namespace.
            FingerprintMismatchError: the namespace has no chunk layout.
            MapShapeError: a chunk that does not fit the layout (the message names its position).
            StoreFullError: no room, even after evicting every other chunk (nothing is written).
        """
        layout = self.layout(namespace)
        if layout is None:
            raise FingerprintMismatchError(f"chunks.put(): namespace {namespace!r} has no chunk layout")
        checked: dict[bytes, StoredChunk] = {}
        for position, chunk in enumerate(chunks):
            good = check_chunk(layout, chunk, position)
            checked.setdefault(good.key, good)
        return self._put(namespace, layout, list(checked.values()))

    def lengths(self, namespace: str, keys: Sequence[bytes]) -> list[int | None]:
        """The stored length (tokens) of each key's chunk, or None where none is stored; one read for the lot.

        Raises:
            MapShapeError: a key that is not 32 bytes.
            NamespaceNotFoundError: no such namespace.
        """
        checked = _checked_keys("chunks.lengths", keys)
        if self.layout(namespace) is None:
            return [None] * len(checked)
        return self._lengths(namespace, checked)

    def read_layer(self, namespace: str, key: bytes, layer: int) -> np.ndarray:
        """One layer of a chunk: keys (before RoPE) and values ``(2, kv_heads, C, head_dim)`` in the layout's
        dtype, a new array.

        Raises:
            EntryNotFoundError: the chunk is not stored (or was evicted meanwhile).
            ChecksumError: its stored bytes are damaged (the message names the chunk by its hex key).
            FingerprintMismatchError: the namespace stores no chunks.
            MapShapeError: a bad key or ``layer``.
            NamespaceNotFoundError: no such namespace.
        """
        (checked,) = _checked_keys("chunks.read_layer", [key])
        layout = self._layout_or_refuse(namespace)
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layout.layers:
            raise MapShapeError(f"chunks.read_layer(): layer must be in 0..{layout.layers - 1}, got {layer!r}")
        return self._read(namespace, layout, checked, [layer])[0]

    def read(self, namespace: str, key: bytes) -> np.ndarray:
        """A whole chunk: ``(layers, 2, kv_heads, C, head_dim)`` in the layout's dtype, a new array.

        Raises:
            EntryNotFoundError, ChecksumError, FingerprintMismatchError, MapShapeError, NamespaceNotFoundError:
                as :meth:`read_layer`.
        """
        (checked,) = _checked_keys("chunks.read", [key])
        layout = self._layout_or_refuse(namespace)
        return self._read(namespace, layout, checked, list(range(layout.layers)))

    def delete(self, namespace: str, keys: Sequence[bytes]) -> int:
        """Delete chunks; returns how many were stored. Every key is checked before anything is deleted.

        Raises:
            MapShapeError: a key that is not 32 bytes (nothing is deleted).
            NamespaceNotFoundError: no such namespace.
        """
        checked = list(dict.fromkeys(_checked_keys("chunks.delete", keys)))
        if self.layout(namespace) is None:
            return 0
        return self._delete(namespace, checked)

    def writer_keys(self, namespace: str, writer: str) -> list[bytes]:
        """The keys of the chunks ``writer`` put (``admin drop-writer`` deletes them).

        Raises:
            ConfigError: an empty writer name (it would name every admin-built chunk).
            NamespaceNotFoundError: no such namespace.
        """
        if not isinstance(writer, str) or not writer:
            raise ConfigError(f"chunks.writer_keys(): writer must be a non-empty name, got {writer!r}")
        if self.layout(namespace) is None:
            return []
        return self._writer_keys(namespace, writer)

    def writer_of(self, namespace: str, key: bytes) -> tuple[bool, str | None]:
        """Whether the chunk ``key`` is stored, and the writer its record names (None: an admin's build, or a
        damaged record); what the quarantine reports of a chunk an audit found wrong.

        Raises:
            MapShapeError: a key that is not 32 bytes.
            NamespaceNotFoundError: no such namespace.
        """
        (checked,) = _checked_keys("chunks.writer_of", [key])
        if self.layout(namespace) is None:
            return False, None
        return self._writer_of(namespace, checked)

    def _layout_or_refuse(self, namespace: str) -> ChunkLayout:
        layout = self.layout(namespace)
        if layout is None:
            raise FingerprintMismatchError(f"namespace {namespace!r} stores no chunks (it has no chunk layout)")
        return layout

    # ---- what an implementation provides (arguments checked) ---------------------------------------

    @abstractmethod
    def _set_layout(self, namespace: str, layout: ChunkLayout) -> ChunkLayout:
        """``set_layout`` with a checked layout (refuse another one inside the write)."""

    @abstractmethod
    def _layout(self, namespace: str) -> ChunkLayout | None:
        """``layout``; raises NamespaceNotFoundError."""

    @abstractmethod
    def _put(self, namespace: str, layout: ChunkLayout, chunks: list[StoredChunk]) -> int:
        """``put`` with chunks checked against ``layout``, each key once."""

    @abstractmethod
    def _lengths(self, namespace: str, keys: list[bytes]) -> list[int | None]:
        """``lengths`` with checked keys, for a namespace with a layout."""

    @abstractmethod
    def _read(self, namespace: str, layout: ChunkLayout, key: bytes, layers: list[int]) -> np.ndarray:
        """Layers ``layers`` of the chunk ``key``, checked: ``(len(layers), 2, kv_heads, C, head_dim)``; marks
        the chunk read (its recency for eviction)."""

    @abstractmethod
    def _writer_keys(self, namespace: str, writer: str) -> list[bytes]:
        """``writer_keys`` for a namespace with a layout (a damaged record names no writer)."""

    @abstractmethod
    def _writer_of(self, namespace: str, key: bytes) -> tuple[bool, str | None]:
        """``writer_of`` with a checked key, for a namespace with a layout (``records.recorded_writer``)."""

    @abstractmethod
    def _delete(self, namespace: str, keys: list[bytes]) -> int:
        """``delete`` with checked keys, each once, for a namespace with a layout."""
