"""DramCache: a map store that serves reads of maps from DRAM in front of another store (its inner one).

A wrapper store (as zarr's ``WrapperStore``): it is a ``MapStoreBase`` itself, holds
the inner store, keeps decoded hot maps in a byte-bounded DRAM cache with a
read-ahead thread (``HotMaps``), and passes every other call through. It learns
of entries that leave the inner store (deleted, evicted, dropped, or removed by
another process sharing it) through the inner store's ``on_removed``, so it never
serves maps the store no longer has. ``open_store`` puts one in front of a
backend when its DRAM settings ask for one (``dram_bytes`` > 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from attnstore.errors import ConfigError
from attnstore.protocol.records import EntryInfo, EntryRef, NamespaceInfo, NamespaceLayout, NewEntry, TokenLimits
from attnstore.store.base import MapStoreBase
from attnstore.store.dram.hot_maps import HotMaps
from attnstore.store.dram.settings import DEFAULT_PREFETCH_QUEUE
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
    from attnstore.store.feed import ChangeFeed

_PREFETCH_THREAD = "attnstore-prefetch"


class DramCache(MapStoreBase):
    """Decoded maps of ``inner``'s hot entries held in DRAM, with prefetch and served-maps admission.

    Args:
        inner: the store it caches (closed with it).
        dram_bytes: DRAM capacity for decoded maps (> 0).
        prefetch_queue: entries waiting for prefetch at most; more are dropped.

    Raises:
        ConfigError: ``dram_bytes`` or ``prefetch_queue`` below 1.
    """

    def __init__(self, inner: MapStoreBase, *, dram_bytes: int, prefetch_queue: int = DEFAULT_PREFETCH_QUEUE
                 ) -> None:
        if dram_bytes < 1 or prefetch_queue < 1:
            raise ConfigError(
                f"DramCache(): dram_bytes and prefetch_queue must be >= 1, got {dram_bytes} and {prefetch_queue}"
            )
        super().__init__()
        self._inner = inner
        self._hot = HotMaps(inner.read_maps, capacity_bytes=dram_bytes, prefetch_queue=prefetch_queue)
        self.prefixes = inner.prefixes
        self.chunks = inner.chunks
        inner.on_removed(self._on_inner_removed)

    @property
    def inner(self) -> MapStoreBase:
        """The store this one caches."""
        return self._inner

    def _on_inner_removed(self, namespace: str | None, ids: Sequence[int] | None) -> None:
        if namespace is None or ids is None:
            self._hot.clear()  # a namespace or everything: rare, so all of DRAM goes
        else:
            self._hot.discard(namespace, ids)
        self._removed(namespace, ids)

    # ---- capabilities: the inner store's --------------------------------------------------------------

    @property
    def supports_writes(self) -> bool:
        """See :attr:`MapStoreBase.supports_writes`: the inner store's."""
        return self._inner.supports_writes

    @property
    def supports_outputs_only(self) -> bool:
        """See :attr:`MapStoreBase.supports_outputs_only`: the inner store's."""
        return self._inner.supports_outputs_only

    @property
    def supports_compaction(self) -> bool:
        """See :attr:`MapStoreBase.supports_compaction`: the inner store's."""
        return self._inner.supports_compaction

    @property
    def supports_change_feed(self) -> bool:
        """See :attr:`MapStoreBase.supports_change_feed`: the inner store's."""
        return self._inner.supports_change_feed

    @property
    def supports_shared_admission(self) -> bool:
        """See :attr:`MapStoreBase.supports_shared_admission`: the inner store's."""
        return self._inner.supports_shared_admission

    # ---- reads of maps: from DRAM -------------------------------------------------------------------

    def read_maps(self, namespace: str, entry_id: int) -> np.ndarray:
        """See :meth:`MapStoreBase.read_maps`: from DRAM, else read from the inner store and admitted."""
        return self._hot.maps(namespace, entry_id)  # (layers, heads, L, L)

    def _read_layer(self, namespace: str, entry_id: int, layer: int) -> np.ndarray:
        """See :meth:`MapStoreBase.read_layer`: from DRAM when the whole entry is there."""
        return self._hot.layer(namespace, entry_id, layer, lambda: self._inner.read_layer(namespace, entry_id, layer))

    def prefetch(self, namespace: str, ids: Iterable[int]) -> PrefetchReport:
        """See :meth:`MapStoreBase.prefetch`. Entries already in DRAM are skipped; ids are checked against the
        live entries first, in one read, so the worker queues only entries that exist and unknown ids cost a
        count, not a log line each."""
        self._inner.get_namespace(namespace)
        wanted = list(dict.fromkeys(int(i) for i in ids))
        known = self._inner.live_ids(namespace, wanted) if wanted else []
        return PrefetchReport(queued=self._hot.prefetch(namespace, known), unknown=len(wanted) - len(known))

    def maps_served(self, namespace: str, ids: Iterable[int]) -> None:
        """See :meth:`MapStoreBase.maps_served`: admitted to DRAM on a second serve (``hot_maps``)."""
        self._hot.served(namespace, ids)

    def wait_prefetch(self, timeout: float | None = None) -> bool:
        """See :meth:`MapStoreBase.wait_prefetch`."""
        return self._hot.wait_prefetch(timeout)

    def dead_threads(self) -> list[str]:
        """See :meth:`MapStoreBase.dead_threads`: the prefetch worker's and the inner store's."""
        return [*([] if self._hot.alive else [_PREFETCH_THREAD]), *self._inner.dead_threads()]

    def background_errors(self) -> dict[str, int]:
        """See :meth:`MapStoreBase.background_errors`: the prefetch worker's and the inner store's."""
        return {_PREFETCH_THREAD: self._hot.prefetch_errors, **self._inner.background_errors()}

    def stats(self) -> StoreStats:
        """See :meth:`MapStoreBase.stats`: the inner store's, with this cache's usage."""
        return dataclasses.replace(self._inner.stats(), dram=self._hot.stats())

    def close(self) -> None:
        """See :meth:`MapStoreBase.close`: stops prefetching, empties DRAM, closes the inner store."""
        self._hot.close()
        self._inner.close()

    # ---- everything else: the inner store's --------------------------------------------------------

    def _create_namespace(
        self, name: str, *, model: str, fingerprint: str, layout: NamespaceLayout, limits: TokenLimits | None
    ) -> NamespaceInfo:
        return self._inner.create_namespace(name, model=model, fingerprint=fingerprint, layout=layout, limits=limits)

    def get_namespace(self, name: str) -> NamespaceInfo:
        """See :meth:`MapStoreBase.get_namespace`."""
        return self._inner.get_namespace(name)

    def list_namespaces(self) -> list[NamespaceInfo]:
        """See :meth:`MapStoreBase.list_namespaces`."""
        return self._inner.list_namespaces()

    def drop_namespace(self, name: str) -> None:
        """See :meth:`MapStoreBase.drop_namespace`."""
        self._inner.drop_namespace(name)

    def _set_projector(self, name: str, blob: bytes, *, replace: bool) -> NamespaceInfo:
        return self._inner.set_projector(name, blob, replace=replace)

    def ingest(
        self, namespace: str, entries: Iterable[NewEntry], *, projector_version: int | None = None
    ) -> IngestReport:
        """See :meth:`MapStoreBase.ingest`."""
        return self._inner.ingest(namespace, entries, projector_version=projector_version)

    def _set_features(
        self, namespace: str, entry_ids: list[int], features: np.ndarray, projector_version: int
    ) -> FeaturesReport:
        return self._inner.set_features(namespace, entry_ids, features, projector_version=projector_version)

    def read_outputs(self, namespace: str, entry_id: int) -> np.ndarray | None:
        """See :meth:`MapStoreBase.read_outputs`."""
        return self._inner.read_outputs(namespace, entry_id)

    def _find_by_hashes(self, namespace: str, token_hashes: list[bytes]) -> list[EntryRef | None]:
        return self._inner.find_by_hashes(namespace, token_hashes)

    def entry(self, namespace: str, entry_id: int) -> EntryInfo:
        """See :meth:`MapStoreBase.entry`."""
        return self._inner.entry(namespace, entry_id)

    def live_ids(self, namespace: str, ids: Sequence[int]) -> list[int]:
        """See :meth:`MapStoreBase.live_ids`."""
        return self._inner.live_ids(namespace, ids)

    def token_ids(self, namespace: str, entry_ids: Sequence[int]) -> list[np.ndarray | None]:
        """See :meth:`MapStoreBase.token_ids`."""
        return self._inner.token_ids(namespace, entry_ids)

    def entries(self, namespace: str, length: int | None = None) -> Iterator[EntryInfo]:
        """See :meth:`MapStoreBase.entries`."""
        return self._inner.entries(namespace, length)

    def lengths(self, namespace: str) -> list[int]:
        """See :meth:`MapStoreBase.lengths`."""
        return self._inner.lengths(namespace)

    def record_hits(self, namespace: str, ids: Iterable[int]) -> None:
        """See :meth:`MapStoreBase.record_hits`."""
        self._inner.record_hits(namespace, ids)

    def _delete(self, namespace: str, ids: list[int]) -> int:
        return self._inner.delete(namespace, ids)

    def change_feed(self) -> ChangeFeed:
        """See :meth:`MapStoreBase.change_feed`."""
        return self._inner.change_feed()

    def admission_counts(self, shape: SketchShape) -> AdmissionCounts:
        """See :meth:`MapStoreBase.admission_counts`."""
        return self._inner.admission_counts(shape)

    def serving_problem(self) -> str | None:
        """See :meth:`MapStoreBase.serving_problem`."""
        return self._inner.serving_problem()

    def storage_fault(self) -> str | None:
        """See :meth:`MapStoreBase.storage_fault`."""
        return self._inner.storage_fault()

    def compact(self) -> CompactReport:
        """See :meth:`MapStoreBase.compact`."""
        return self._inner.compact()

    def verify(self) -> VerifyReport:
        """See :meth:`MapStoreBase.verify`."""
        return self._inner.verify()
