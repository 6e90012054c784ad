"""The Redis key layout of one store, and one entry as a hash of it (``P`` is the store's prefix, ``ns`` a
namespace, ``17`` an entry id).

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
    {P/ns}:chunk_layout      the namespace's ChunkLayout JSON: it stores chunk entries (``store.redis.chunks``)
    {P/ns}:chunks            HASH chunk key (32 bytes) -> ChunkRecord: the chunks stored (what makes one visible)
    {P/ns}:chunk_recency     ZSET chunk key -> max(stored, last read): what the byte cap evicts first
    {P/ns}:chunk_bytes       bytes of every stored chunk's layers
    {P/ns}:c:<hex key>       HASH layer number -> that layer's keys and values, of one chunk

A namespace's chunks live on its shard, so one script stores a call's chunks together (no TTL: a
``volatile-*`` policy never evicts them; the byte cap does).

``{P/ns/17}:entry`` -- one entry, one HASH (one key: Redis evicts a whole entry or nothing)::

    record             EntryRecord bytes (id, length, created, token hash, its objects' crc32cs, token ids)
    maps/<layer>       the stored object of zarr array <ns>/maps/L<length> at (17, layer, 0, 0, 0)
    scales/<layer>     q8 codecs: the stored object of <ns>/scales/L<length> at (17, layer, 0, 0)
    outputs            the stored object of <ns>/outputs/L<length> at (17, 0, 0)

An entry's keys hash to its own slot, so entries spread over every shard while
one entry is one read on one shard. The stored objects are exactly those the LMDB
backend stores for the same entry (same codecs, ``zarr_layout``). Feature
vectors live with the namespace's index keys, not in the record: a projector
replacement drops them all in the one script that stores the new projector.

Each entry's hash is written and read here too (``encode_entry``, ``decode_record``, ``decode_layers``):
the stored objects and the record are those every persistent backend stores (``codecs``,
``store.entry_record``), the entry id standing for the zarr slot; every object is
checked against its crc32c on the way out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import crc32c
import numpy as np

from attnstore.errors import ChecksumError, EntryNotFoundError
from attnstore.store.arrays import NamespaceState
from attnstore.store.entry_record import EntryRecord, check_map_record
from attnstore.store.validate import PreparedEntry
from attnstore.store.zarr_layout import ZarrArray

RECORD_FIELD = b"record"
OUTPUTS_FIELD = b"outputs"


def object_field(array: str, layer: int) -> bytes:
    """Field of one layer's stored object of ``array`` ("maps" or "scales") in an entry's hash."""
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

    @property
    def chunk_layout(self) -> str:
        return self.key("chunk_layout")

    @property
    def chunks(self) -> str:
        return self.key("chunks")

    @property
    def chunk_recency(self) -> str:
        return self.key("chunk_recency")

    @property
    def chunk_bytes(self) -> str:
        return self.key("chunk_bytes")

    def chunk(self, key: bytes) -> str:
        """The hash of one chunk's layers."""
        return self.key(f"c:{key.hex()}")

    def chunk_keys(self) -> list[str]:
        """The chunk scripts' first KEYS, in order: layout, records, recency, byte count."""
        return [self.chunk_layout, self.chunks, self.chunk_recency, self.chunk_bytes]

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


Fields = Mapping[bytes, bytes]


