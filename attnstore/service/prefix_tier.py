"""The prefix tier of the service: which stored prefix each row may start from, and its keys and values.

A row's prefix is asked for as its chain of block hashes (computed by the
client from its token ids, see ``attnstore.protocol.prefix``); the answer is,
per row, how many of its blocks are stored from the start on. The client asks
only for the blocks that leave at least one token to compute and for prefixes
long enough to pay, so the answer is used as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from attnstore.protocol.prefix import PrefixLayout, check_prefix_request
from attnstore.store.base import MapStoreBase


def prefix_matches(
    store: MapStoreBase, namespace: str, block_size: int, rows: Sequence[Sequence[bytes]]
) -> list[int]:
    """Each row's count of stored blocks from its first on (a lookup stops at the first missing block).

    Raises:
        FingerprintMismatchError: the namespace stores no prefix blocks, or blocks of another size.
        MapShapeError: a hash that is not 32 bytes.
    """
    check_prefix_request(store.prefix_layout(namespace), namespace, block_size)
    return [store.match_prefix(namespace, row) for row in rows]


def read_prefix(
    store: MapStoreBase, namespace: str, block_size: int, chain: Sequence[bytes], chunk: int
) -> np.ndarray:
    """Chunk ``chunk`` of a row's stored prefix: a layer's keys and values ``(2, KVH, p, d)``, or (``chunk`` =
    the layer count) the prefix's last hidden states ``(p, hidden)``.

    Raises:
        FingerprintMismatchError: another block size.
        EntryNotFoundError: a block is no longer stored; ChecksumError: a block is corrupt.
    """
    layout: PrefixLayout = check_prefix_request(store.prefix_layout(namespace), namespace, block_size)
    if chunk == layout.layers:
        return store.read_prefix_hidden(namespace, chain)
    return store.read_prefix_layer(namespace, chain, chunk)
