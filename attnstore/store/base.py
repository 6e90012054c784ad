"""The map store interface, implemented by MapStore (LMDB) and MemoryMapStore (tests).

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
    FingerprintMismatchError,
    MapShapeError,
)
from attnstore.protocol.prefix import CHAIN_HASH_BYTES, PrefixBlock, PrefixLayout, check_block
from attnstore.protocol.projector_blob import projector_metadata
from attnstore.protocol.records import (
    TOKEN_HASH_BYTES,
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
    RedisStats,
    StoreStats,
    VerifyReport,
)

if TYPE_CHECKING:
    from attnstore.store.admission import AdmissionCounts, SketchShape
    from attnstore.store.feed import ChangeFeed


def _checked_hashes(method: str, chain_hashes: Sequence[bytes]) -> list[bytes]:
    checked = []
    for position, value in enumerate(chain_hashes):
        if not isinstance(value, bytes | bytearray | memoryview) or len(value) != CHAIN_HASH_BYTES:
            raise MapShapeError(f"{method}(): chain hash {position} must be {CHAIN_HASH_BYTES} bytes, got {value!r:.9}")
        checked.append(bytes(value))
    return checked


class MapStoreBase(ABC):
    """Attention maps of many inputs per namespace, with exact-tier outputs and feature vectors.

    Safe for concurrent readers on many threads; writes are serialised.
    Arrays returned by reads belong to the caller (never shared with the store).
    """

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

    @abstractmethod
    def prefetch(self, namespace: str, ids: Iterable[int]) -> PrefetchReport:
        """Load entries into the DRAM tier in the background; ids no live entry has are skipped and counted."""

    def maps_served(self, namespace: str, ids: Iterable[int]) -> None:
        """Entries whose maps were just sent to a client, for a DRAM tier's admission; stores without one ignore it."""
        return None  # not abstract: only a store with a DRAM tier has something to do

    @abstractmethod
    def wait_prefetch(self, timeout: float | None = None) -> bool:
        """Block until queued prefetches are done; False on timeout."""

    def change_feed(self) -> ChangeFeed | None:
        """The store's log of index changes when other processes share it (see ``feed``); None by default.

        A store with a feed may change behind this process's back: its users follow
        the feed to keep their indexes current and check entries still exist before serving them.
        """
        return None

    def admission_counts(self, shape: SketchShape) -> AdmissionCounts | None:
        """Admission counts kept in the store, which every process sharing it reads (see ``admission``);
        None for a store no other process writes (the counts then live in the process)."""
        return None

    def redis_stats(self) -> RedisStats | None:
        """A Redis-backed store's client figures (failures waited out, each primary's memory); None otherwise."""
        return None

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

    # ---- prefix blocks (causal namespaces; see attnstore.protocol.prefix) -----------------

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
        raise ConfigError(f"{type(self).__name__} stores no prefix blocks (set_prefix_layout({namespace!r}))")

    def _prefix_layout(self, namespace: str) -> PrefixLayout | None:
        self.get_namespace(namespace)
        return None  # a backend without prefix blocks: every namespace has none

    def _put_prefix_blocks(self, namespace: str, layout: PrefixLayout, blocks: list[PrefixBlock]) -> int:
        raise ConfigError(f"{type(self).__name__} stores no prefix blocks (put_prefix_blocks({namespace!r}))")

    def _match_prefix(self, namespace: str, chain_hashes: list[bytes]) -> int:
        return 0

    def _read_prefix_chunks(self, namespace: str, layout: PrefixLayout, chain_hashes: list[bytes], chunk: int
                            ) -> np.ndarray:
        """Chunk ``chunk`` (a layer, or ``layout.layers`` for the hidden states) of every block, concatenated
        along the tokens."""
        raise EntryNotFoundError(f"{type(self).__name__} stores no prefix blocks")

    @abstractmethod
    def compact(self) -> CompactReport:
        """Rewrite live entries densely and drop deleted space; ids are kept."""

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
