"""The prefix-block calls of the map store interface (causal namespaces; see ``attnstore.protocol.prefix``).

``MapStoreBase`` inherits them: every store answers them, and one whose
``supports_prefix_blocks`` is False has no layout for any namespace, matches
nothing and refuses to store blocks. Arguments are checked here, before a
backend's ``_`` method runs (the LMDB and in-memory backends implement those).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from attnstore.errors import ConfigError, EntryNotFoundError, FingerprintMismatchError, MapShapeError
from attnstore.protocol.keys import BLOCK_HASH_BYTES
from attnstore.protocol.prefix import PrefixBlock, PrefixLayout, check_block
from attnstore.protocol.records import NamespaceInfo


def _checked_hashes(method: str, chain_hashes: Sequence[bytes]) -> list[bytes]:
    checked = []
    for position, value in enumerate(chain_hashes):
        if not isinstance(value, bytes | bytearray | memoryview) or len(value) != BLOCK_HASH_BYTES:
            raise MapShapeError(f"{method}(): chain hash {position} must be {BLOCK_HASH_BYTES} bytes, got {value!r:.9}")
        checked.append(bytes(value))
    return checked


class PrefixBlockCalls(ABC):
    """Prefix blocks of a namespace: stored, matched and read by chained hash."""

    @property
    def supports_prefix_blocks(self) -> bool:
        """Whether namespaces may store prefix blocks (``set_prefix_layout`` and the calls after it)."""
        return False

    def _lacks(self, call: str, capability: str) -> ConfigError:
        """The error of a call that needs ``capability``, which this store lacks."""
        return ConfigError(f"{type(self).__name__}.{call}: this store lacks {capability}")

    @abstractmethod
    def get_namespace(self, name: str) -> NamespaceInfo:
        """See :meth:`MapStoreBase.get_namespace`."""

    def set_prefix_layout(self, namespace: str, layout: PrefixLayout) -> PrefixLayout:
        """Record how ``namespace`` stores prefix blocks; its own layout again changes nothing.

        Raises:
            ConfigError: ``layout`` is not a PrefixLayout.
            NamespaceNotFoundError: no such namespace.
            FingerprintMismatchError: the namespace records another layout (another block size, say).
        """
        if not isinstance(layout, PrefixLayout):
            raise ConfigError(f"set_prefix_layout(): layout must be a PrefixLayout, got {type(layout).__name__}")
        return self._set_prefix_layout(namespace, layout)

    def prefix_layout(self, namespace: str) -> PrefixLayout | None:
        """The namespace's prefix layout, or None while it stores no prefix blocks.

        Raises:
            NamespaceNotFoundError: no such namespace.
        """
        return self._prefix_layout(namespace)

    def put_prefix_blocks(self, namespace: str, blocks: Sequence[PrefixBlock]) -> int:
        """Store prefix blocks, all or nothing; returns how many were new (a stored hash is kept as it is).

        A block's ``parent`` must be stored already or come earlier in ``blocks``, so a chain
        is never visible with a gap; a crash mid-call leaves none of the call's blocks.

        Raises:
            NamespaceNotFoundError: no such namespace.
            FingerprintMismatchError: the namespace has no prefix layout.
            MapShapeError: a block that does not fit the layout, or whose parent is not stored.
            StoreFullError: no room (nothing is written).
        """
        layout = self.prefix_layout(namespace)
        if layout is None:
            raise FingerprintMismatchError(f"put_prefix_blocks(): namespace {namespace!r} has no prefix layout")
        return self._put_prefix_blocks(namespace, layout, [check_block(layout, b, i) for i, b in enumerate(blocks)])

    def match_prefix(self, namespace: str, chain_hashes: Sequence[bytes]) -> int:
        """How many of ``chain_hashes`` (one row's chain, from its first block) are stored, counted from the
        start up to the first one that is not: a lookup stops at the first missing block.

        Raises:
            MapShapeError: a hash that is not 32 bytes.
            NamespaceNotFoundError: no such namespace.
        """
        return self._match_prefix(namespace, _checked_hashes("match_prefix", chain_hashes))

    def read_prefix_layer(self, namespace: str, chain_hashes: Sequence[bytes], layer: int) -> np.ndarray:
        """The keys and values of one layer over the blocks of ``chain_hashes``, in order:
        ``(2, kv_heads, blocks * block_size, head_dim)`` in the layout's dtype, one contiguous buffer.

        Raises:
            EntryNotFoundError: a block is not stored (any more).
            ChecksumError: a block's stored bytes are corrupt (the message names it).
            MapShapeError: a bad hash or ``layer``.
        """
        layout = self._layout_or_refuse(namespace)
        if not isinstance(layer, int) or not 0 <= layer < layout.layers:
            raise MapShapeError(f"read_prefix_layer(): layer must be in 0..{layout.layers - 1}, got {layer!r}")
        return self._read_prefix_chunks(namespace, layout, _checked_hashes("read_prefix_layer", chain_hashes), layer)

    def read_prefix_hidden(self, namespace: str, chain_hashes: Sequence[bytes]) -> np.ndarray:
        """The last hidden states of the blocks' tokens, ``(blocks * block_size, hidden)`` in the layout's dtype.

        Raises:
            EntryNotFoundError, ChecksumError, MapShapeError: as :meth:`read_prefix_layer`.
        """
        layout = self._layout_or_refuse(namespace)
        hashes = _checked_hashes("read_prefix_hidden", chain_hashes)
        return self._read_prefix_chunks(namespace, layout, hashes, layout.layers)

    def _layout_or_refuse(self, namespace: str) -> PrefixLayout:
        layout = self.prefix_layout(namespace)
        if layout is None:
            raise FingerprintMismatchError(f"namespace {namespace!r} stores no prefix blocks")
        return layout

    def _set_prefix_layout(self, namespace: str, layout: PrefixLayout) -> PrefixLayout:
        raise self._lacks(f"set_prefix_layout({namespace!r})", "prefix blocks (supports_prefix_blocks)")

    def _prefix_layout(self, namespace: str) -> PrefixLayout | None:
        self.get_namespace(namespace)
        return None  # a backend without prefix blocks: every namespace has none

    def _put_prefix_blocks(self, namespace: str, layout: PrefixLayout, blocks: list[PrefixBlock]) -> int:
        raise self._lacks(f"put_prefix_blocks({namespace!r})", "prefix blocks (supports_prefix_blocks)")

    def _match_prefix(self, namespace: str, chain_hashes: list[bytes]) -> int:
        return 0

    def _read_prefix_chunks(self, namespace: str, layout: PrefixLayout, chain_hashes: list[bytes], chunk: int
                            ) -> np.ndarray:
        """Chunk ``chunk`` (a layer, or ``layout.layers`` for the hidden states) of every block, concatenated
        along the tokens."""
        raise EntryNotFoundError(f"{type(self).__name__} stores no prefix blocks")
