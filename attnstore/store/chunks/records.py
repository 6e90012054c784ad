"""How a chunk entry is kept, shared by every backend: one piece of bytes per layer and a record.

A chunk's pieces are its keys and values of layer 0, 1, ... (each
``(2, kv_heads, C, head_dim)`` in the layout's dtype, layer-contiguous so a
reader streams it layer by layer). Its record holds when it was stored, its
length, who wrote it and a crc32c per layer, and is written in the same
transaction as the pieces: a chunk is visible exactly when its record is.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import crc32c
import numpy as np

from attnstore.errors import ChecksumError, StoreFullError
from attnstore.protocol.chunks import ChunkLayout, StoredChunk
from attnstore.store.eviction import ChunkCandidate, by_recency, plan_eviction

_HEAD = struct.Struct("<dIHB")  # created (unix seconds), length (tokens), layer count, whether a writer follows
LayerBytes = bytes | memoryview


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """A stored chunk's metadata: its length, writer and its layers' checksums."""

    created: float
    length: int  # tokens (C)
    crcs: tuple[int, ...]  # crc32c per layer
    writer: str | None

    def encode(self) -> bytes:
        """Bytes on disk: the head, a crc32c per layer, then the writer (UTF-8)."""
        head = _HEAD.pack(self.created, self.length, len(self.crcs), self.writer is not None)
        return head + struct.pack(f"<{len(self.crcs)}I", *self.crcs) + (self.writer or "").encode()

    @classmethod
    def decode(cls, raw: bytes | memoryview, name: str = "a chunk") -> ChunkRecord:
        """The record ``encode`` wrote.

        Raises:
            ChecksumError: bytes no record encodes (cut short or overwritten), naming the chunk ``name``.
        """
        try:
            created, length, count, has_writer = _HEAD.unpack_from(raw, 0)
            crcs = struct.unpack_from(f"<{count}I", raw, _HEAD.size)
            tail = bytes(raw[_HEAD.size + 4 * count :])
            writer = tail.decode() if has_writer else None
        except (struct.error, UnicodeDecodeError) as exc:
            raise ChecksumError(f"{name}: its record is damaged ({exc})") from exc
        if has_writer > 1 or (tail and not has_writer) or length < 1:
            raise ChecksumError(f"{name}: its record is damaged ({len(raw)} bytes no record encodes)")
        return cls(created, length, crcs, writer)


def stored_length(raw: bytes | memoryview | None) -> int | None:
    """The length a stored record says, or None for no record or a damaged one (that chunk is computed where a
    prompt needs it, and verify names it)."""
    if raw is None:
        return None
    try:
        return ChunkRecord.decode(raw).length
    except ChecksumError:
        return None


def recorded_writer(raw: bytes | memoryview | None) -> tuple[bool, str | None]:
    """Whether a record is stored, and the writer it names (None: an admin's, or a damaged record)."""
    if raw is None:
        return False, None
    try:
        return True, ChunkRecord.decode(raw).writer
    except ChecksumError:
        return True, None


def chunk_pieces(chunk: StoredChunk) -> list[bytes]:
    """The bytes of a checked chunk, one piece per layer."""
    return [chunk.kv[layer].tobytes() for layer in range(chunk.kv.shape[0])]


def new_record(chunk: StoredChunk, pieces: Sequence[bytes]) -> ChunkRecord:
    """The record of a chunk about to be stored."""
    return ChunkRecord(time.time(), chunk.length, tuple(crc32c.crc32c(p) for p in pieces), chunk.writer)


def where(namespace: str, key: bytes) -> str:
    """How errors and reports name a chunk."""
    return f"chunk {key.hex()} of namespace {namespace!r}"


def gather_layers(
    namespace: str, layout: ChunkLayout, key: bytes, record: ChunkRecord, layers: Sequence[int],
    piece: Callable[[int], LayerBytes | None],
) -> np.ndarray:
    """Layers ``layers`` of one chunk, each checked against its crc32c, in one new array
    ``(len(layers), 2, kv_heads, C, head_dim)``.

    Args:
        piece: a layer's stored bytes, or None when they are gone.

    Raises:
        ChecksumError: a layer's bytes are missing or fail their crc32c (the message names the chunk's key).
    """
    shape = layout.layer_shape(record.length)
    out = np.empty((len(layers), *shape), dtype=np.dtype(layout.dtype))
    for index, layer in enumerate(layers):
        raw = piece(layer)
        problem = layer_problem(record, layer, raw, out[index].nbytes)
        if problem is not None:
            raise ChecksumError(f"{where(namespace, key)}: {problem}")
        assert raw is not None  # layer_problem names missing bytes
        out[index] = np.frombuffer(raw, dtype=out.dtype).reshape(shape)
    return out


def layer_problem(record: ChunkRecord, layer: int, raw: LayerBytes | None, nbytes: int) -> str | None:
    """What is wrong with a layer's stored bytes (None: nothing)."""
    if raw is None:
        return f"layer {layer} is missing"
    if len(raw) != nbytes:
        return f"layer {layer} holds {len(raw)} bytes, not {nbytes}"
    if layer >= len(record.crcs) or crc32c.crc32c(raw) != record.crcs[layer]:
        return f"layer {layer} fails its crc32c"
    return None


def chunk_problem(layout: ChunkLayout, record: ChunkRecord, piece: Callable[[int], LayerBytes | None]) -> str | None:
    """The first thing wrong with a stored chunk (what ``verify`` reports), or None."""
    if len(record.crcs) != layout.layers:
        return f"its record lists {len(record.crcs)} layers, not {layout.layers}"
    nbytes = layout.chunk_bytes(record.length) // layout.layers
    for layer in range(layout.layers):
        problem = layer_problem(record, layer, piece(layer), nbytes)
        if problem is not None:
            return problem
    return None


def chunks_to_evict(
    used: int, incoming: int, max_bytes: int | None, low_water: float, candidates: Iterable[ChunkCandidate],
) -> list[ChunkCandidate]:
    """The chunks a write of ``incoming`` bytes evicts, least recent first, so that the store ends at most at
    ``low_water * max_bytes`` (or at the cap when that is all the chunks allow).

    Args:
        used: bytes stored now (entries and chunks).
        incoming: bytes the write adds.
        max_bytes: the cap (None: no cap, nothing evicted).
        low_water: fraction of the cap evicted down to, so eviction runs once per many writes.
        candidates: every chunk the write may evict (not its own).

    Raises:
        StoreFullError: evicting every candidate still leaves the store over its cap.
    """
    plan = plan_eviction(used + incoming, max_bytes, low_water, by_recency(candidates))
    if max_bytes is not None and plan.left > max_bytes:
        raise StoreFullError(
            f"no room for {incoming} bytes of chunks: the store holds {plan.left - incoming} bytes after evicting"
            f" every other chunk, and its cap is {max_bytes} bytes (entries are evicted only by an ingest)"
        )
    return plan.victims
