"""Child process of the chunk crash test: stores batches of chunk entries until it is killed.

Batch ``b`` is a fixed set of chunks (:func:`batch_of`), stored by one
``put_chunks`` call. The child reports on a pipe, one line per write, before and
after each call: ``begin B`` / ``put B``; a ``put`` line means the transaction
committed. A chunk's content derives from its key alone (:func:`chunk_of`), so
the parent can check it.
"""

from __future__ import annotations

import hashlib
import os
import random
from functools import cache
from pathlib import Path

import numpy as np

from attnstore.protocol.chunks import ChunkLayout, StoredChunk
from attnstore.store import LmdbMapStore
from tests.support.stores import small_layout

# Layers of 8 to 24 KiB (several pages each); 8 to 24 chunks a call, so a kill often lands inside one.
LAYOUT = ChunkLayout(layers=4, kv_heads=2, head_dim=32, dtype="float32")
NAMESPACE = "ns"
FINGERPRINT = "f" * 64


@cache
def batch_of(batch: int) -> tuple[bytes, ...]:
    """The keys of batch ``batch``'s chunks."""
    count = random.Random(batch).randint(8, 24)
    return tuple(hashlib.sha256(f"batch {batch} chunk {i}".encode()).digest() for i in range(count))


def chunk_of(key: bytes) -> StoredChunk:
    """The chunk stored under ``key``: float32 keys and values of 16 to 48 tokens from the key alone.

    From numpy only: a forked child must not start thread pools (torch's) its parent may have started.
    """
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    length = int(rng.integers(16, 49))
    kv = rng.standard_normal((LAYOUT.layers, *LAYOUT.layer_shape(length)), dtype=np.float32)
    return StoredChunk(key, kv, writer="crash-child")


def run(path: Path, batches: int, out_fd: int, seed: int) -> None:
    """Store batches ``batches``, ``batches + 1``, ... in the store at ``path`` forever (earlier children
    stored the ones before); one in five repeats chunks of an earlier batch, which are kept as they are."""
    rng = random.Random(seed)

    def say(line: str) -> None:
        os.write(out_fd, (line + "\n").encode())

    with LmdbMapStore.open(path, create=True) as store:
        store.create_namespace(NAMESPACE, model="crash", fingerprint=FINGERPRINT, layout=small_layout())
        store.chunks.set_layout(NAMESPACE, LAYOUT)
        say("ready")
        while True:
            chunks = [chunk_of(key) for key in batch_of(batches)]
            if batches and rng.random() < 0.2:
                chunks += [chunk_of(key) for key in batch_of(rng.randrange(batches))[:3]]
            say(f"begin {batches}")
            store.chunks.put(NAMESPACE, chunks)
            say(f"put {batches}")
            batches += 1
