"""The map store interface, implemented by MapStore (LMDB) and MemoryMapStore (tests)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Self

from attnstore.protocol.records import EntryInfo, NamespaceInfo, NamespaceLayout, NewEntry
from attnstore.store.reports import CompactReport, StoreStats, VerifyReport

if TYPE_CHECKING:
    import numpy as np
    import torch


class MapStoreBase(ABC):
    """Attention maps of many inputs per namespace, with exact-tier outputs and feature vectors.

    Safe for concurrent readers on many threads; writes are serialised.
    Tensors returned by reads belong to the caller (never shared with the store).
    """

    @abstractmethod
    def create_namespace(self, name: str, *, model: str, fingerprint: str, layout: NamespaceLayout) -> NamespaceInfo:
        """Create a namespace, or return it if it exists with the same model, fingerprint and layout.

        Raises:
            ConfigError: invalid name or layout.
            NamespaceExistsError: it exists with a different model, fingerprint or layout.
        """

    @abstractmethod
    def get_namespace(self, name: str) -> NamespaceInfo:
        """The namespace called ``name``, with its projector blob.

        Raises:
            NamespaceNotFoundError: no such namespace.
            FormatVersionError: it was written in an unknown format version.
        """

    @abstractmethod
    def list_namespaces(self) -> list[NamespaceInfo]:
        """Every namespace, sorted by name."""

    @abstractmethod
    def drop_namespace(self, name: str) -> None:
        """Remove a namespace and all its entries in one transaction.

        Raises:
            NamespaceNotFoundError: no such namespace.
        """

    @abstractmethod
    def set_projector(self, name: str, blob: bytes) -> None:
        """Store the namespace's projector weights (safetensors bytes).

        Raises:
            NamespaceNotFoundError: no such namespace.
        """

    @abstractmethod
    def ingest(self, namespace: str, entries: Iterable[NewEntry]) -> list[int]:
        """Add entries; returns their ids in input order. All-or-nothing per call.

        An entry whose token hash is already stored is not stored again: the
        existing id is returned.

        Raises:
            NamespaceNotFoundError: no such namespace.
            MapShapeError: an entry does not fit the namespace (nothing is written).
            StoreFullError: the store is full (nothing is written).
        """

    @abstractmethod
    def read_maps(self, namespace: str, entry_id: int) -> torch.Tensor:
        """One entry's maps ``(layers, heads, L, L)`` fp16, in one contiguous buffer.

        Raises:
            EntryNotFoundError: no live entry has that id.
            ChecksumError: stored bytes are corrupt.
        """

    @abstractmethod
    def read_layer(self, namespace: str, entry_id: int, layer: int) -> torch.Tensor:
        """One layer of one entry's maps ``(heads, L, L)`` fp16.

        Raises:
            EntryNotFoundError: no live entry has that id.
            ChecksumError: stored bytes are corrupt.
            MapShapeError: ``layer`` is out of range.
        """

    @abstractmethod
    def read_outputs(self, namespace: str, entry_id: int) -> torch.Tensor | None:
        """One entry's final outputs ``(L, hidden)`` fp16, or None if it was stored without.

        Raises:
            EntryNotFoundError: no live entry has that id.
            ChecksumError: stored bytes are corrupt.
        """

    @abstractmethod
    def find_by_hash(self, namespace: str, token_hash: bytes) -> int | None:
        """Id of the live entry with this token hash (exact tier), or None."""

    @abstractmethod
    def entry(self, namespace: str, entry_id: int) -> EntryInfo:
        """Metadata of one live entry (hits include those not yet flushed).

        Raises:
            EntryNotFoundError: no live entry has that id.
        """

    @abstractmethod
    def token_ids(self, namespace: str, entry_ids: Sequence[int]) -> list[np.ndarray | None]:
        """Each entry's stored ``(L,)`` uint32 token ids, in order; None for an entry stored
        without them, or no longer live (one read for the lot: the fidelity gate's hot path).
        """

    @abstractmethod
    def entries(self, namespace: str, length: int | None = None) -> Iterator[EntryInfo]:
        """Live entries in id order, optionally only those of token length ``length``."""

    @abstractmethod
    def lengths(self, namespace: str) -> list[int]:
        """Token lengths with at least one live entry, ascending."""

    @abstractmethod
    def record_hits(self, namespace: str, ids: Iterable[int]) -> None:
        """Count one hit for each id (unknown ids are ignored)."""

    @abstractmethod
    def delete(self, namespace: str, ids: Iterable[int]) -> int:
        """Delete entries; returns how many existed. Ids are never reused."""

    @abstractmethod
    def prefetch(self, namespace: str, ids: Iterable[int]) -> None:
        """Load entries into the DRAM tier in the background."""

    @abstractmethod
    def wait_prefetch(self, timeout: float | None = None) -> bool:
        """Block until queued prefetches are done; False on timeout."""

    def dead_threads(self) -> list[str]:
        """Names of background threads that have died (the store then needs a restart); none by default."""
        return []

    @abstractmethod
    def compact(self) -> CompactReport:
        """Rewrite live entries densely and drop deleted space; ids are kept."""

    @abstractmethod
    def verify(self) -> VerifyReport:
        """Check every entry's chunks against their checksums; list the corrupt ones."""

    @abstractmethod
    def stats(self) -> StoreStats:
        """Entries and bytes per namespace and length bucket, codec ratios, DRAM tier usage."""

    @abstractmethod
    def close(self) -> None:
        """Flush buffered hits, stop prefetching, release the store. Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
