"""The Redis key layout of one store (``P`` is the store's prefix, ``ns`` a namespace, ``17`` an entry id).

Keys are hash-tagged (Redis Cluster hashes only the part in braces), in three groups:

``{P}:...`` -- the store marker and the list of namespaces, on one shard::

    {P}:store          JSON {format_version, created}: the store exists
    {P}:namespaces     HASH name -> created (what list_namespaces walks)

``{P/ns}:...`` -- one namespace, on its shard (one Lua script changes several at once)::

    {P/ns}:info        NamespaceInfo JSON (no projector blob)
    {P/ns}:projector   the projector blob (safetensors)
    {P/ns}:next_id     entry id counter (kept by a drop: ids are never reused)
    {P/ns}:hashes      HASH token hash (32 bytes) -> "id length"  (exact tier)
    {P/ns}:ids         ZSET id -> id (live entries in id order)
    {P/ns}:meta        HASH id -> token hash + "length stored_bytes raw_bytes"
    {P/ns}:features    HASH id -> feature (float32 little-endian); dropped whole by a projector replacement
    {P/ns}:buckets     HASH n:L / b:L / r:L -> entries / stored / raw bytes of length L;
                       evicted:n / evicted:b -> entries removed by the byte cap or found evicted by Redis
    {P/ns}:recency     ZSET id -> max(created, last hit): what the byte cap evicts first
    {P/ns}:hits        HASH id -> hits, id:t -> last hit
    {P/ns}:log         STREAM of ingests (ids, lengths, features), deletes (ids) and feature resets
    {P/ns}:trimmed     the last log id trimmed away (the log is capped)
    {P/ns}:adm:*       admission counts of the fleet (see ``store.redis.admission``)

``{P/ns/17}:entry`` -- one entry, one HASH (one key: Redis evicts a whole entry or nothing)::

    record             EntryRecord bytes (id, length, created, token hash, chunk crc32cs, token ids)
    maps/<layer>       chunk bytes of zarr array <ns>/maps/L<length>, chunk (17, layer, 0, 0, 0)
    scales/<layer>     q8 codecs: chunk bytes of <ns>/scales/L<length>, chunk (17, layer, 0, 0)
    outputs            chunk bytes of <ns>/outputs/L<length>, chunk (17, 0, 0)

An entry's keys hash to its own slot, so entries spread over every shard while
one entry is one read on one shard. The chunk bytes are exactly those the LMDB
backend stores for the same entry (same codecs, ``zarr_layout``). Feature
vectors live with the namespace's index keys, not in the record: a projector
replacement drops them all in the one script that stores the new projector.
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
    """The keys of one namespace (one hash slot)."""

    tag: str  # "{P/ns}"

    def key(self, name: str) -> str:
        """The namespace's key ``name`` (one of those listed in the module docstring)."""
        return f"{self.tag}:{name}"

    @property
    def info(self) -> str:
        return self.key("info")

    @property
    def projector(self) -> str:
        return self.key("projector")

    @property
    def next_id(self) -> str:
        return self.key("next_id")

    @property
    def hashes(self) -> str:
        return self.key("hashes")

    @property
    def ids(self) -> str:
        return self.key("ids")

    @property
    def meta(self) -> str:
        return self.key("meta")

    @property
    def features(self) -> str:
        return self.key("features")

    @property
    def buckets(self) -> str:
        return self.key("buckets")

    @property
    def recency(self) -> str:
        return self.key("recency")

    @property
    def hits(self) -> str:
        return self.key("hits")

    @property
    def log(self) -> str:
        return self.key("log")

    @property
    def trimmed(self) -> str:
        return self.key("trimmed")

    def index_keys(self) -> list[str]:
        """The keys the ingest and remove scripts touch, in their KEYS order."""
        return [self.info, self.hashes, self.ids, self.meta, self.features, self.buckets, self.recency, self.hits,
                self.log, self.trimmed]

    def admission_keys(self) -> list[str]:
        """The keys of the namespace's admission counts (``store.redis.admission``)."""
        return [self.key(f"adm:{name}") for name in ("cur", "prev", "seen", "seenprev", "asks", "salt")]

    def all_keys(self) -> list[str]:
        """Every key of the namespace but its id counter (what a drop deletes)."""
        return [*self.index_keys(), self.projector, *self.admission_keys()]


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
        """Namespace names -> created."""
        return f"{{{self.prefix}}}:namespaces"

    def namespace(self, name: str) -> NamespaceKeys:
        """The keys of namespace ``name``."""
        return NamespaceKeys(f"{{{self.prefix}/{name}}}")

    def entry(self, namespace: str, entry_id: int) -> str:
        """The hash of one entry."""
        return f"{{{self.prefix}/{namespace}/{entry_id}}}:entry"

    def entry_pattern(self, namespace: str) -> str:
        """SCAN pattern of every entry key of ``namespace`` (glob characters in the name escaped)."""
        escaped = "".join(f"\\{c}" if c in "*?[]\\" else c for c in f"{self.prefix}/{namespace}/")
        return f"{{{escaped}*}}:entry"

    def entry_id_of(self, namespace: str, key: bytes) -> int | None:
        """The entry id in an entry key of ``namespace`` (None if it is not one)."""
        head = f"{{{self.prefix}/{namespace}/".encode()
        text = bytes(key)
        if not text.startswith(head) or not text.endswith(b"}:entry"):
            return None
        digits = text[len(head) : -len(b"}:entry")]
        return int(digits) if digits.isdigit() else None
