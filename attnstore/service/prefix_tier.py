"""The prefix tier of the service: which stored prefix each row may start from, and its keys and values.

A row's prefix is asked for as its chain of block hashes (computed by the
client from its token ids, see ``attnstore.protocol.prefix``); the answer is,
per row, how many of its blocks are stored from the start on. The client asks
only for the blocks that leave at least one token to compute and for prefixes
long enough to pay, so the answer is used as it is.

A block found corrupt while it was read is *cut* (``PrefixCuts``):
from then on every chain through it is answered as ending before it, so clients
stop fetching megabytes they cannot use on every call. Cuts are this process's
(a restart finds the block again at its next read; ``admin verify`` names it).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from attnstore.errors import PrefixBlockCorruptError
from attnstore.protocol.prefix import PrefixLayout, check_prefix_request
from attnstore.store.base import MapStoreBase

if TYPE_CHECKING:
    from attnstore.protocol.records import NamespaceInfo


class PrefixCuts:
    """The prefix blocks found unservable while serving, per namespace; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cut: dict[str, set[bytes]] = {}

    def cut(self, namespace: str, chain_hash: bytes) -> None:
        """Answer every chain through ``chain_hash`` as ending before it from now on."""
        with self._lock:
            self._cut.setdefault(namespace, set()).add(bytes(chain_hash))

    def forget(self, namespace: str) -> None:
        """Forget the cuts of a dropped namespace."""
        with self._lock:
            self._cut.pop(namespace, None)

    def blocks(self, namespace: str, chain: Sequence[bytes], stored: int) -> int:
        """How many of ``chain``'s first ``stored`` blocks come before the first cut one."""
        with self._lock:
            cut = self._cut.get(namespace)
            if not cut:
                return stored
            return next((position for position in range(stored) if bytes(chain[position]) in cut), stored)


def prefix_matches(
    store: MapStoreBase, cuts: PrefixCuts, namespace: str, block_size: int, rows: Sequence[Sequence[bytes]]
) -> list[int]:
    """Each row's count of stored blocks from its first on (a lookup stops at the first missing or cut block).

    Raises:
        FingerprintMismatchError: the namespace stores no prefix blocks, or blocks of another size.
        MapShapeError: a hash that is not 32 bytes.
    """
    check_prefix_request(store.prefix_layout(namespace), namespace, block_size)
    return [cuts.blocks(namespace, row, store.match_prefix(namespace, row)) for row in rows]


def read_prefix(
    store: MapStoreBase, namespace: str, block_size: int, chain: Sequence[bytes], chunk: int
) -> np.ndarray:
    """Chunk ``chunk`` of a row's stored prefix: a layer's keys and values ``(2, KVH, p, d)``, or (``chunk`` =
    the layer count) the prefix's last hidden states ``(p, hidden)``.

    Raises:
        FingerprintMismatchError: another block size.
        PrefixBlockMissingError: a block is no longer stored, or the chain skips its parents;
            PrefixBlockCorruptError: a block is corrupt (both name it; see ``PrefixCuts``).
    """
    layout: PrefixLayout = check_prefix_request(store.prefix_layout(namespace), namespace, block_size)
    if chunk == layout.layers:
        return store.read_prefix_hidden(namespace, chain)
    return store.read_prefix_layer(namespace, chain, chunk)


class PrefixTierCalls:
    """The prefix tier's calls of ``AttnStoreService`` (a mixin: its store, its cuts and its fingerprint check)."""

    _store: MapStoreBase
    _prefix_cuts: PrefixCuts

    if TYPE_CHECKING:

        def check_fingerprint(self, name: str, fingerprint: str) -> NamespaceInfo: ...  # the service's

    def prefix_layout(self, namespace: str) -> PrefixLayout | None:
        """How the namespace stores prefix blocks; None when it stores none."""
        return self._store.prefix_layout(namespace)

    def prefix_matches(
        self, namespace: str, fingerprint: str, block_size: int, rows: Sequence[Sequence[bytes]]
    ) -> list[int]:
        """Each row's stored prefix in whole blocks (see ``prefix_tier.prefix_matches``).

        Raises:
            FingerprintMismatchError: another model, or blocks of another size (or none).
        """
        self.check_fingerprint(namespace, fingerprint)
        return prefix_matches(self._store, self._prefix_cuts, namespace, block_size, rows)

    def read_prefix(self, namespace: str, block_size: int, chain: Sequence[bytes], chunk: int) -> np.ndarray:
        """One chunk of a row's stored prefix (see ``prefix_tier.read_prefix``); a block found corrupt is cut, so
        prefix matches end before it from then on (a missing block ends them already: matches read records)."""
        try:
            return read_prefix(self._store, namespace, block_size, chain, chunk)
        except PrefixBlockCorruptError as exc:
            self._prefix_cuts.cut(namespace, exc.chain_hash)
            raise
