"""Chunk entries: the keys (before RoPE) and values of a text chunk computed on its own, reused at any position
(``layout``; shared by the store, which checks and keeps them, and the client, which computes and asks)."""

from attnstore.protocol.chunks.layout import (
    CHUNK_DTYPES,
    CHUNK_KEY_BYTES,
    ChunkDtype,
    ChunkLayout,
    StoredChunk,
    check_chunk,
)

__all__ = ["CHUNK_DTYPES", "CHUNK_KEY_BYTES", "ChunkDtype", "ChunkLayout", "StoredChunk", "check_chunk"]
