"""The map store interface, implemented by MapStore (LMDB) and MemoryMapStore (tests).

Arguments every backend must refuse alike (names, layouts, fingerprints,
projector blobs, token hashes, entry ids) are checked here, before a backend's
``_`` method runs, so the backends cannot drift apart on what they accept.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Self

from attnstore.errors import ConfigError, MapShapeError
from attnstore.protocol.projector_blob import projector_metadata
from attnstore.protocol.records import (
    TOKEN_HASH_BYTES,
    EntryInfo,
    EntryRef,
    NamespaceInfo,
    NamespaceLayout,
    NewEntry,
    check_entry_ids,
    check_namespace_name,
)
from attnstore.store.reports import CompactReport, IngestReport, StoreStats, VerifyReport

if TYPE_CHECKING:
    import numpy as np


class MapStoreBase(ABC):
    """Attention maps of many inputs per namespace, with exact-tier outputs and feature vectors.

    Safe for concurrent readers on many threads; writes are serialised.
    Arrays returned by reads belong to the caller (never shared with the store).
    """

    def create_namespace(self, name: str, *, model: str, fingerprint: str, layout: NamespaceLayout) -> NamespaceInfo:
        """Create a namespace, or return it if it exists with the same model, fingerprint and layout.

        Raises:
            ConfigError: invalid name or layout, or an empty fingerprint.
            NamespaceExistsError: it exists with a different model, fingerprint or layout.
        """
        check_namespace_name(name)
        if not isinstance(layout, NamespaceLayout):
            raise ConfigError(f"create_namespace(): layout must be a NamespaceLayout, got {type(layout).__name__}")
        if not isinstance(model, str) or not isinstance(fingerprint, str) or not fingerprint:
            raise ConfigError(
                "create_namespace(): model and fingerprint must be strings (fingerprint non-empty),"
                f" got {model!r}, {fingerprint!r}"
            )
        return self._create_namespace(name, model=model, fingerprint=fingerprint, layout=layout)

    @abstractmethod
    def _create_namespace(self, name: str, *, model: str, fingerprint: str, layout: NamespaceLayout) -> NamespaceInfo:
        """``create_namespace`` with checked arguments."""

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

    def set_projector(self, name: str, blob: bytes) -> None:
        """Store the namespace's projector weights (safetensors bytes).

        Raises:
            ConfigError: ``blob`` is not bytes.
            WireFormatError: ``blob`` is not safetensors (nothing is stored).
            NamespaceNotFoundError: no such namespace.
        """
        if not isinstance(blob, bytes | bytearray | memoryview):
            raise ConfigError(f"set_projector(): the blob must be bytes (safetensors), got {type(blob).__name__}")
        projector_metadata(blob)
        self._set_projector(name, bytes(blob))

    @abstractmethod
    def _set_projector(self, name: str, blob: bytes) -> None:
        """``set_projector`` with a checked blob."""

    @abstractmethod
    def ingest(self, namespace: str, entries: Iterable[NewEntry]) -> IngestReport:
        """Add entries, all-or-nothing per call; the report has their ids in input order.

        An entry whose token hash is already stored is not stored again: the
        existing id is returned, and the id is not in ``IngestReport.added``.
        A byte cap may evict least recently hit entries to make room; the
        report lists them (``IngestReport.evicted``).

        Raises:
            NamespaceNotFoundError: no such namespace.
            MapShapeError: an entry does not fit the namespace (nothing is written).
            StoreFullError: the store is full (nothing is written).
        """

    @abstractmethod
    def read_maps(self, namespace: str, entry_id: int) -> np.ndarray:
        """One entry's maps ``(layers, heads, L, L)`` fp16, in one contiguous buffer.

        Raises:
            EntryNotFoundError: no live entry has that id.
            ChecksumError: stored bytes are corrupt.
        """

    @abstractmethod
    def read_layer(self, namespace: str, entry_id: int, layer: int) -> np.ndarray:
        """One layer of one entry's maps ``(heads, L, L)`` fp16.

        Raises:
            EntryNotFoundError: no live entry has that id.
            ChecksumError: stored bytes are corrupt.
            MapShapeError: ``layer`` is out of range.
        """

    @abstractmethod
    def read_outputs(self, namespace: str, entry_id: int) -> np.ndarray | None:
        """One entry's final outputs ``(L, hidden)`` fp16, or None if it was stored without.

        Raises:
            EntryNotFoundError: no live entry has that id.
            ChecksumError: stored bytes are corrupt.
        """

    def find_by_hash(self, namespace: str, token_hash: bytes) -> int | None:
        """Id of the live entry with this token hash (exact tier), or None.

        Raises:
            MapShapeError: ``token_hash`` is not a 32-byte hash.
            NamespaceNotFoundError: no such namespace.
        """
        (ref,) = self.find_by_hashes(namespace, [token_hash])
        return None if ref is None else ref.id

    def find_by_hashes(self, namespace: str, token_hashes: Sequence[bytes]) -> list[EntryRef | None]:
        """The live entry (id and length) of each token hash, or None; one read for the lot.

        Raises:
            MapShapeError: a hash that is not 32 bytes.
            NamespaceNotFoundError: no such namespace.
        """
        checked = []
        for position, token_hash in enumerate(token_hashes):
            if not isinstance(token_hash, bytes | bytearray | memoryview) or len(token_hash) != TOKEN_HASH_BYTES:
                raise MapShapeError(
                    f"find_by_hashes(): token hash {position} must be {TOKEN_HASH_BYTES} bytes, got {token_hash!r:.80}"
                )
            checked.append(bytes(token_hash))
        return self._find_by_hashes(namespace, checked)

    @abstractmethod
    def _find_by_hashes(self, namespace: str, token_hashes: list[bytes]) -> list[EntryRef | None]:
        """``find_by_hashes`` with checked hashes."""

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

    def delete(self, namespace: str, ids: Iterable[int]) -> int:
        """Delete entries; returns how many existed. Ids are never reused.

        Every id is checked before anything is deleted.

        Raises:
            ConfigError: an id that is not an int in [1, 2**63) (nothing is deleted).
            NamespaceNotFoundError: no such namespace.
        """
        return self._delete(namespace, check_entry_ids(ids))

    @abstractmethod
    def _delete(self, namespace: str, ids: list[int]) -> int:
        """``delete`` with checked ids."""

    @abstractmethod
    def prefetch(self, namespace: str, ids: Iterable[int]) -> None:
        """Load entries into the DRAM tier in the background."""

    def maps_served(self, namespace: str, ids: Iterable[int]) -> None:
        """Entries whose maps were just sent to a client, for a DRAM tier's admission; stores without one ignore it."""
        return None  # not abstract: only a store with a DRAM tier has something to do

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
