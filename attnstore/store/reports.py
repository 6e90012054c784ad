"""Reports returned by the map store: what an ingest did, stats, verify, compaction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def _ratio(stored: int, raw: int) -> float:
    return stored / raw if raw else 1.0


@dataclass(frozen=True, slots=True)
class IngestReport:
    """What one ingest call did, decided inside its write (so concurrent callers agree)."""

    entry_ids: list[int]  # one per input entry, in order; an already stored one gives its stored id
    added: list[int]  # ids this call stored, each once, in input order
    # namespace -> ids the byte cap evicted to make room (they must leave every index)
    evicted: dict[str, list[int]] = field(default_factory=dict)
    # already stored ids that had no feature vector (their projector was replaced) and got this call's
    featured: list[int] = field(default_factory=list)

    @property
    def duplicates(self) -> int:
        """Input entries this call did not store: already stored, or repeated within the call."""
        return len(self.entry_ids) - len(self.added)


@dataclass(frozen=True, slots=True)
class FeaturesReport:
    """What one ``set_features`` call did, decided inside its write."""

    updated: list[int]  # ids given their new feature vector, in call order
    lengths: list[int]  # token length of each updated entry (its index bucket)
    missing: list[int]  # ids no live entry has (deleted or evicted since they were listed)


@dataclass(frozen=True, slots=True)
class PrefetchReport:
    """What one prefetch call queued."""

    queued: int  # entries queued for loading into the DRAM cache
    unknown: int  # distinct ids no live entry has (never queued)


@dataclass(frozen=True, slots=True)
class DramStats:
    """Usage of the DRAM cache (decoded hot entries; ``DramCache``)."""

    capacity_bytes: int
    bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int  # entries pushed out to stay under capacity
    rejected: int  # entries larger than the whole capacity, never admitted


NO_DRAM = DramStats(0, 0, 0, 0, 0, 0, 0)  # the usage a store without a DRAM cache reports


@dataclass(frozen=True, slots=True)
class BucketStats:
    """One length bucket of one namespace."""

    length: int
    entries: int
    stored_bytes: int  # encoded bytes of the stored objects (maps and outputs)
    raw_bytes: int  # the same data as plain fp16
    capacity: int  # slots of the bucket's zarr arrays

    @property
    def ratio(self) -> float:
        """Stored bytes over fp16 bytes (1.0 = no compression)."""
        return _ratio(self.stored_bytes, self.raw_bytes)


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    """Entries and bytes of one namespace, per length bucket."""

    name: str
    codec: str
    entries: int
    stored_bytes: int
    raw_bytes: int
    buckets: tuple[BucketStats, ...]
    # chunk entries (keys and values of text chunks): outside stored_bytes, inside what max_bytes caps
    chunk_entries: int = 0
    chunk_bytes: int = 0

    @property
    def ratio(self) -> float:
        """Stored bytes over fp16 bytes (1.0 = no compression)."""
        return _ratio(self.stored_bytes, self.raw_bytes)


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Whole-store statistics."""

    path: str
    generation: str  # live generation directory name ("memory" for MemoryMapStore)
    format_version: int
    entries: int
    stored_bytes: int  # live entries' stored objects' bytes; what max_bytes caps
    raw_bytes: int
    file_bytes: int  # size of the live generation's data file (reclaimed by compaction)
    map_size: int  # LMDB map size (address space reserved)
    max_bytes: int | None
    evicted_entries: int  # entries removed by the byte cap since creation
    evicted_bytes: int
    pending_hits: int  # hit counts buffered in memory, not yet on disk
    namespaces: tuple[NamespaceStats, ...]
    dram: DramStats
    # generations other than the live one still on disk (held by a reader, or left by a killed compaction)
    stale_generations: int = 0
    stale_generation_bytes: int = 0
    # prefix blocks (keys and values of prompt prefixes, causal namespaces): outside stored_bytes and max_bytes
    prefix_blocks: int = 0
    prefix_bytes: int = 0
    # chunk entries over every namespace (per namespace in ``namespaces``): max_bytes caps them with stored_bytes
    chunk_entries: int = 0
    chunk_bytes: int = 0

    @property
    def ratio(self) -> float:
        """Stored bytes over fp16 bytes over all namespaces."""
        return _ratio(self.stored_bytes, self.raw_bytes)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON, with the ratios included."""
        data = dataclasses.asdict(self)
        data["ratio"] = self.ratio
        for ns_dict, ns in zip(data["namespaces"], self.namespaces, strict=True):
            ns_dict["ratio"] = ns.ratio
            for bucket_dict, bucket in zip(ns_dict["buckets"], ns.buckets, strict=True):
                bucket_dict["ratio"] = bucket.ratio
        return data


@dataclass(frozen=True, slots=True)
class CorruptEntry:
    """One entry verify found damaged; it is never served."""

    namespace: str
    id: int
    reason: str  # e.g. "layer 3 maps: crc32c mismatch"


@dataclass(frozen=True, slots=True)
class CorruptChunk:
    """One chunk entry verify found damaged; reading it raises ChecksumError."""

    namespace: str
    key: str  # the chunk's key, hex
    reason: str  # e.g. "layer 3 fails its crc32c"


@dataclass(frozen=True, slots=True)
class ChunkCheck:
    """What verify found of the chunk tier's entries (``store.chunks``): each one's record and layers' crc32c."""

    checked: int = 0
    corrupt: tuple[CorruptChunk, ...] = ()


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """Result of walking the store: its map entries and their stored objects, its prefix blocks, its chunks.

    A stored object is what one key holds of an entry's arrays (one per array, slot and, for maps, layer:
    ``zarr_layout``'s storage unit); ``chunks`` is the chunk tier's own check.
    """

    entries_checked: int
    objects_checked: int
    corrupt: tuple[CorruptEntry, ...]
    orphan_objects: int  # stored objects no live entry owns (invisible; compaction drops them)
    seconds: float
    # damage not tied to one entry: the database's structure, a projector failing its checksum, a corrupt
    # prefix block (named by its chain hash)
    problems: tuple[str, ...] = ()
    prefix_blocks_checked: int = 0
    chunks: ChunkCheck = ChunkCheck()

    @property
    def ok(self) -> bool:
        """True when no entry or chunk is corrupt and the store shows no other damage (orphans are harmless)."""
        return not self.corrupt and not self.problems and not self.chunks.corrupt

    def corrupt_ids(self, namespace: str) -> list[int]:
        """Ids of the corrupt entries of ``namespace``."""
        return [c.id for c in self.corrupt if c.namespace == namespace]

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        data = dataclasses.asdict(self)
        data["ok"] = self.ok
        return data


def with_chunk_usage(stats: StoreStats, usage: dict[str, tuple[int, int]]) -> StoreStats:
    """``stats`` with each namespace's chunk entries and bytes (``usage``: name -> (entries, bytes)) and their
    totals."""
    namespaces = tuple(
        dataclasses.replace(ns, chunk_entries=usage.get(ns.name, (0, 0))[0], chunk_bytes=usage.get(ns.name, (0, 0))[1])
        for ns in stats.namespaces
    )
    return dataclasses.replace(
        stats, namespaces=namespaces, chunk_entries=sum(ns.chunk_entries for ns in namespaces),
        chunk_bytes=sum(ns.chunk_bytes for ns in namespaces),
    )


@dataclass(frozen=True, slots=True)
class CompactReport:
    """Result of rewriting the live entries densely into a new generation."""

    old_generation: str
    new_generation: str
    entries: int  # live entries copied (ids unchanged)
    orphan_objects_dropped: int
    bytes_before: int  # data file size before
    bytes_after: int  # data file size after
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return dataclasses.asdict(self)
