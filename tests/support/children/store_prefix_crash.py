"""Child process of the prefix-block crash test: stores and extends chains of prefix blocks until it is killed.

Chain ``c`` is a fixed token sequence of ``CHAIN_BLOCKS`` blocks; its first
``SHARED_BLOCKS`` blocks are shared by every chain of its family (``c %
FAMILIES``), as a few-shot header is. Each call stores a chain's blocks from the
start up to a new end, several more than are stored (the stored ones are
skipped, as ``attnstore build`` does). The child reports on a pipe, one line per
write, before and after each call: ``begin C FIRST LAST`` / ``put C FIRST LAST``
(FIRST: the blocks of chain C stored before the call; LAST: its end after it).
A ``put`` line means the transaction committed. Block content derives from the
block's chain hash alone (:func:`block_of`), so the parent can check it.
"""

from __future__ import annotations

import os
import random
from functools import cache
from pathlib import Path

import numpy as np

from attnstore.protocol.prefix import PrefixBlock, PrefixLayout, chain_hashes
from attnstore.store import LmdbMapStore
from tests.support.stores import small_layout

# 4 layers of 8 KiB (two pages each, so every part overflows a page) and 4 KiB of hidden states per block.
LAYOUT = PrefixLayout(block_size=16, layers=4, kv_heads=2, head_dim=32, hidden=64, dtype="float32")
NAMESPACE = "ns"
FINGERPRINT = "f" * 64
CHAIN_BLOCKS = 12
SHARED_BLOCKS = 2
FAMILIES = 3


@cache
def chain_of(chain: int) -> tuple[bytes, ...]:
    """The chain hashes of chain ``chain``'s blocks."""
    size = LAYOUT.block_size
    shared = np.random.default_rng(chain % FAMILIES).integers(0, 50_000, SHARED_BLOCKS * size)
    own = np.random.default_rng(1_000 + chain).integers(0, 50_000, (CHAIN_BLOCKS - SHARED_BLOCKS) * size)
    return tuple(chain_hashes(np.concatenate([shared, own]), size))


def block_of(chain_hash: bytes, parent: bytes | None) -> PrefixBlock:
    """The block stored under ``chain_hash``: float32 keys, values and hidden states from the hash alone.

    Float32 from numpy only: a forked child must not start thread pools (torch's) its parent may have started.
    """
    rng = np.random.default_rng(int.from_bytes(chain_hash[:8], "little"))
    kv = rng.standard_normal((LAYOUT.layers, *LAYOUT.layer_shape), dtype=np.float32)
    hidden = rng.standard_normal((LAYOUT.block_size, LAYOUT.hidden), dtype=np.float32)
    return PrefixBlock(chain_hash, parent, kv, hidden)


def blocks_of(chain: int, end: int) -> list[PrefixBlock]:
    """Blocks ``0..end-1`` of chain ``chain``."""
    hashes = chain_of(chain)
    return [block_of(hashes[i], hashes[i - 1] if i else None) for i in range(end)]


def run(path: Path, chains: int, out_fd: int, seed: int) -> None:
    """Work on the store at ``path`` forever; chains ``0..chains-1`` were begun by earlier children."""
    rng = random.Random(seed)

    def say(line: str) -> None:
        os.write(out_fd, (line + "\n").encode())

    with LmdbMapStore.open(path, create=True) as store:
        store.create_namespace(NAMESPACE, model="crash", fingerprint=FINGERPRINT, layout=small_layout())
        store.prefixes.set_layout(NAMESPACE, LAYOUT)
        stored = {c: store.prefixes.match(NAMESPACE, list(chain_of(c))) for c in range(chains)}
        say("ready")
        while True:
            open_chains = [c for c, end in stored.items() if end < CHAIN_BLOCKS]
            if open_chains and rng.random() < 0.6:
                chain = rng.choice(open_chains)
            else:
                chain = chains
                chains += 1
                stored[chain] = store.prefixes.match(NAMESPACE, list(chain_of(chain)))  # its family's blocks
            first = stored[chain]
            last = min(CHAIN_BLOCKS, first + rng.randint(2, 5))
            say(f"begin {chain} {first} {last}")
            store.prefixes.put(NAMESPACE, blocks_of(chain, last))
            say(f"put {chain} {first} {last}")
            stored[chain] = last
