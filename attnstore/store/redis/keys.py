"""The Redis key layout of one store (``P`` is the store's prefix, ``ns`` a namespace, ``17`` an entry id).

Keys are hash-tagged (Redis Cluster hashes only the part in braces), in three groups:

``{P}:...`` -- the catalog, on one shard::

    {P}:store          JSON {format_version, created}: the store exists
    {P}:namespaces     HASH name -> NamespaceInfo JSON
    {P}:projectors     HASH name -> projector blob (safetensors)
    {P}:catalog        a random token, replaced by every create, drop and projector change

``{P/ns}:...`` -- one namespace's index, on its shard (one Lua script updates them together)::

    {P/ns}:next_id     entry id counter (kept by a drop: ids are never reused)
    {P/ns}:hashes      HASH token hash (32 bytes) -> "id length"  (exact tier)
    {P/ns}:ids         ZSET id -> id (live entries in id order)
    {P/ns}:meta        HASH id -> token hash + "length stored_bytes raw_bytes"
    {P/ns}:buckets     HASH n:L / b:L / r:L -> entries / stored / raw bytes of length L;
                       evicted:n / evicted:b -> entries removed by the byte cap or found evicted by Redis
    {P/ns}:recency     ZSET id -> max(created, last hit): what the byte cap evicts first
    {P/ns}:hits        HASH id -> hits, id:t -> last hit
    {P/ns}:log         STREAM of ingests (ids, lengths, features) and deletes (ids)
    {P/ns}:trimmed     the id the log was last trimmed below
    {P/ns}:snapshot    HASH position, created, parts, 0.. -> the index rows as of position (safetensors)
    {P/ns}:snapshot_lock  held while one process writes the snapshot (and for the interval after)

``{P/ns/17}:entry`` -- one entry, one HASH (one key: Redis evicts a whole entry or nothing)::

    record             EntryRecord bytes (id, length, created, token hash, chunk crc32cs, feature, token ids)
    maps/<layer>       chunk bytes of zarr array <ns>/maps/L<length>, chunk (17, layer, 0, 0, 0)
    scales/<layer>     q8 codecs: chunk bytes of <ns>/scales/L<length>, chunk (17, layer, 0, 0)
    outputs            chunk bytes of <ns>/outputs/L<length>, chunk (17, 0, 0)

The chunk bytes are exactly those the LMDB backend stores for the same entry
(same codecs, ``zarr_layout``), with the entry id as the zarr slot.
"""

from __future__ import annotations

from dataclasses import dataclass

RECORD_FIELD = b"record"
OUTPUTS_FIELD = b"outputs"


def chunk_field(array: str, layer: int) -> bytes:
    """Field of one layer's chunk of ``array`` ("maps" or "scales") in an entry's hash."""
    return f"{array}/{layer}".encode()


@dataclass(frozen=True, slots=True)
class NamespaceKeys:
    """The index keys of one namespace (one hash slot)."""

    tag: str  # "{P/ns}"

    @property
    def next_id(self) -> str:
        """Entry id counter."""
        return f"{self.tag}:next_id"

    @property
    def hashes(self) -> str:
        """Exact-tier index: token hash -> "id length"."""
        return f"{self.tag}:hashes"

    @property
    def ids(self) -> str:
        """Live entry ids, in id order."""
        return f"{self.tag}:ids"

    @property
    def meta(self) -> str:
        """Per id: token hash + "length stored raw"."""
        return f"{self.tag}:meta"

    @property
    def buckets(self) -> str:
        """Entries and bytes per length; eviction counters."""
        return f"{self.tag}:buckets"

    @property
    def recency(self) -> str:
        """Per id: max(created, last hit)."""
        return f"{self.tag}:recency"

    @property
    def hits(self) -> str:
        """Hit counts and last hit times."""
        return f"{self.tag}:hits"

    @property
    def log(self) -> str:
        """The Stream of ingests and deletes."""
        return f"{self.tag}:log"

    @property
    def trimmed(self) -> str:
        """The id the log was last trimmed below."""
        return f"{self.tag}:trimmed"

    @property
    def snapshot(self) -> str:
        """The index snapshot."""
        return f"{self.tag}:snapshot"

    @property
    def snapshot_lock(self) -> str:
        """Held while a snapshot is written (and for the interval after)."""
        return f"{self.tag}:snapshot_lock"

    def index_keys(self) -> list[str]:
        """The keys the ingest, delete and drop scripts touch, in their KEYS order."""
        return [self.hashes, self.ids, self.meta, self.buckets, self.recency, self.hits, self.log]

    def all_keys(self) -> list[str]:
        """Every key of the namespace but its id counter (what a drop deletes)."""
        return [*self.index_keys(), self.trimmed, self.snapshot, self.snapshot_lock]


@dataclass(frozen=True, slots=True)
class StoreKeys:
    """Key names of the store with prefix ``prefix``."""

    prefix: str

    @property
    def store(self) -> str:
        """Marker: the store exists (format version, created)."""
        return f"{{{self.prefix}}}:store"

    @property
    def namespaces(self) -> str:
        """Namespace infos by name."""
        return f"{{{self.prefix}}}:namespaces"

    @property
    def projectors(self) -> str:
        """Projector blobs by namespace name."""
        return f"{{{self.prefix}}}:projectors"

    @property
    def catalog(self) -> str:
        """Token replaced by every catalog change."""
        return f"{{{self.prefix}}}:catalog"

    def namespace(self, name: str) -> NamespaceKeys:
        """The index keys of namespace ``name``."""
        return NamespaceKeys(f"{{{self.prefix}/{name}}}")

    def entry(self, namespace: str, entry_id: int) -> str:
        """The hash of one entry."""
        return f"{{{self.prefix}/{namespace}/{entry_id}}}:entry"

    def entry_pattern(self, namespace: str) -> str:
        """SCAN pattern of every entry key of ``namespace``."""
        return f"{{{self.prefix}/{namespace}/*}}:entry"

    def entry_id_of(self, namespace: str, key: bytes) -> int | None:
        """The entry id in an entry key of ``namespace`` (None if it is not one)."""
        head = f"{{{self.prefix}/{namespace}/".encode()
        text = bytes(key)
        if not text.startswith(head) or not text.endswith(b"}:entry"):
            return None
        digits = text[len(head) : -len(b"}:entry")]
        return int(digits) if digits.isdigit() else None
