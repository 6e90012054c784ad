"""How a prefix block is kept, shared by every backend: one part per layer, then the hidden states.

A block's parts are its keys and values of layer 0, 1, ... (each
``(2, kv_heads, block_size, head_dim)``, layer-contiguous like maps) and last
its tokens' hidden states ``(block_size, hidden)``, each with a crc32c in the
block's record. The record is written in the same transaction as the parts:
a block is visible exactly when its record is.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import crc32c
import numpy as np

from attnstore.errors import PrefixBlockCorruptError, PrefixBlockMissingError
from attnstore.protocol.keys import BLOCK_HASH_BYTES
from attnstore.protocol.prefix import PrefixBlock, PrefixLayout

_HEAD = struct.Struct("<dI")  # created (unix seconds), part count
_NO_PARENT = bytes(BLOCK_HASH_BYTES)
_WRITER = b"W"  # after the crcs: the writer's name follows (records written before writers were kept end there)


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """A stored block's metadata: its parent in the chain, its parts' checksums and who wrote it."""

    created: float
    parent: bytes | None
    crcs: tuple[int, ...]  # per layer, then the hidden states
    writer: str | None = None  # the token name that put it; None: an admin's build (or a record from before)

    def encode(self) -> bytes:
        """Bytes on disk: created, count, parent (zeros for none), crc32c per part, then the writer (if any)."""
        crcs = struct.pack(f"<{len(self.crcs)}I", *self.crcs)
        writer = b"" if self.writer is None else _WRITER + self.writer.encode()
        return _HEAD.pack(self.created, len(self.crcs)) + (self.parent or _NO_PARENT) + crcs + writer

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> BlockRecord:
        """The record ``encode`` wrote."""
        created, count = _HEAD.unpack_from(raw, 0)
        parent = bytes(raw[_HEAD.size : _HEAD.size + BLOCK_HASH_BYTES])
        crcs = struct.unpack_from(f"<{count}I", raw, _HEAD.size + BLOCK_HASH_BYTES)
        tail = bytes(raw[_HEAD.size + BLOCK_HASH_BYTES + 4 * count :])
        writer = tail[1:].decode(errors="replace") if tail[:1] == _WRITER else None
        return cls(created, None if parent == _NO_PARENT else parent, crcs, writer)


def recorded_writer(raw: bytes | memoryview | None) -> tuple[bool, str | None]:
    """Whether a block's record is stored, and the writer it names (None: an admin's build, a record from
    before writers were kept, or a damaged one)."""
    if raw is None:
        return False, None
    try:
        return True, BlockRecord.decode(raw).writer
    except struct.error:
        return True, None


def block_parts(block: PrefixBlock) -> list[bytes]:
    """The parts of a checked block, in key order: every layer's keys and values, then the hidden states."""
    return [block.kv[layer].tobytes() for layer in range(block.kv.shape[0])] + [block.hidden.tobytes()]


def new_record(block: PrefixBlock, parts: Sequence[bytes]) -> BlockRecord:
    """The record of a block about to be stored."""
    return BlockRecord(time.time(), block.parent, tuple(crc32c.crc32c(c) for c in parts), block.writer)


def writer_blocks(records: Iterable[tuple[bytes, BlockRecord]], writer: str) -> list[bytes]:
    """The blocks ``writer`` put and every block chained after one of them (their children, theirs, ...):
    what dropping a writer removes, since a child's keys and values were computed after its parents'."""
    children: dict[bytes, list[bytes]] = {}
    doomed: list[bytes] = []
    for chain_hash, record in records:
        if record.parent is not None:
            children.setdefault(record.parent, []).append(chain_hash)
        if record.writer == writer:
            doomed.append(chain_hash)
    seen = set(doomed)
    queue = list(doomed)
    while queue:
        for child in children.get(queue.pop(), ()):
            if child not in seen:
                seen.add(child)
                doomed.append(child)
                queue.append(child)
    return doomed


def part_shape(layout: PrefixLayout, part: int) -> tuple[int, ...]:
    """Shape of part ``part`` of one block (a layer's keys and values, or ``layers``: the hidden states)."""
    return (layout.block_size, layout.hidden) if part == layout.layers else layout.layer_shape


def gather_parts(
    namespace: str, layout: PrefixLayout, chain_hashes: Sequence[bytes], part: int,
    read: Callable[[bytes], tuple[BlockRecord, bytes | memoryview] | None],
) -> np.ndarray:
    """Part ``part`` of every block, checked and concatenated along the tokens into one new array.

    A chain is served only from its first block on: the first block must have no parent and each
    other block the one before it, so a block whose parents are gone (or a request that skips them)
    is never served on its own.

    Args:
        read: a block's record and part bytes by chain hash, or None when the block is not stored.

    Raises:
        PrefixBlockMissingError: a block is not stored, or is not the child of the block before it.
        PrefixBlockCorruptError: a part fails its crc32c. Both name the block by its position in the
            chain and its hash.
    """
    dtype = np.dtype(layout.dtype)
    shape = part_shape(layout, part)
    axis = 0 if part == layout.layers else 2  # the token axis
    out_shape = list(shape)
    out_shape[axis] *= len(chain_hashes)
    out = np.empty(out_shape, dtype=dtype)
    step = layout.block_size
    parent: bytes | None = None
    for position, chain_hash in enumerate(chain_hashes):
        where = f"prefix block {position} of {len(chain_hashes)} in the chain ({chain_hash.hex()})"
        found = read(chain_hash)
        if found is None:
            raise PrefixBlockMissingError(f"{where} of namespace {namespace!r} is not stored", block=position,
                                          chain_hash=chain_hash)
        record, raw = found
        if record.parent != parent:
            raise PrefixBlockMissingError(
                f"{where} of namespace {namespace!r} is not the child of the block before it in the request:"
                " a chain is served from its first block on", block=position, chain_hash=chain_hash,
            )
        if crc32c.crc32c(raw) != record.crcs[part]:
            what = "hidden states" if part == layout.layers else f"layer {part}"
            raise PrefixBlockCorruptError(
                f"{where} of namespace {namespace!r}: part {part} ({what}) fails its crc32c", block=position,
                chain_hash=chain_hash,
            )
        parent = chain_hash
        piece = np.frombuffer(raw, dtype=dtype).reshape(shape)
        if axis == 0:
            out[position * step : (position + 1) * step] = piece
        else:
            out[:, :, position * step : (position + 1) * step] = piece
    return out
