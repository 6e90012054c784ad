"""Prefix blocks, an optional part of a map store (causal namespaces; see ``attnstore.protocol.prefix``).

A store that keeps them offers one ``PrefixBlocks`` as ``store.prefixes``; a store that
does not has ``store.prefixes`` None. Arguments are checked here, before an
implementation's ``_`` method runs (the LMDB and in-memory backends implement those),
so the backends cannot drift apart on what they accept.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from attnstore.errors import ConfigError, FingerprintMismatchError, MapShapeError
from attnstore.protocol.keys import BLOCK_HASH_BYTES
from attnstore.protocol.prefix import PrefixBlock, PrefixLayout, check_block


def _checked_hashes(method: str, chain_hashes: Sequence[bytes]) -> list[bytes]:
    checked = []
    for position, value in enumerate(chain_hashes):
        if not isinstance(value, bytes | bytearray | memoryview) or len(value) != BLOCK_HASH_BYTES:
            raise MapShapeError(f"{method}(): chain hash {position} must be {BLOCK_HASH_BYTES} bytes, got {value!r:.9}")
        checked.append(bytes(value))
    return checked


class PrefixBlocks(ABC):
    """Prefix blocks of a store's namespaces: stored, matched and read by chained hash."""

    def set_layout(self, namespace: str, layout: PrefixLayout) -> PrefixLayout:
        """Record how ``namespace`` stores prefix blocks; its own layout again changes nothing.

        Raises:
            ConfigError: ``layout`` is not a PrefixLayout.
            NamespaceNotFoundError: no such namespace.
            FingerprintMismatchError: the namespace records another layout (another block size, say).
        """
        if not isinstance(layout, PrefixLayout):
            raise ConfigError(f"prefixes.set_layout(): layout must be a PrefixLayout, got {type(layout).__name__}")
        return self._set_layout(namespace, layout)

    def layout(self, namespace: str) -> PrefixLayout | None:
        """The namespace's prefix layout, or None while it stores no prefix blocks.

        Raises:
            NamespaceNotFoundError: no such namespace.
        """
        return self._layout(namespace)

    def put(self, namespace: str, blocks: Sequence[PrefixBlock]) -> int:
        """Store prefix blocks, all or nothing; returns how many were new (a stored hash is kept as it is).

        A block's ``parent`` must be stored already or come earlier in ``blocks``, so a chain
        is never visible with a gap; a crash mid-call leaves none of the call's blocks.

        Raises:
            NamespaceNotFoundError: no such namespace.
            FingerprintMismatchError: the namespace has no prefix layout.
            MapShapeError: a block that does not fit the layout, or whose parent is not stored.
            StoreFullError: no room (nothing is written).
        """
        layout = self.layout(namespace)
        if layout is None:
            raise FingerprintMismatchError(f"prefixes.put(): namespace {namespace!r} has no prefix layout")
        return self._put(namespace, layout, [check_block(layout, b, i) for i, b in enumerate(blocks)])

    def match(self, namespace: str, chain_hashes: Sequence[bytes]) -> int:
        """How many of ``chain_hashes`` (one row's chain, from its first block) are stored, counted from the
        start up to the first one that is not: a lookup stops at the first missing block.

        Raises:
            MapShapeError: a hash that is not 32 bytes.
            NamespaceNotFoundError: no such namespace.
        """
        return self._match(namespace, _checked_hashes("prefixes.match", chain_hashes))

    def read_layer(self, namespace: str, chain_hashes: Sequence[bytes], layer: int) -> np.ndarray:
        """The keys and values of one layer over the blocks of ``chain_hashes``, in order:
        ``(2, kv_heads, blocks * block_size, head_dim)`` in the layout's dtype, one contiguous buffer.

        Raises:
            EntryNotFoundError: a block is not stored (any more).
            ChecksumError: a block's stored bytes are corrupt (the message names it).
            MapShapeError: a bad hash or ``layer``.
        """
        layout = self._layout_or_refuse(namespace)
        if not isinstance(layer, int) or not 0 <= layer < layout.layers:
            raise MapShapeError(f"prefixes.read_layer(): layer must be in 0..{layout.layers - 1}, got {layer!r}")
        return self._read_parts(namespace, layout, _checked_hashes("prefixes.read_layer", chain_hashes), layer)

    def read_hidden(self, namespace: str, chain_hashes: Sequence[bytes]) -> np.ndarray:
        """The last hidden states of the blocks' tokens, ``(blocks * block_size, hidden)`` in the layout's dtype.

        Raises:
            EntryNotFoundError, ChecksumError, MapShapeError: as :meth:`read_layer`.
        """
        layout = self._layout_or_refuse(namespace)
        hashes = _checked_hashes("prefixes.read_hidden", chain_hashes)
        return self._read_parts(namespace, layout, hashes, layout.layers)

    def drop_writer(self, namespace: str, writer: str, *, dry_run: bool = False) -> int:
        """Delete every block ``writer`` put and every block chained after them (in one write); returns how many.

        Raises:
            ConfigError: an empty writer name (it would name every admin-built block).
            NamespaceNotFoundError: no such namespace.
        """
        if not isinstance(writer, str) or not writer:
            raise ConfigError(f"prefixes.drop_writer(): writer must be a non-empty name, got {writer!r}")
        if self.layout(namespace) is None:
            return 0
        return self._drop_writer(namespace, writer, dry_run)

    def writer_of(self, namespace: str, chain_hash: bytes) -> tuple[bool, str | None]:
        """Whether the block ``chain_hash`` is stored, and the writer its record names (None: an admin's build,
        or a record from before writers were kept); what the quarantine reports of a block an audit found wrong.

        Raises:
            MapShapeError: a hash that is not 32 bytes.
            NamespaceNotFoundError: no such namespace.
        """
        (checked,) = _checked_hashes("prefixes.writer_of", [chain_hash])
        if self.layout(namespace) is None:
            return False, None
        return self._writer_of(namespace, checked)

    def _layout_or_refuse(self, namespace: str) -> PrefixLayout:
        layout = self.layout(namespace)
        if layout is None:
            raise FingerprintMismatchError(f"namespace {namespace!r} stores no prefix blocks")
        return layout

    # ---- what an implementation provides (arguments checked) ---------------------------------------

    @abstractmethod
    def _set_layout(self, namespace: str, layout: PrefixLayout) -> PrefixLayout:
        """``set_layout`` with a checked layout (refuse another one inside the write)."""

    @abstractmethod
    def _layout(self, namespace: str) -> PrefixLayout | None:
        """``layout``; raises NamespaceNotFoundError."""

    @abstractmethod
    def _put(self, namespace: str, layout: PrefixLayout, blocks: list[PrefixBlock]) -> int:
        """``put`` with blocks checked against ``layout`` (check it is still the namespace's inside the write)."""

    @abstractmethod
    def _drop_writer(self, namespace: str, writer: str, dry_run: bool) -> int:
        """``drop_writer`` for a namespace with a layout (``records.writer_blocks`` names the blocks)."""

    @abstractmethod
    def _writer_of(self, namespace: str, chain_hash: bytes) -> tuple[bool, str | None]:
        """``writer_of`` with a checked hash, for a namespace with a layout (``records.recorded_writer``)."""

    @abstractmethod
    def _match(self, namespace: str, chain_hashes: list[bytes]) -> int:
        """``match`` with checked hashes (0 for a namespace without a layout)."""

    @abstractmethod
    def _read_parts(self, namespace: str, layout: PrefixLayout, chain_hashes: list[bytes], part: int
                     ) -> np.ndarray:
        """Part ``part`` (a layer, or ``layout.layers`` for the hidden states) of every block, concatenated
        along the tokens."""
