"""Bit rot in a stored chunk of a real LMDB store, for the chunk tier's failure tests."""

from __future__ import annotations

from pathlib import Path

from attnstore.store import LmdbMapStore
from attnstore.store.lmdb.chunks.keys import piece_key


def damage_chunk(store_path: Path, namespace: str, key: bytes, *, layer: int) -> None:
    """Flip the first byte of layer ``layer`` of chunk ``key`` (its record, and so its crc32c, stay as they are)."""
    with LmdbMapStore.open(store_path) as store, store._live.write() as (gen, txn):
        piece = piece_key(namespace, key, layer)
        raw = bytearray(txn.get(piece, db=gen.db.chunks))
        raw[0] ^= 0xFF
        txn.put(piece, bytes(raw), db=gen.db.chunks)
