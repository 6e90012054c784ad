"""How a namespace stores chunk entries, and one chunk to store.

A chunk entry is the keys and values of every layer for one text chunk
computed on its own (after the namespace's instruction, if it has one), keyed by
a 32-byte hash of the chunk's tokens and what they were computed after (the
client's ``chunk_key``). Keys are stored before RoPE, so a reader rotates them to
whatever positions the chunk takes in its prompt. Unlike a prefix block a chunk
has its own length (``C`` tokens, at least one); every chunk of a namespace
follows the namespace's ``ChunkLayout``.

Imports numpy and ``attnstore.errors`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from attnstore.errors import ConfigError, MapShapeError

ChunkDtype = Literal["float16", "float32"]
CHUNK_DTYPES: tuple[ChunkDtype, ...] = ("float16", "float32")
CHUNK_KEY_BYTES = 32  # a sha256 (the client's ``chunk_key``)
_FIELDS = ("layers", "kv_heads", "head_dim", "dtype")


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """How one namespace stores chunk entries (recorded with the namespace; every chunk follows it)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: ChunkDtype  # the model's compute dtype ("float32" keeps reuse exact) or fp16 (half the bytes)

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ChunkLayout: {name} must be an int >= 1, got {value!r}")
        if self.dtype not in CHUNK_DTYPES:
            raise ConfigError(f"ChunkLayout: dtype must be one of {list(CHUNK_DTYPES)}, got {self.dtype!r}")

    def layer_shape(self, length: int) -> tuple[int, int, int, int]:
        """One layer of a chunk of ``length`` tokens: keys and values ``(2, kv_heads, length, head_dim)``."""
        return (2, self.kv_heads, length, self.head_dim)

    def chunk_bytes(self, length: int) -> int:
        """Bytes of a whole chunk of ``length`` tokens: every layer's keys and values."""
        return self.layers * 2 * self.kv_heads * length * self.head_dim * np.dtype(self.dtype).itemsize

    def to_dict(self) -> dict[str, object]:
        """Plain dict (JSON, on disk and on the wire)."""
        return {"layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim, "dtype": self.dtype}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ChunkLayout:
        """The layout a ``to_dict`` wrote.

        Raises:
            ConfigError: a field is missing or invalid.
        """
        missing = [name for name in _FIELDS if name not in data]
        if missing:
            raise ConfigError(f"chunk layout record lacks {missing}; it has {sorted(data)}")
        return cls(**{name: data[name] for name in _FIELDS})  # type: ignore[arg-type]


@dataclass(frozen=True)
class StoredChunk:
    """One chunk to store: its key and its keys (before RoPE) and values at every layer."""

    key: bytes  # CHUNK_KEY_BYTES
    kv: np.ndarray  # (layers, 2, kv_heads, C, head_dim) in the layout's dtype; [:, 0] keys, [:, 1] values
    writer: str | None = None  # who computed it (a node's name), recorded with the chunk
    token_ids: np.ndarray | None = None  # (C,) its tokens: the daemon derives the key from them (a put needs them)
    context_ids: np.ndarray | None = None  # the tokens it was computed after (the instruction); None: none

    @property
    def length(self) -> int:
        """Tokens of the chunk (``C``)."""
        return int(self.kv.shape[3])


def check_chunk(layout: ChunkLayout, chunk: StoredChunk, position: int) -> StoredChunk:
    """``chunk`` with its array contiguous, once it fits ``layout``.

    Args:
        layout: the namespace's chunk layout.
        chunk: the chunk to check.
        position: its position in the caller's list (named in errors).

    Raises:
        MapShapeError: not a StoredChunk, a key that is not 32 bytes, a writer that is not a string, or keys
            and values of another shape or dtype (or no tokens).
    """
    if not isinstance(chunk, StoredChunk):
        raise MapShapeError(f"chunk {position} must be a StoredChunk, got {type(chunk).__name__}")
    if not isinstance(chunk.key, bytes) or len(chunk.key) != CHUNK_KEY_BYTES:
        raise MapShapeError(f"chunk {position}: key must be {CHUNK_KEY_BYTES} bytes, got {chunk.key!r:.80}")
    if chunk.writer is not None and not isinstance(chunk.writer, str):
        raise MapShapeError(f"chunk {position}: writer must be a string or None, got {type(chunk.writer).__name__}")
    kv = chunk.kv
    shape = getattr(kv, "shape", None)
    fits = (
        isinstance(kv, np.ndarray) and kv.ndim == 5 and shape is not None and shape[3] >= 1
        and shape == (layout.layers, *layout.layer_shape(shape[3]))
    )
    if not fits or kv.dtype != np.dtype(layout.dtype):
        wanted = (layout.layers, *layout.layer_shape(0))[:3] + ("C >= 1", layout.head_dim)
        got = (shape, str(getattr(kv, "dtype", type(kv).__name__)))
        raise MapShapeError(
            f"chunk {position} ({chunk.key.hex()}): kv must be {wanted} {layout.dtype} for this namespace, got {got}"
        )
    return StoredChunk(chunk.key, np.ascontiguousarray(kv), chunk.writer, chunk.token_ids, chunk.context_ids)
