"""MemoryMapStore: the map store interface in memory, for tests of other components.

It has every capability the LMDB backend has (outputs-only entries, prefix
blocks, compaction), so a suite that consults capabilities runs whole on it.

Same behaviour as LmdbMapStore where callers can see it: validation, codecs (q8 is
lossy here too), exact-duplicate handling, ids from 1 never reused, checksums,
byte cap. No persistence, and no need of a DRAM cache (everything is in memory already).
Imports neither lmdb nor zarr.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import crc32c
import numpy as np

from attnstore.errors import (
    ChecksumError,
    EntryNotFoundError,
    MapsNotStoredError,
    NamespaceNotFoundError,
    shown,
)
from attnstore.protocol.keys import TokenHash
from attnstore.protocol.records import (
    FORMAT_VERSION,
    EntryInfo,
    EntryRef,
    NamespaceInfo,
    NamespaceLayout,
    NewEntry,
    TokenLimits,
)
from attnstore.store.arrays import NamespaceState
from attnstore.store.base import MapStoreBase
from attnstore.store.eviction import (
    DEFAULT_LOW_WATER,
    EntryCandidate,
    by_recency,
    check_cap,
    least_recent_first,
    plan_eviction,
)
from attnstore.store.memory.chunks import MemoryChunks
from attnstore.store.memory.prefix_blocks import MemoryPrefixBlocks
from attnstore.store.namespace_rules import (
    check_projector_version,
    drops_features,
    matching_namespace,
    outputs_only_feature_error,
    projector_update,
)
from attnstore.store.reports import (
    NO_DRAM,
    BucketStats,
    ChunkCheck,
    CompactReport,
    CorruptEntry,
    FeaturesReport,
    IngestReport,
    NamespaceStats,
    StoreStats,
    VerifyReport,
    with_chunk_usage,
)
from attnstore.store.validate import prepare_entry


@dataclass
class _Entry:
    id: int
    length: int
    created: float
    token_hash: TokenHash
    feature: np.ndarray | None
    token_ids: np.ndarray | None
    writer: str | None
    objects: list[tuple[bytes, ...]]  # per layer, one stored object per codec array (as ``zarr_layout``'s)
    crcs: list[tuple[int, ...]]
    outputs: bytes | None
    outputs_crc: int | None
    nbytes: int
    raw_bytes: int
    hits: int = 0
    last_hit: float = 0.0


@dataclass
class _Namespace:
    info: NamespaceInfo
    state: NamespaceState
    entries: dict[int, _Entry] = field(default_factory=dict)
    hashes: dict[bytes, int] = field(default_factory=dict)


class MemoryMapStore(MapStoreBase):
    """In-memory map store.

    Args:
        max_bytes: cap on the stored bytes of live entries and chunks; past it, the least recently
            used are evicted down to ``evict_low_water`` of the cap.
        evict_low_water: the fraction of the cap eviction goes down to, in (0, 1] (as the other backends').

    Raises:
        ConfigError: ``max_bytes`` below 1, or ``evict_low_water`` out of range.
    """

    def __init__(self, *, max_bytes: int | None = None, evict_low_water: float = DEFAULT_LOW_WATER) -> None:
        check_cap(max_bytes, evict_low_water)
        super().__init__()
        self._max_bytes = max_bytes
        self._low_water = evict_low_water
        self._namespaces: dict[str, _Namespace] = {}
        self._next_id = 1
        self._evicted_entries = 0
        self._evicted_bytes = 0
        self._lock = threading.RLock()
        self._prefixes = MemoryPrefixBlocks(self._lock, self.get_namespace)
        self._chunks = MemoryChunks(self._lock, max_bytes, evict_low_water, self.get_namespace, self._entry_bytes)
        self.prefixes = self._prefixes
        self.chunks = self._chunks

    # Capabilities: every one the LMDB backend has (and its parts: prefix blocks, chunks).
    supports_outputs_only = True
    supports_compaction = True  # nothing to rewrite: it reports the live entries

    def _ns(self, name: str) -> _Namespace:
        ns = self._namespaces.get(name)
        if ns is None:
            raise NamespaceNotFoundError(
                f"no namespace {shown(name)}; existing: {shown(sorted(self._namespaces), 512)}"
            )
        return ns

    def _get(self, namespace: str, entry_id: int) -> tuple[_Namespace, _Entry]:
        ns = self._ns(namespace)
        entry = ns.entries.get(entry_id)
        if entry is None:
            raise EntryNotFoundError(f"no entry {entry_id} in namespace {namespace!r}")
        return ns, entry

    def _create_namespace(
        self, name: str, *, model: str, fingerprint: str, layout: NamespaceLayout, limits: TokenLimits | None
    ) -> NamespaceInfo:
        """See :meth:`MapStoreBase.create_namespace`."""
        wanted = NamespaceInfo(name, model, fingerprint, layout, FORMAT_VERSION, time.time(), None, limits=limits)
        with self._lock:
            existing = self._namespaces.get(name)
            if existing is not None:
                existing.info = matching_namespace(existing.info, wanted)
                return existing.info
            self._namespaces[name] = _Namespace(wanted, NamespaceState.of(wanted))
            return wanted

    def get_namespace(self, name: str) -> NamespaceInfo:
        """See :meth:`MapStoreBase.get_namespace`."""
        return self._ns(name).info

    def list_namespaces(self) -> list[NamespaceInfo]:
        """See :meth:`MapStoreBase.list_namespaces`."""
        return [self._namespaces[n].info for n in sorted(self._namespaces)]

    def drop_namespace(self, name: str) -> None:
        """See :meth:`MapStoreBase.drop_namespace`."""
        with self._lock:
            self._ns(name)
            del self._namespaces[name]
            self._prefixes.forget(name)
            self._chunks.forget(name)
        self._removed(name, None)

    def _set_projector(self, name: str, blob: bytes, *, replace: bool) -> NamespaceInfo:
        """See :meth:`MapStoreBase.set_projector`."""
        with self._lock:
            ns = self._ns(name)
            update = projector_update(ns.info, blob, replace=replace)
            if update is None:
                return ns.info
            if drops_features(ns.info, blob):
                for entry in ns.entries.values():
                    entry.feature = None
            ns.info = update
            return update

    def ingest(
        self, namespace: str, entries: Iterable[NewEntry], *, projector_version: int | None = None
    ) -> IngestReport:
        """See :meth:`MapStoreBase.ingest`."""
        ns = self._ns(namespace)
        state = ns.state
        prepared = [prepare_entry(entry, state.layout, i) for i, entry in enumerate(entries)]
        now = time.time()
        ids: list[int] = []
        added: list[int] = []
        featured: list[int] = []
        with self._lock:
            check_projector_version(ns.info, projector_version)
            for p in prepared:
                existing = ns.hashes.get(p.token_hash)
                if existing is not None:
                    stored = ns.entries[existing]
                    # An outputs-only entry never takes a feature: it has no maps to replay.
                    if stored.feature is None and stored.objects and p.feature is not None and existing not in added:
                        stored.feature = p.feature
                        featured.append(existing)
                    ids.append(existing)
                    continue
                maps = p.maps
                objects = [] if maps is None else [  # an outputs-only entry has no maps
                    tuple(bytes(c) for c in state.codec.encode_layer(maps[layer]))
                    for layer in range(state.layout.layers)
                ]
                outputs = None if p.outputs is None else p.outputs.tobytes()
                nbytes = sum(len(c) for layer in objects for c in layer) + (len(outputs) if outputs else 0)
                raw = (state.layout.map_nbytes(p.length) if objects else 0) + (
                    state.layout.outputs_nbytes(p.length) if outputs else 0
                )
                entry = _Entry(
                    id=self._next_id,
                    length=p.length,
                    created=now,
                    token_hash=p.token_hash,
                    feature=p.feature,
                    token_ids=p.token_ids,
                    writer=p.writer,
                    objects=objects,
                    crcs=[tuple(crc32c.crc32c(c) for c in layer) for layer in objects],
                    outputs=outputs,
                    outputs_crc=None if outputs is None else crc32c.crc32c(outputs),
                    nbytes=nbytes,
                    raw_bytes=raw,
                )
                ns.entries[entry.id] = entry
                ns.hashes[p.token_hash] = entry.id
                added.append(entry.id)
                ids.append(entry.id)
                self._next_id += 1
            evicted = self._evict({(namespace, i) for i in added})
        for name, gone in evicted.items():
            self._removed(name, gone)
        return IngestReport(ids, added, evicted, featured)

    def _set_features(
        self, namespace: str, entry_ids: list[int], features: np.ndarray, projector_version: int
    ) -> FeaturesReport:
        """See :meth:`MapStoreBase.set_features`."""
        ns = self._ns(namespace)
        with self._lock:
            check_projector_version(ns.info, projector_version)
            live = [(i, row) for i, row in zip(entry_ids, features, strict=True) if i in ns.entries]
            for entry_id, _ in live:
                if not ns.entries[entry_id].objects:
                    raise outputs_only_feature_error(namespace, entry_id)
            for entry_id, row in live:
                ns.entries[entry_id].feature = row.copy()
            return FeaturesReport(
                updated=[entry_id for entry_id, _ in live],
                lengths=[ns.entries[entry_id].length for entry_id, _ in live],
                missing=[entry_id for entry_id in entry_ids if entry_id not in ns.entries],
            )

    def _entry_bytes(self) -> int:
        return sum(e.nbytes for ns in self._namespaces.values() for e in ns.entries.values())

    def _evict(self, protect: set[tuple[str, int]]) -> dict[str, list[int]]:
        """Evict the least recently used entries and chunks down to the low-water mark of the cap (see
        ``store.eviction``); the evicted entry ids by namespace."""
        evicted: dict[str, list[int]] = {}
        if self._max_bytes is None:
            return evicted
        used = self._entry_bytes() + self._chunks.total_bytes()
        if used <= self._max_bytes:
            return evicted
        entries = [
            EntryCandidate(max(e.last_hit, e.created), name, e.id, e.nbytes)
            for name, ns in self._namespaces.items()
            for e in ns.entries.values()
            if (name, e.id) not in protect
        ]
        candidates = least_recent_first(self._chunks.candidates(), by_recency(entries))
        for victim in plan_eviction(used, self._max_bytes, self._low_water, candidates).victims:
            name, ident = victim.namespace, victim.key
            if isinstance(ident, bytes):  # a chunk's key
                self._chunks.evict(name, ident)
                continue
            self._delete_one(self._namespaces[name], ident)
            self._evicted_entries += 1
            self._evicted_bytes += victim.nbytes
            evicted.setdefault(name, []).append(ident)
        return evicted

    def _decode(self, ns: _Namespace, entry: _Entry, layers: Iterable[int], out: np.ndarray) -> None:
        if not entry.objects:
            raise MapsNotStoredError(
                f"entry {entry.id} of namespace {ns.info.name!r} stores outputs only (written back for the exact"
                " tier): it has no maps to replay"
            )
        per_layer = []
        for layer in layers:
            stored = entry.objects[layer]
            if tuple(crc32c.crc32c(c) for c in stored) != entry.crcs[layer]:
                raise ChecksumError(
                    f"entry {entry.id} of namespace {ns.info.name!r}: layer {layer} fails its crc32c check"
                )
            per_layer.append(stored)
        ns.state.codec.decode_into(per_layer, out)

    def read_maps(self, namespace: str, entry_id: int) -> np.ndarray:
        """See :meth:`MapStoreBase.read_maps`."""
        ns, entry = self._get(namespace, entry_id)
        layout = ns.state.layout
        out = np.empty(layout.map_shape(entry.length), dtype=np.float16)  # (layers, heads, L, L)
        self._decode(ns, entry, range(layout.layers), out)
        return out

    def _read_layer(self, namespace: str, entry_id: int, layer: int) -> np.ndarray:
        """See :meth:`MapStoreBase.read_layer`: only that layer is decoded."""
        ns, entry = self._get(namespace, entry_id)
        layout = ns.state.layout
        out = np.empty((1, layout.heads, entry.length, entry.length), dtype=np.float16)
        self._decode(ns, entry, [layer], out)
        return out[0]  # (heads, L, L)

    def read_outputs(self, namespace: str, entry_id: int) -> np.ndarray | None:
        """See :meth:`MapStoreBase.read_outputs`."""
        ns, entry = self._get(namespace, entry_id)
        if entry.outputs is None:
            return None
        if crc32c.crc32c(entry.outputs) != entry.outputs_crc:
            raise ChecksumError(f"entry {entry_id} of namespace {namespace!r}: outputs fail their crc32c check")
        outputs = np.frombuffer(entry.outputs, dtype="<f2").reshape(entry.length, ns.state.layout.hidden)
        return outputs.astype(np.float16)  # (L, hidden), a copy

    def _find_by_hashes(self, namespace: str, token_hashes: list[bytes]) -> list[EntryRef | None]:
        """See :meth:`MapStoreBase.find_by_hashes`."""
        ns = self._ns(namespace)
        with self._lock:
            ids = [ns.hashes.get(token_hash) for token_hash in token_hashes]
            return [None if i is None else EntryRef(i, ns.entries[i].length) for i in ids]

    @staticmethod
    def _info(entry: _Entry) -> EntryInfo:
        return EntryInfo(
            id=entry.id,
            length=entry.length,
            token_hash=entry.token_hash,
            created=entry.created,
            hits=entry.hits,
            last_hit=entry.last_hit,
            feature=entry.feature,
            nbytes=entry.nbytes,
            token_ids=entry.token_ids,
            has_maps=bool(entry.objects),
            writer=entry.writer,
        )

    def entry(self, namespace: str, entry_id: int) -> EntryInfo:
        """See :meth:`MapStoreBase.entry`."""
        return self._info(self._get(namespace, entry_id)[1])

    def token_ids(self, namespace: str, entry_ids: Sequence[int]) -> list[np.ndarray | None]:
        """See :meth:`MapStoreBase.token_ids`."""
        ns = self._ns(namespace)
        with self._lock:
            return [None if (e := ns.entries.get(i)) is None else e.token_ids for i in entry_ids]

    def entries(self, namespace: str, length: int | None = None) -> Iterator[EntryInfo]:
        """See :meth:`MapStoreBase.entries`."""
        ns = self._ns(namespace)
        with self._lock:
            selected = [e for _, e in sorted(ns.entries.items()) if length is None or e.length == length]
        return iter([self._info(e) for e in selected])

    def lengths(self, namespace: str) -> list[int]:
        """See :meth:`MapStoreBase.lengths`."""
        return sorted({e.length for e in self._ns(namespace).entries.values()})

    def record_hits(self, namespace: str, ids: Iterable[int]) -> None:
        """See :meth:`MapStoreBase.record_hits`; counts are updated at once."""
        ns = self._ns(namespace)
        now = time.time()
        with self._lock:
            for entry_id in ids:
                entry = ns.entries.get(int(entry_id))
                if entry is not None:
                    entry.hits += 1
                    entry.last_hit = now

    def _delete_one(self, ns: _Namespace, entry_id: int) -> bool:
        entry = ns.entries.pop(entry_id, None)
        if entry is None:
            return False
        if ns.hashes.get(entry.token_hash) == entry_id:
            del ns.hashes[entry.token_hash]
        return True

    def _delete(self, namespace: str, ids: list[int]) -> int:
        """See :meth:`MapStoreBase.delete`."""
        ns = self._ns(namespace)
        with self._lock:
            deleted = sum(self._delete_one(ns, i) for i in ids)
        self._removed(namespace, ids)
        return deleted

    def compact(self) -> CompactReport:
        """Nothing to rewrite; reports the live entries."""
        entries = sum(len(ns.entries) for ns in self._namespaces.values())
        return CompactReport("memory", "memory", entries, 0, 0, 0, 0.0)

    def verify(self) -> VerifyReport:
        """Check every stored object's crc32c, every prefix block's and every chunk's."""
        start = time.perf_counter()
        corrupt = []
        checked = entries = 0
        with self._lock:
            for name, ns in sorted(self._namespaces.items()):
                for entry in ns.entries.values():
                    entries += 1
                    for layer, stored in enumerate(entry.objects):
                        checked += len(stored)
                        if tuple(crc32c.crc32c(c) for c in stored) != entry.crcs[layer]:
                            corrupt.append(CorruptEntry(name, entry.id, f"layer {layer} maps: crc32c mismatch"))
                            break
            blocks, problems = self._prefixes.problems()
            chunk_entries, corrupt_chunks = self._chunks.findings()
        return VerifyReport(entries, checked, tuple(corrupt), 0, time.perf_counter() - start, tuple(problems),
                            prefix_blocks_checked=blocks, chunks=ChunkCheck(chunk_entries, tuple(corrupt_chunks)))

    def stats(self) -> StoreStats:
        """See :meth:`MapStoreBase.stats`."""
        namespaces = []
        with self._lock:
            for name, ns in sorted(self._namespaces.items()):
                by_length: dict[int, list[_Entry]] = {}
                for entry in ns.entries.values():
                    by_length.setdefault(entry.length, []).append(entry)
                buckets = tuple(
                    BucketStats(
                        length,
                        len(group),
                        sum(e.nbytes for e in group),
                        sum(e.raw_bytes for e in group),
                        len(group),
                    )
                    for length, group in sorted(by_length.items())
                )
                namespaces.append(
                    NamespaceStats(
                        name,
                        ns.info.layout.codec,
                        sum(b.entries for b in buckets),
                        sum(b.stored_bytes for b in buckets),
                        sum(b.raw_bytes for b in buckets),
                        buckets,
                    )
                )
            prefix_blocks, prefix_bytes = self._prefixes.usage()
            chunk_usage = self._chunks.usage()
        return with_chunk_usage(StoreStats(
            path="memory",
            generation="memory",
            format_version=FORMAT_VERSION,
            entries=sum(n.entries for n in namespaces),
            stored_bytes=sum(n.stored_bytes for n in namespaces),
            raw_bytes=sum(n.raw_bytes for n in namespaces),
            file_bytes=0,
            map_size=0,
            max_bytes=self._max_bytes,
            evicted_entries=self._evicted_entries,
            evicted_bytes=self._evicted_bytes,
            pending_hits=0,
            namespaces=tuple(namespaces),
            dram=NO_DRAM,
            prefix_blocks=prefix_blocks,
            prefix_bytes=prefix_bytes,
        ), chunk_usage)

    def close(self) -> None:
        """Nothing to release."""
