"""The service's prefix part, the daemon's side of the prefix tier: which stored prefix each row may start
from, and its keys and values.

A row's prefix is asked for as its chain of block hashes (computed by the
client from its token ids, see ``attnstore.protocol.prefix``); the answer is,
per row, how many of its blocks are stored from the start on. The client asks
only for the blocks that leave at least one token to compute and for prefixes
long enough to pay, so the answer is used as it is.

Blocks are put whole and all-or-nothing per call (a node's write-back of a prefix
it computed): the namespace takes the first put's ``PrefixLayout`` when it records
none (an admin build sets it too), and a put in another layout is refused naming
both, so no client is served keys and values of another model's shapes or dtype.

A block found corrupt while it was read is *cut* (``PrefixCuts``):
from then on every chain through it is answered as ending before it, so clients
stop fetching megabytes they cannot use on every call. Cuts are this process's
(a restart finds the block again at its next read; ``admin verify`` names it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from attnstore.errors import FingerprintMismatchError, MapShapeError, PrefixBlockCorruptError
from attnstore.protocol.prefix import PrefixBlock, PrefixLayout, check_block, check_prefix_request
from attnstore.store.base import MapStoreBase

if TYPE_CHECKING:
    from attnstore.protocol.records import NamespaceInfo


@dataclass(frozen=True, slots=True)
class PrefixPutResult:
    """What one put of prefix blocks did."""

    stored: int  # blocks new to the store
    duplicates: int  # blocks it had already (another node, or a build, was first)
    bytes: int  # bytes of the new ones


def check_prefix_layout(stored: PrefixLayout, namespace: str, layout: PrefixLayout) -> None:
    """Raises ``FingerprintMismatchError`` naming both when a put's ``layout`` is not the namespace's ``stored``."""
    if stored != layout:
        raise FingerprintMismatchError(
            f"namespace {namespace!r} stores prefix blocks of {stored}; the request's are {layout}"
            " (another block size, model or dtype)"
        )


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


class ServicePrefixes:
    """The service's prefix part: its stored prefix blocks (over the store), matched and read; thread-safe."""

    def __init__(self, store: MapStoreBase, check_fingerprint: Callable[[str, str], NamespaceInfo]) -> None:
        """
        Args:
            store: the service's map store.
            check_fingerprint: the service's check that a request's model is the namespace's
                (``AttnStoreService.check_fingerprint``).
        """
        self._store = store
        self._check_fingerprint = check_fingerprint
        self._cuts = PrefixCuts()  # prefix blocks found unservable: chains end before them

    def layout(self, namespace: str) -> PrefixLayout | None:
        """How the namespace stores prefix blocks; None when it stores none."""
        if self._store.prefixes is None:  # a store without prefix blocks: no namespace stores any
            self._store.get_namespace(namespace)
            return None
        return self._store.prefixes.layout(namespace)

    def matches(self, namespace: str, fingerprint: str, block_size: int, rows: Sequence[Sequence[bytes]]) -> list[int]:
        """Each row's count of stored blocks from its first on (a lookup stops at the first missing or cut block).

        Raises:
            NamespaceNotFoundError: no such namespace.
            FingerprintMismatchError: another model, or blocks of another size (or none).
            MapShapeError: a hash that is not 32 bytes.
        """
        self._check_fingerprint(namespace, fingerprint)
        check_prefix_request(self.layout(namespace), namespace, block_size)
        prefixes = self._store.require_prefixes("prefixes.match()")
        return [self._cuts.blocks(namespace, row, prefixes.match(namespace, row)) for row in rows]

    def read(self, namespace: str, block_size: int, chain: Sequence[bytes], part: int) -> np.ndarray:
        """Part ``part`` of a row's stored prefix: a layer's keys and values ``(2, KVH, p, d)``, or (``part`` =
        the layer count) the prefix's last hidden states ``(p, hidden)``.

        A block found corrupt is cut, so prefix matches end before it from then on (a missing block ends them
        already: matches read records).

        Raises:
            FingerprintMismatchError: another block size.
            PrefixBlockMissingError: a block is no longer stored, or the chain skips its parents;
                PrefixBlockCorruptError: a block is corrupt (both name it; see ``PrefixCuts``).
        """
        layout = check_prefix_request(self.layout(namespace), namespace, block_size)
        prefixes = self._store.require_prefixes("prefixes.read_layer()")
        try:
            if part == layout.layers:
                return prefixes.read_hidden(namespace, chain)
            return prefixes.read_layer(namespace, chain, part)
        except PrefixBlockCorruptError as exc:
            self._cuts.cut(namespace, exc.chain_hash)
            raise

    def put(
        self, namespace: str, fingerprint: str, layout: PrefixLayout, blocks: Sequence[PrefixBlock]
    ) -> PrefixPutResult:
        """Store ``blocks`` (all or none, parents before children); the namespace takes ``layout`` when it records
        none yet.

        Raises:
            NamespaceNotFoundError, FingerprintMismatchError: another model, or another prefix layout.
            MapShapeError: a block that does not fit ``layout``, is not finite, or whose parent is neither stored
                nor earlier in ``blocks`` (nothing is stored).
            StoreFullError: the store is full (nothing is stored).
        """
        self._check_fingerprint(namespace, fingerprint)
        checked = [_finite(check_block(layout, block, position)) for position, block in enumerate(blocks)]
        recorded = self.layout(namespace)
        if recorded is not None:
            check_prefix_layout(recorded, namespace, layout)
        if not checked:
            return PrefixPutResult(0, 0, 0)
        prefixes = self._store.require_prefixes("prefixes.put()")
        if recorded is None:  # the first put's layout (refused when another put set another one meanwhile)
            prefixes.set_layout(namespace, layout)
        stored = prefixes.put(namespace, checked)
        return PrefixPutResult(stored, len(checked) - stored, stored * layout.block_bytes)

    def forget(self, namespace: str) -> None:
        """Forget what was learnt of a dropped namespace (its cut blocks)."""
        self._cuts.forget(namespace)


def _finite(block: PrefixBlock) -> PrefixBlock:
    """``block``, once its keys, values and hidden states are finite (a NaN would be served to every node)."""
    if not (np.isfinite(block.kv).all() and np.isfinite(block.hidden).all()):
        raise MapShapeError(f"prefix block {block.chain_hash.hex()[:16]}: keys, values or hidden states that are"
                            " not finite")
    return block