def encode_entry(
    state: NamespaceState, entry: PreparedEntry, entry_id: int, now: float
) -> tuple[EntryRecord, dict[bytes, bytes]]:
    """The entry's record and every field of its hash (an outputs-only entry has no map fields and no crcs)."""
    fields: dict[bytes, bytes] = {}
    crcs: list[int] = []
    arrays = state.arrays(entry.length)
    for layer in range(state.layout.layers if entry.maps is not None else 0):
        assert entry.maps is not None
        for array, stored in zip(arrays, state.codec.encode_layer(entry.maps[layer]), strict=True):
            data = bytes(stored)
            fields[object_field(array.name, layer)] = data
            crcs.append(crc32c.crc32c(data))
    outputs_crc = None
    if entry.outputs is not None:
        data = entry.outputs.tobytes()
        fields[OUTPUTS_FIELD] = data
        outputs_crc = crc32c.crc32c(data)
    record = EntryRecord(
        id=entry_id,
        slot=entry_id,
        length=entry.length,
        created=now,
        token_hash=entry.token_hash,
        crcs=tuple(crcs),
        nbytes=sum(len(value) for value in fields.values()),
        outputs_crc=outputs_crc,
        feature=None,  # kept in the namespace's features hash (see ``keys``)
        token_ids=entry.token_ids,
        writer=entry.writer,
    )
    fields[RECORD_FIELD] = record.to_bytes()
    return record, fields


def decode_record(state: NamespaceState, entry_id: int, raw: bytes | None) -> EntryRecord:
    """The record of a stored entry.

    Raises:
        EntryNotFoundError: no such entry (``raw`` is None).
        ChecksumError: the record is corrupt, or names another entry.
    """
    if raw is None:
        raise EntryNotFoundError(f"no entry {entry_id} in namespace {state.name!r}")
    try:
        record = EntryRecord.from_bytes(raw)
    except ChecksumError as exc:
        raise ChecksumError(f"entry {entry_id} of namespace {state.name!r}: {exc}") from None
    if record.id != entry_id:
        raise ChecksumError(f"entry {entry_id} of namespace {state.name!r}: its record holds id {record.id}")
    return record


def hash_object(fields: Fields, array: ZarrArray, layer: int) -> bytes | None:
    """One layer's stored object of ``array`` among an entry's hash fields (what verify checks); None where missing."""
    return fields.get(object_field(array.name, layer))


def layer_fields(state: NamespaceState, layer: int) -> list[bytes]:
    """The fields of one layer's stored objects (one per codec array), in array order."""
    return [object_field(array.name, layer) for array in state.codec.arrays(state.layout, 1)]


def decode_layers(
    state: NamespaceState, record: EntryRecord, fields: Fields, layers: Iterable[int], out: np.ndarray
) -> None:
    """Decode the listed layers of one entry into ``out`` ``(n_layers, heads, L, L)`` fp16, checking every crc32c.

    Raises:
        MapsNotStoredError: the entry stores outputs only (written back for the exact tier).
        ChecksumError: a layer's stored object is missing, fails its crc32c or does not decode.
    """
    arrays = state.arrays(record.length)
    n_arrays = len(arrays)
    check_map_record(state, record, n_arrays)
    per_layer = []
    for layer in layers:
        stored_objects = []
        for k, array in enumerate(arrays):
            stored = fields.get(object_field(array.name, layer))
            if stored is None:
                raise ChecksumError(
                    f"entry {record.id} of namespace {state.name!r}: layer {layer} {array.name} are missing"
                )
            if crc32c.crc32c(stored) != record.crcs[layer * n_arrays + k]:
                raise ChecksumError(
                    f"entry {record.id} of namespace {state.name!r}: layer {layer} {array.name}"
                    " fail their crc32c check"
                )
            stored_objects.append(stored)
        per_layer.append(stored_objects)
    state.codec.decode_into(per_layer, out)


def decode_outputs(state: NamespaceState, record: EntryRecord, stored: bytes | None) -> np.ndarray | None:
    """The entry's outputs ``(L, hidden)`` fp16, or None if it was stored without.

    Raises:
        ChecksumError: the outputs are missing, fail their crc32c or have the wrong size.
    """
    if record.outputs_crc is None:
        return None
    expected = state.outputs(record.length).object_nbytes
    if stored is None or crc32c.crc32c(stored) != record.outputs_crc or len(stored) != expected:
        raise ChecksumError(
            f"entry {record.id} of namespace {state.name!r}: outputs are missing or fail their crc32c check"
        )
    return np.frombuffer(stored, dtype="<f2").reshape(record.length, state.layout.hidden).astype(np.float16)
