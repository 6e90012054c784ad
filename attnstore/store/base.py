"""The map store interface: a narrow core every backend implements, and optional abilities declared as capabilities.

The core (namespaces; entries ingested, found by id and by token hash, their maps,
outputs and metadata; hits; delete; stats; verify; close) is abstract; where a
batched form exists (``find_by_hashes``, ``token_ids``) backends implement it and
the single form is a default over it. What only some backends can do is declared
as a ``supports_*`` property (as zarr's ``Store.supports_writes``) that callers
consult, never a backend's name or type: outputs-only entries, prefix blocks,
chunk entries, compaction, a change feed, shared admission counts. A method of
an ability a store lacks refuses with ConfigError naming the capability.

Implemented by MapStore (LMDB), RedisMapStore and MemoryMapStore (the in-memory
twin, with every capability the LMDB backend has). The DRAM tier, prefetch and
buffered hits in front of a backend are ``store.dram``'s.

Arguments every backend must refuse alike (names, layouts, fingerprints,
projector blobs, token hashes, entry ids) are checked here, before a backend's
``_`` method runs, so the backends cannot drift apart on what they accept.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Self

import numpy as np

from attnstore.errors import (
    ConfigError,
    EntryNotFoundError,
    MapShapeError,
)
from attnstore.protocol.keys import TOKEN_HASH_BYTES
from attnstore.protocol.projector_blob import projector_metadata
from attnstore.protocol.records import (
    EntryInfo,
    EntryRef,
    NamespaceInfo,
    NamespaceLayout,
    NewEntry,
    TokenLimits,
    check_entry_ids,
    check_namespace_name,
)
from attnstore.store.reports import (
    CompactReport,
    FeaturesReport,
    IngestReport,
    PrefetchReport,
    StoreStats,
    VerifyReport,
)

if TYPE_CHECKING:
    from attnstore.store.admission import AdmissionCounts, SketchShape
    from attnstore.store.chunks.interface import StoredChunks
    from attnstore.store.feed import ChangeFeed
    from attnstore.store.prefix.interface import PrefixBlocks


class MapStoreBase(ABC):
    """Attention maps of many inputs per namespace, with exact-tier outputs and feature vectors.

    Safe for concurrent readers on many threads; writes are serialised.
    Arrays returned by reads belong to the caller (never shared with the store).
    """

    # ---- optional parts: None where the backend lacks them ------------------------------------------

    prefixes: PrefixBlocks | None = None
    """The store's prefix blocks (causal namespaces; see ``store.prefix``), or None where it keeps none."""

    chunks: StoredChunks | None = None
    """The store's chunk entries (see ``store.chunks``), or None where it keeps none."""

    def require_prefixes(self, call: str) -> PrefixBlocks:
        """``prefixes``, for ``call`` that needs them.

        Raises:
            ConfigError: the store keeps no prefix blocks.
        """
        if self.prefixes is None:
            raise self._lacks(call, "prefix blocks (store.prefixes is None)")
        return self.prefixes

    def require_chunks(self, call: str) -> StoredChunks:
        """``chunks``, for ``call`` that needs them.

        Raises:
            ConfigError: the store keeps no chunk entries.
        """
        if self.chunks is None:
            raise self._lacks(call, "chunk entries (store.chunks is None)")
        return self.chunks

    def _lacks(self, call: str, capability: str) -> ConfigError:
        """The error of a call that needs ``capability``, which this store lacks."""
        return ConfigError(f"{type(self).__name__}.{call}: this store lacks {capability}")

    # ---- capabilities: what a caller may ask beyond the core ----------------------------------------

    @property
    def supports_writes(self) -> bool:
        """Whether the store takes writes (False: opened read-only; writes raise ReadOnlyStoreError)."""
        return True

    @property
    def supports_outputs_only(self) -> bool:
        """Whether ``ingest`` keeps entries without maps (``NewEntry(maps=None)``: written back for the exact tier)."""
        return False

    @property
    def supports_compaction(self) -> bool:
        """Whether :meth:`compact` rewrites the live entries (and drops what deletes and crashes left)."""
        return False

    @property
    def supports_change_feed(self) -> bool:
        """Whether other processes share the store, so that it offers :meth:`change_feed` to follow them."""
        return False

    @property
    def supports_shared_admission(self) -> bool:
        """Whether the store keeps admission counts every process sharing it reads (:meth:`admission_counts`)."""
        return False


    def create_namespace(
        self, name: str, *, model: str, fingerprint: str, layout: NamespaceLayout, limits: TokenLimits | None = None
    ) -> NamespaceInfo:
        """Create a namespace, or return it if it exists with the same model, fingerprint and layout.

        ``limits`` (the model's vocabulary size and maximum length, what written-back rows are
        checked against) are recorded with a new namespace, and with an existing one that has
        none yet (one created before they were recorded); an existing namespace keeps its own.

        Raises:
            ConfigError: invalid name, layout or limits, or an empty fingerprint.
            NamespaceExistsError: it exists with a different model, fingerprint or layout.
        """
        check_namespace_name(name)
        if not isinstance(layout, NamespaceLayout):
            raise ConfigError(f"create_namespace(): layout must be a NamespaceLayout, got {type(layout).__name__}")
        if limits is not None and not isinstance(limits, TokenLimits):
            raise ConfigError(f"create_namespace(): limits must be TokenLimits, got {type(limits).__name__}")
        if not isinstance(model, str) or not isinstance(fingerprint, str) or not fingerprint:
            raise ConfigError(
                "create_namespace(): model and fingerprint must be strings (fingerprint non-empty),"
                f" got {model!r}, {fingerprint!r}"
            )
        return self._create_namespace(name, model=model, fingerprint=fingerprint, layout=layout, limits=limits)

    @abstractmethod
    def _create_namespace(
        self, name: str, *, model: str, fingerprint: str, layout: NamespaceLayout, limits: TokenLimits | None
    ) -> NamespaceInfo:
        """``create_namespace`` with checked arguments (see :func:`matching_namespace`)."""

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

    def set_projector(self, name: str, blob: bytes, *, replace: bool = False) -> NamespaceInfo:
        """Store the namespace's projector weights (safetensors bytes); returns the namespace as it is now.

        A namespace without a projector takes ``blob`` as version 1 (its stored feature vectors
        stay: a build ingests them before it stores the projector that made them). Its own
        projector again changes nothing. One with the same weights and other metadata (a new
        gate) is stored as the next version. One with other weights is refused unless
        ``replace``: then, in one write, the version goes up by one and every stored feature
        vector is dropped, so no search ever compares vectors of two projectors. The entries
        stay (exact hits go on) and come back to the map tier as they are ingested again with
        features of the new projector. The blob's crc32c is recorded and checked whenever it is
        loaded.

        Raises:
            ConfigError: ``blob`` is not bytes.
            WireFormatError: ``blob`` is not safetensors (nothing is stored).
            NamespaceNotFoundError: no such namespace.
            NamespaceExistsError: the namespace has another projector and ``replace`` is False.
        """
        if not isinstance(blob, bytes | bytearray | memoryview):
            raise ConfigError(f"set_projector(): the blob must be bytes (safetensors), got {type(blob).__name__}")
        projector_metadata(blob)
        return self._set_projector(name, bytes(blob), replace=replace)

    @abstractmethod
    def _set_projector(self, name: str, blob: bytes, *, replace: bool) -> NamespaceInfo:
        """``set_projector`` with a checked blob (decide with :func:`projector_update` inside the write)."""

    @abstractmethod
    def ingest(
        self, namespace: str, entries: Iterable[NewEntry], *, projector_version: int | None = None
    ) -> IngestReport:
        """Add entries, all-or-nothing per call; the report has their ids in input order.

        An entry whose token hash is already stored is not stored again: the
        existing id is returned, and the id is not in ``IngestReport.added``;
        if the stored entry has no feature vector (its projector was replaced)
        it takes this entry's (``IngestReport.featured``). A byte cap may evict
        least recently hit entries to make room; the report lists them
        (``IngestReport.evicted``).

        Args:
            namespace: namespace name.
            entries: the entries.
            projector_version: the projector version the features were made with; checked
                inside the write (see :func:`check_projector_version`). None skips the check.

        Raises:
            NamespaceNotFoundError: no such namespace.
            MapShapeError: an entry does not fit the namespace (nothing is written).
            ProjectorChangedError: ``projector_version`` is not the namespace's (nothing is written).
            StoreFullError: the store or its disk is full (nothing is written).
        """

    def set_features(
        self, namespace: str, entry_ids: Sequence[int], features: np.ndarray, *, projector_version: int
    ) -> FeaturesReport:
        """Give stored entries feature vectors of the namespace's projector, all-or-nothing per call.

        What ``admin train-projector`` calls after it installs a projector: every entry with maps
        gets its vector of that projector, replacing any it had (of the same projector, as
        ``projector_version`` is checked inside the write), so no search compares vectors of two
        projectors. Ids no live entry has (deleted or evicted since they were listed) are skipped
        and reported.

        Args:
            namespace: namespace name.
            entry_ids: the entries, each at most once.
            features: ``(len(entry_ids), feature_dim)`` finite floats, one row per id.
            projector_version: the version of the projector the vectors come from; must be stated (>= 1).

        Raises:
            ConfigError: an id that is not a valid entry id, an id given twice, or no version stated.
            MapShapeError: ``features`` of the wrong shape or not finite, or an entry that stores no
                maps (outputs only: a vector would send lookups to maps it cannot serve); nothing is written.
            NamespaceNotFoundError: no such namespace.
            ProjectorChangedError: ``projector_version`` is not the namespace's (nothing is written).
        """
        ids = check_entry_ids(entry_ids)
        repeated = sorted(i for i, n in Counter(ids).items() if n > 1)
        if repeated:
            raise ConfigError(f"set_features(): entry ids {repeated[:8]} are given more than once")
        if isinstance(projector_version, bool) or not isinstance(projector_version, int) or projector_version < 1:
            raise ConfigError(
                f"set_features(): the projector version the vectors come from must be stated (>= 1),"
                f" got {projector_version!r}"
            )
        dim = self.get_namespace(namespace).layout.feature_dim
        array = np.asarray(features)
        if array.shape != (len(ids), dim) or array.dtype.kind != "f":
            raise MapShapeError(
                f"set_features(): features have shape {tuple(array.shape)} dtype {array.dtype}; namespace"
                f" {namespace!r} needs float ({len(ids)}, {dim}): one row of feature_dim {dim} per entry id"
            )
        checked = np.ascontiguousarray(array, dtype=np.float32)
        if not np.isfinite(checked).all():
            raise MapShapeError("set_features(): features hold NaN or inf")
        return self._set_features(namespace, ids, checked, projector_version)

    @abstractmethod
    def _set_features(
        self, namespace: str, entry_ids: list[int], features: np.ndarray, projector_version: int
    ) -> FeaturesReport:
        """``set_features`` with checked arguments: ``features`` ``(n, feature_dim)`` float32 (check the
        version and that each entry has maps inside the write)."""

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

    def prefetch(self, namespace: str, ids: Iterable[int]) -> PrefetchReport:
        """Load entries into the DRAM tier in the background (``store.dram``); ids no live entry has are skipped
        and counted. A store without a DRAM tier queues nothing.

        Raises:
            NamespaceNotFoundError: no such namespace.
        """
        self.get_namespace(namespace)
        unknown = 0
        for entry_id in dict.fromkeys(int(i) for i in ids):
            try:
                self.entry(namespace, entry_id)
            except EntryNotFoundError:
                unknown += 1
        return PrefetchReport(queued=0, unknown=unknown)

    def maps_served(self, namespace: str, ids: Iterable[int]) -> None:
        """Entries whose maps were just sent to a client, for a DRAM tier's admission; stores without one ignore it."""
        return None  # not abstract: only a store with a DRAM tier has something to do

    def wait_prefetch(self, timeout: float | None = None) -> bool:
        """Block until queued prefetches are done; False on timeout (always done without a DRAM tier)."""
        return True

    def change_feed(self) -> ChangeFeed:
        """The store's log of index changes (see ``feed``), when :attr:`supports_change_feed`.

        A store with a feed may change behind this process's back: its users follow
        the feed to keep their indexes current and check entries still exist before serving them.

        Raises:
            ConfigError: the store has no change feed.
        """
        raise self._lacks("change_feed()", "a change feed (supports_change_feed)")

    def admission_counts(self, shape: SketchShape) -> AdmissionCounts:
        """Admission counts kept in the store, which every process sharing it reads (see ``admission``), when
        :attr:`supports_shared_admission` (elsewhere the counts live in the process).

        Raises:
            ConfigError: the store keeps no shared counts.
        """
        raise self._lacks("admission_counts()", "shared admission counts (supports_shared_admission)")

    def dead_threads(self) -> list[str]:
        """Names of background threads that have died (the store then needs a restart); none by default."""
        return []

    def background_errors(self) -> dict[str, int]:
        """Unexpected errors each background thread caught and survived, by thread name; none by default."""
        return {}

    def serving_problem(self) -> str | None:
        """Why the store takes no writes now, while it lasts (a shared store lost its data, or its server
        evicts more than entries), or None; unlike a storage fault it passes without a restart."""
        return None

    def storage_fault(self) -> str | None:
        """Why the store's storage can no longer be trusted (its directory was removed, its database is
        damaged), or None while it is sound; a store with a fault needs a restart on sound storage."""
        return None

    def compact(self) -> CompactReport:
        """Rewrite live entries densely and drop deleted space; ids are kept (when :attr:`supports_compaction`).

        Raises:
            ConfigError: the store cannot compact.
        """
        raise self._lacks("compact()", "compaction (supports_compaction)")

    @abstractmethod
    def verify(self) -> VerifyReport:
        """Check every entry's chunks against their checksums and every projector against its own; list
        the corrupt entries, and damage not tied to one entry (``VerifyReport.problems``). Never raises
        for damage it finds."""

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
