"""The map store interface: a narrow core every backend implements, optional parts, and capabilities.

The core (namespaces; entries ingested, found by id and by token hash, their maps,
outputs and metadata; hits; delete; stats) is abstract; where a batched form exists
(``find_by_hashes``, ``token_ids``) backends implement it and the single form is a
default over it, and what can be said over the core (one layer of maps, the lengths,
verify, close) is a default a backend may replace with a faster one. Two optional
parts are objects a backend offers or not: ``store.prefixes`` (prefix blocks) and
``store.chunks`` (chunk entries), None where it lacks them. Other optional
abilities are declared as ``supports_*`` properties (as zarr's
``Store.supports_writes``) that callers consult, never a backend's name or type:
outputs-only entries, compaction, a change feed, shared admission counts. A
method of an ability a store lacks refuses with ConfigError naming the capability.

Implemented by LmdbMapStore (LMDB), RedisMapStore and MemoryMapStore (the in-memory
twin, with every part and capability the LMDB backend has), and by DramCache
(``store.dram.cache``), a wrapper store that serves maps from DRAM in front of
another store.

Arguments every backend must refuse alike (names, layouts, fingerprints,
projector blobs, token hashes, entry ids, layer indexes) are checked here, before a backend's
``_`` method runs, so the backends cannot drift apart on what they accept.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Self

import numpy as np

from attnstore.errors import (
    ChecksumError,
    ConfigError,
    EntryNotFoundError,
    MapShapeError,
    MapsNotStoredError,
    NamespaceNotFoundError,
    shown,
)
from attnstore.projector.blob import projector_metadata
from attnstore.protocol.keys import TOKEN_HASH_BYTES
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
    CorruptEntry,
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

# Told of entries that left a store: (namespace, ids); ids None: all of the namespace's; namespace None: every entry.
RemovalListener = Callable[[str | None, Sequence[int] | None], None]


class MapStoreBase(ABC):
    """Attention maps of many inputs per namespace, with exact-tier outputs and feature vectors.

    Safe for concurrent readers on many threads; writes are serialised.
    Arrays returned by reads belong to the caller (never shared with the store).
    """

    def __init__(self) -> None:
        self._removal_listeners: list[RemovalListener] = []

    def on_removed(self, listener: RemovalListener) -> None:
        """Call ``listener(namespace, ids)`` whenever entries leave the store: deleted, evicted, their namespace
        dropped (``ids`` None), or removed by another process sharing the store; ``namespace`` None: every entry
        may have changed (the store was replaced under this process). What a cache in front of it forgets by."""
        self._removal_listeners.append(listener)

    def _removed(self, namespace: str | None, ids: Sequence[int] | None) -> None:
        """Tell the listeners (see :meth:`on_removed`); a backend calls it wherever entries leave."""
        for listener in self._removal_listeners:
            listener(namespace, ids)

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

    def get_namespace(self, name: str) -> NamespaceInfo:
        """The namespace called ``name``, with its projector blob (by default found in :meth:`list_namespaces`).

        Raises:
            NamespaceNotFoundError: no such namespace.
            FormatVersionError: it was written in an unknown format version.
        """
        namespaces = self.list_namespaces()
        for info in namespaces:
            if info.name == name:
                return info
        raise NamespaceNotFoundError(
            f"no namespace {shown(name)} in the map store; existing: {shown([i.name for i in namespaces], 512)}"
        )

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

    def read_layer(self, namespace: str, entry_id: int, layer: int) -> np.ndarray:
        """One layer of one entry's maps ``(heads, L, L)`` fp16.

        Raises:
            EntryNotFoundError: no live entry has that id.
            ChecksumError: stored bytes are corrupt.
            MapShapeError: ``layer`` is not an int (a bool is not one) in range of the namespace's layers.
        """
        layers = self.get_namespace(namespace).layout.layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layers:
            raise MapShapeError(f"layer {layer!r} is out of range: namespace {namespace!r} has {layers} layers")
        return self._read_layer(namespace, entry_id, layer)

    def _read_layer(self, namespace: str, entry_id: int, layer: int) -> np.ndarray:
        """``read_layer`` of a checked layer: by default out of :meth:`read_maps` (a backend reads the one layer
        instead)."""
        return np.ascontiguousarray(self.read_maps(namespace, entry_id)[layer])  # (heads, L, L)

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

    def live_ids(self, namespace: str, ids: Sequence[int]) -> list[int]:
        """Those of ``ids`` a live entry has, in order (by default one :meth:`entry` each; a backend reads them
        in one go).

        Raises:
            NamespaceNotFoundError: no such namespace.
        """
        self.get_namespace(namespace)
        live = []
        for entry_id in ids:
            try:
                self.entry(namespace, entry_id)
            except EntryNotFoundError:
                continue
            live.append(entry_id)
        return live

    @abstractmethod
    def token_ids(self, namespace: str, entry_ids: Sequence[int]) -> list[np.ndarray | None]:
        """Each entry's stored ``(L,)`` uint32 token ids, in order; None for an entry stored
        without them, or no longer live (one read for the lot: the fidelity gate's hot path).
        """

    @abstractmethod
    def entries(self, namespace: str, length: int | None = None) -> Iterator[EntryInfo]:
        """Live entries in id order, optionally only those of token length ``length``."""

    def lengths(self, namespace: str) -> list[int]:
        """Token lengths with at least one live entry, ascending (by default over :meth:`entries`)."""
        return sorted({info.length for info in self.entries(namespace)})

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
        """Load entries into a DRAM cache in the background (``DramCache``); ids no live entry has are skipped
        and counted. A store without a DRAM cache queues nothing.

        Raises:
            NamespaceNotFoundError: no such namespace.
        """
        wanted = list(dict.fromkeys(int(i) for i in ids))
        return PrefetchReport(queued=0, unknown=len(wanted) - len(self.live_ids(namespace, wanted)))

    def maps_served(self, namespace: str, ids: Iterable[int]) -> None:
        """Entries whose maps were just sent to a client, for a DRAM cache's admission; stores without one ignore it."""
        return None  # not abstract: only a DRAM cache has something to do

    def wait_prefetch(self, timeout: float | None = None) -> bool:
        """Block until queued prefetches are done; False on timeout (always done without a DRAM cache)."""
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

    def verify(self) -> VerifyReport:
        """Check every entry's stored objects against their checksums and every projector against its own; list
        the corrupt entries, and damage not tied to one entry (``VerifyReport.problems``). Never raises
        for damage it finds.

        By default every live entry's maps and outputs are read (each read checks its checksums); a backend
        walks its own storage instead, and checks what lies outside entries too.
        """
        start = time.perf_counter()
        corrupt, checked = [], 0
        for info in self.list_namespaces():
            for entry in self.entries(info.name):
                checked += 1
                try:
                    try:
                        self.read_maps(info.name, entry.id)
                    except MapsNotStoredError:
                        pass  # outputs only: nothing to check but the outputs
                    self.read_outputs(info.name, entry.id)
                except ChecksumError as exc:
                    corrupt.append(CorruptEntry(info.name, entry.id, str(exc)))
                except EntryNotFoundError:
                    checked -= 1  # deleted meanwhile
        return VerifyReport(checked, 0, tuple(corrupt), 0, time.perf_counter() - start)

    @abstractmethod
    def stats(self) -> StoreStats:
        """Entries and bytes per namespace and length bucket, codec ratios, DRAM cache usage."""

    def close(self) -> None:  # noqa: B027 -- a store with nothing to release keeps it
        """Flush buffered hits, stop prefetching, release the store. Idempotent (nothing to do by default)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
