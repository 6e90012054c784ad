"""Prefix blocks of MemoryMapStore (``store.prefixes``): the same behaviour as the LMDB backend's, in dicts."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import crc32c
import numpy as np

from attnstore.errors import MapShapeError
from attnstore.protocol.prefix import PrefixBlock, PrefixLayout
from attnstore.protocol.records import NamespaceInfo
from attnstore.store.namespace_rules import check_same_layout
from attnstore.store.prefix.interface import PrefixBlocks
from attnstore.store.prefix.records import BlockRecord, block_parts, gather_parts, new_record, writer_blocks


@dataclass
class _Blocks:
    layout: PrefixLayout
    records: dict[bytes, BlockRecord] = field(default_factory=dict)
    parts: dict[bytes, list[bytes]] = field(default_factory=dict)


class MemoryPrefixBlocks(PrefixBlocks):
    """Prefix blocks of the in-memory store (its ``store.prefixes``), per namespace in a dict."""

    def __init__(self, lock: threading.RLock, namespace: Callable[[str], NamespaceInfo]) -> None:
        """
        Args:
            lock: the store's lock (a write of blocks is atomic with the store's own writes).
            namespace: the store's ``get_namespace`` (raises NamespaceNotFoundError).
        """
        self._lock = lock
        self._namespace = namespace
        self._prefix: dict[str, _Blocks] = {}  # namespace -> its prefix blocks

    def forget(self, namespace: str) -> None:
        """Drop a dropped namespace's blocks."""
        self._prefix.pop(namespace, None)

    def _prefix_of(self, namespace: str) -> _Blocks | None:
        self._namespace(namespace)
        return self._prefix.get(namespace)

    def _set_layout(self, namespace: str, layout: PrefixLayout) -> PrefixLayout:
        with self._lock:
            blocks = self._prefix_of(namespace)
            if blocks is None:
                self._prefix[namespace] = _Blocks(layout)
                return layout
            check_same_layout(namespace, "prefix blocks", blocks.layout, layout)
            return layout

    def _layout(self, namespace: str) -> PrefixLayout | None:
        blocks = self._prefix_of(namespace)
        return None if blocks is None else blocks.layout

    def _put(self, namespace: str, layout: PrefixLayout, new: list[PrefixBlock]) -> int:
        with self._lock:
            blocks = self._prefix_of(namespace)
            assert blocks is not None  # the base checked the layout
            staged: dict[bytes, tuple[BlockRecord, list[bytes]]] = {}
            for position, block in enumerate(new):
                if block.chain_hash in blocks.records or block.chain_hash in staged:
                    continue
                if block.parent is not None and block.parent not in blocks.records and block.parent not in staged:
                    raise MapShapeError(f"prefix block {position}: its parent {block.parent.hex()} is not stored")
                parts = block_parts(block)
                staged[block.chain_hash] = (new_record(block, parts), parts)
            for chain_hash, (record, parts) in staged.items():
                blocks.records[chain_hash] = record
                blocks.parts[chain_hash] = parts
            return len(staged)

    def _drop_writer(self, namespace: str, writer: str, dry_run: bool) -> int:
        with self._lock:
            blocks = self._prefix_of(namespace)
            assert blocks is not None  # the base checked the layout
            doomed = writer_blocks(blocks.records.items(), writer)
            if not dry_run:
                for chain_hash in doomed:
                    del blocks.records[chain_hash]
                    del blocks.parts[chain_hash]
            return len(doomed)

    def _writer_of(self, namespace: str, chain_hash: bytes) -> tuple[bool, str | None]:
        blocks = self._prefix_of(namespace)
        record = None if blocks is None else blocks.records.get(chain_hash)
        return record is not None, None if record is None else record.writer

    def _match(self, namespace: str, chain_hashes: list[bytes]) -> int:
        blocks = self._prefix_of(namespace)
        if blocks is None:
            return 0
        count = 0
        for chain_hash in chain_hashes:
            if chain_hash not in blocks.records:
                break
            count += 1
        return count

    def _read_parts(self, namespace: str, layout: PrefixLayout, chain_hashes: list[bytes], part: int
                     ) -> np.ndarray:
        blocks = self._prefix_of(namespace)
        assert blocks is not None

        def read(chain_hash: bytes) -> tuple[BlockRecord, bytes] | None:
            record = blocks.records.get(chain_hash)
            return None if record is None else (record, blocks.parts[chain_hash][part])

        return gather_parts(namespace, layout, chain_hashes, part, read)

    def usage(self) -> tuple[int, int]:
        """Blocks and their bytes over every namespace."""
        prefix = self._prefix
        count = sum(len(b.records) for b in prefix.values())
        nbytes = sum(len(c) for b in prefix.values() for parts in b.parts.values() for c in parts)
        return count, nbytes

    def problems(self) -> tuple[int, list[str]]:
        """Blocks checked, and a line naming each corrupt one."""
        problems = []
        checked = 0
        for name, blocks in sorted(self._prefix.items()):
            for chain_hash, record in blocks.records.items():
                checked += 1
                for part, raw in enumerate(blocks.parts[chain_hash]):
                    if crc32c.crc32c(raw) != record.crcs[part]:
                        problems.append(f"prefix block {chain_hash.hex()} of namespace {name!r}: part {part}"
                                        " fails its crc32c")
                        break
        return checked, problems
