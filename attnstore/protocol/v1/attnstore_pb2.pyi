from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MatchKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MATCH_KIND_UNSPECIFIED: _ClassVar[MatchKind]
    MATCH_KIND_MISS: _ClassVar[MatchKind]
    MATCH_KIND_EXACT: _ClassVar[MatchKind]
    MATCH_KIND_MAP: _ClassVar[MatchKind]
MATCH_KIND_UNSPECIFIED: MatchKind
MATCH_KIND_MISS: MatchKind
MATCH_KIND_EXACT: MatchKind
MATCH_KIND_MAP: MatchKind

class Layout(_message.Message):
    __slots__ = ("layers", "heads", "causal", "hidden", "feature_dim", "dtype", "codec")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    CAUSAL_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    layers: int
    heads: int
    causal: bool
    hidden: int
    feature_dim: int
    dtype: str
    codec: str
    def __init__(self, layers: _Optional[int] = ..., heads: _Optional[int] = ..., causal: _Optional[bool] = ..., hidden: _Optional[int] = ..., feature_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., codec: _Optional[str] = ...) -> None: ...

class Namespace(_message.Message):
    __slots__ = ("name", "model", "fingerprint", "layout", "format_version", "created", "projector", "projector_crc32c", "projector_version", "prefix", "limits", "chunks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    PROJECTOR_FIELD_NUMBER: _ClassVar[int]
    PROJECTOR_CRC32C_FIELD_NUMBER: _ClassVar[int]
    PROJECTOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: str
    fingerprint: str
    layout: Layout
    format_version: int
    created: float
    projector: bytes
    projector_crc32c: int
    projector_version: int
    prefix: PrefixLayout
    limits: TokenLimits
    chunks: ChunkLayout
    def __init__(self, name: _Optional[str] = ..., model: _Optional[str] = ..., fingerprint: _Optional[str] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., format_version: _Optional[int] = ..., created: _Optional[float] = ..., projector: _Optional[bytes] = ..., projector_crc32c: _Optional[int] = ..., projector_version: _Optional[int] = ..., prefix: _Optional[_Union[PrefixLayout, _Mapping]] = ..., limits: _Optional[_Union[TokenLimits, _Mapping]] = ..., chunks: _Optional[_Union[ChunkLayout, _Mapping]] = ...) -> None: ...

class TokenLimits(_message.Message):
    __slots__ = ("vocab_size", "max_length")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    max_length: int
    def __init__(self, vocab_size: _Optional[int] = ..., max_length: _Optional[int] = ...) -> None: ...

class PrefixLayout(_message.Message):
    __slots__ = ("block_size", "layers", "kv_heads", "head_dim", "hidden", "dtype")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    dtype: str
    def __init__(self, block_size: _Optional[int] = ..., layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., hidden: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class CreateNamespaceRequest(_message.Message):
    __slots__ = ("name", "model", "fingerprint", "layout", "projector", "replace_projector", "limits", "prefix", "chunks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PROJECTOR_FIELD_NUMBER: _ClassVar[int]
    REPLACE_PROJECTOR_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: str
    fingerprint: str
    layout: Layout
    projector: bytes
    replace_projector: bool
    limits: TokenLimits
    prefix: PrefixLayout
    chunks: ChunkLayout
    def __init__(self, name: _Optional[str] = ..., model: _Optional[str] = ..., fingerprint: _Optional[str] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., projector: _Optional[bytes] = ..., replace_projector: _Optional[bool] = ..., limits: _Optional[_Union[TokenLimits, _Mapping]] = ..., prefix: _Optional[_Union[PrefixLayout, _Mapping]] = ..., chunks: _Optional[_Union[ChunkLayout, _Mapping]] = ...) -> None: ...

class GetNamespaceRequest(_message.Message):
    __slots__ = ("name", "without_projector")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WITHOUT_PROJECTOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    without_projector: bool
    def __init__(self, name: _Optional[str] = ..., without_projector: _Optional[bool] = ...) -> None: ...

class ListNamespacesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNamespacesResponse(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[Namespace]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[Namespace, _Mapping]]] = ...) -> None: ...

class Query(_message.Message):
    __slots__ = ("feature", "length", "token_hash", "token_ids")
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    feature: _containers.RepeatedScalarFieldContainer[float]
    length: int
    token_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, feature: _Optional[_Iterable[float]] = ..., length: _Optional[int] = ..., token_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "fingerprint", "queries", "max_distance", "want_maps", "want_outputs", "gate", "exact_only", "projector_version")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    MAX_DISTANCE_FIELD_NUMBER: _ClassVar[int]
    WANT_MAPS_FIELD_NUMBER: _ClassVar[int]
    WANT_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    GATE_FIELD_NUMBER: _ClassVar[int]
    EXACT_ONLY_FIELD_NUMBER: _ClassVar[int]
    PROJECTOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    fingerprint: str
    queries: _containers.RepeatedCompositeFieldContainer[Query]
    max_distance: float
    want_maps: bool
    want_outputs: bool
    gate: bool
    exact_only: bool
    projector_version: int
    def __init__(self, namespace: _Optional[str] = ..., fingerprint: _Optional[str] = ..., queries: _Optional[_Iterable[_Union[Query, _Mapping]]] = ..., max_distance: _Optional[float] = ..., want_maps: _Optional[bool] = ..., want_outputs: _Optional[bool] = ..., gate: _Optional[bool] = ..., exact_only: _Optional[bool] = ..., projector_version: _Optional[int] = ...) -> None: ...

class Match(_message.Message):
    __slots__ = ("query_index", "kind", "entry_id", "distance", "stored_length", "admit")
    QUERY_INDEX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    DISTANCE_FIELD_NUMBER: _ClassVar[int]
    STORED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    query_index: int
    kind: MatchKind
    entry_id: int
    distance: float
    stored_length: int
    admit: bool
    def __init__(self, query_index: _Optional[int] = ..., kind: _Optional[_Union[MatchKind, str]] = ..., entry_id: _Optional[int] = ..., distance: _Optional[float] = ..., stored_length: _Optional[int] = ..., admit: _Optional[bool] = ...) -> None: ...

class Matches(_message.Message):
    __slots__ = ("matches",)
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    matches: _containers.RepeatedCompositeFieldContainer[Match]
    def __init__(self, matches: _Optional[_Iterable[_Union[Match, _Mapping]]] = ...) -> None: ...

class MapFrame(_message.Message):
    __slots__ = ("query_index", "entry_id", "layer", "dtype", "shape", "codec", "data", "crc32c", "offset", "total_bytes")
    QUERY_INDEX_FIELD_NUMBER: _ClassVar[int]
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    query_index: int
    entry_id: int
    layer: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: str
    data: bytes
    crc32c: int
    offset: int
    total_bytes: int
    def __init__(self, query_index: _Optional[int] = ..., entry_id: _Optional[int] = ..., layer: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., codec: _Optional[str] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class OutputFrame(_message.Message):
    __slots__ = ("query_index", "entry_id", "dtype", "shape", "data", "crc32c", "offset", "total_bytes")
    QUERY_INDEX_FIELD_NUMBER: _ClassVar[int]
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    query_index: int
    entry_id: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    crc32c: int
    offset: int
    total_bytes: int
    def __init__(self, query_index: _Optional[int] = ..., entry_id: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class RowError(_message.Message):
    __slots__ = ("query_index", "entry_id", "code", "message", "block")
    QUERY_INDEX_FIELD_NUMBER: _ClassVar[int]
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    query_index: int
    entry_id: int
    code: str
    message: str
    block: int
    def __init__(self, query_index: _Optional[int] = ..., entry_id: _Optional[int] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., block: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("matches", "maps", "outputs", "error")
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    MAPS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    matches: Matches
    maps: MapFrame
    outputs: OutputFrame
    error: RowError
    def __init__(self, matches: _Optional[_Union[Matches, _Mapping]] = ..., maps: _Optional[_Union[MapFrame, _Mapping]] = ..., outputs: _Optional[_Union[OutputFrame, _Mapping]] = ..., error: _Optional[_Union[RowError, _Mapping]] = ...) -> None: ...

class SearchRequest(_message.Message):
    __slots__ = ("namespace", "fingerprint", "queries", "max_distance", "gate", "projector_version")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    MAX_DISTANCE_FIELD_NUMBER: _ClassVar[int]
    GATE_FIELD_NUMBER: _ClassVar[int]
    PROJECTOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    fingerprint: str
    queries: _containers.RepeatedCompositeFieldContainer[Query]
    max_distance: float
    gate: bool
    projector_version: int
    def __init__(self, namespace: _Optional[str] = ..., fingerprint: _Optional[str] = ..., queries: _Optional[_Iterable[_Union[Query, _Mapping]]] = ..., max_distance: _Optional[float] = ..., gate: _Optional[bool] = ..., projector_version: _Optional[int] = ...) -> None: ...

class SearchResponse(_message.Message):
    __slots__ = ("matches",)
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    matches: _containers.RepeatedCompositeFieldContainer[Match]
    def __init__(self, matches: _Optional[_Iterable[_Union[Match, _Mapping]]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("namespace", "entry_ids", "length", "fingerprint")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ENTRY_IDS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    entry_ids: _containers.RepeatedScalarFieldContainer[int]
    length: int
    fingerprint: str
    def __init__(self, namespace: _Optional[str] = ..., entry_ids: _Optional[_Iterable[int]] = ..., length: _Optional[int] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class FetchRow(_message.Message):
    __slots__ = ("entry_id", "length")
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    entry_id: int
    length: int
    def __init__(self, entry_id: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class FetchMapsRequest(_message.Message):
    __slots__ = ("namespace", "fingerprint", "rows")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    fingerprint: str
    rows: _containers.RepeatedCompositeFieldContainer[FetchRow]
    def __init__(self, namespace: _Optional[str] = ..., fingerprint: _Optional[str] = ..., rows: _Optional[_Iterable[_Union[FetchRow, _Mapping]]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("namespace", "entry_ids")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ENTRY_IDS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    entry_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., entry_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("queued", "unknown")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    queued: int
    unknown: int
    def __init__(self, queued: _Optional[int] = ..., unknown: _Optional[int] = ...) -> None: ...

class IngestRequest(_message.Message):
    __slots__ = ("begin", "entry", "maps", "outputs", "commit")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    MAPS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    begin: IngestBegin
    entry: EntryBegin
    maps: MapFrame
    outputs: OutputFrame
    commit: IngestCommit
    def __init__(self, begin: _Optional[_Union[IngestBegin, _Mapping]] = ..., entry: _Optional[_Union[EntryBegin, _Mapping]] = ..., maps: _Optional[_Union[MapFrame, _Mapping]] = ..., outputs: _Optional[_Union[OutputFrame, _Mapping]] = ..., commit: _Optional[_Union[IngestCommit, _Mapping]] = ...) -> None: ...

class IngestBegin(_message.Message):
    __slots__ = ("namespace", "fingerprint", "projector_version")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PROJECTOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    fingerprint: str
    projector_version: int
    def __init__(self, namespace: _Optional[str] = ..., fingerprint: _Optional[str] = ..., projector_version: _Optional[int] = ...) -> None: ...

class EntryBegin(_message.Message):
    __slots__ = ("length", "token_hash", "feature", "token_ids")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_HASH_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    length: int
    token_hash: bytes
    feature: _containers.RepeatedScalarFieldContainer[float]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, length: _Optional[int] = ..., token_hash: _Optional[bytes] = ..., feature: _Optional[_Iterable[float]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class IngestCommit(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IngestSummary(_message.Message):
    __slots__ = ("entry_ids", "entries", "duplicates", "bytes")
    ENTRY_IDS_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    entry_ids: _containers.RepeatedScalarFieldContainer[int]
    entries: int
    duplicates: int
    bytes: int
    def __init__(self, entry_ids: _Optional[_Iterable[int]] = ..., entries: _Optional[int] = ..., duplicates: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class WrittenRow(_message.Message):
    __slots__ = ("token_ids", "dtype", "shape", "outputs", "crc32c", "maps_dtype", "maps_shape", "maps", "maps_crc32c", "feature", "projector_version")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    MAPS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAPS_SHAPE_FIELD_NUMBER: _ClassVar[int]
    MAPS_FIELD_NUMBER: _ClassVar[int]
    MAPS_CRC32C_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    PROJECTOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    outputs: bytes
    crc32c: int
    maps_dtype: str
    maps_shape: _containers.RepeatedScalarFieldContainer[int]
    maps: bytes
    maps_crc32c: int
    feature: _containers.RepeatedScalarFieldContainer[float]
    projector_version: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., outputs: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., maps_dtype: _Optional[str] = ..., maps_shape: _Optional[_Iterable[int]] = ..., maps: _Optional[bytes] = ..., maps_crc32c: _Optional[int] = ..., feature: _Optional[_Iterable[float]] = ..., projector_version: _Optional[int] = ...) -> None: ...

class WriteBackRequest(_message.Message):
    __slots__ = ("namespace", "fingerprint", "rows")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    fingerprint: str
    rows: _containers.RepeatedCompositeFieldContainer[WrittenRow]
    def __init__(self, namespace: _Optional[str] = ..., fingerprint: _Optional[str] = ..., rows: _Optional[_Iterable[_Union[WrittenRow, _Mapping]]] = ...) -> None: ...

class WriteBackResponse(_message.Message):
    __slots__ = ("stored", "duplicates", "not_admitted", "bytes", "maps_stored", "maps_bytes", "refused")
    STORED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    NOT_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MAPS_STORED_FIELD_NUMBER: _ClassVar[int]
    MAPS_BYTES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    duplicates: int
    not_admitted: int
    bytes: int
    maps_stored: int
    maps_bytes: int
    refused: _containers.RepeatedCompositeFieldContainer[RowError]
    def __init__(self, stored: _Optional[int] = ..., duplicates: _Optional[int] = ..., not_admitted: _Optional[int] = ..., bytes: _Optional[int] = ..., maps_stored: _Optional[int] = ..., maps_bytes: _Optional[int] = ..., refused: _Optional[_Iterable[_Union[RowError, _Mapping]]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace", "entry_ids")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ENTRY_IDS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    entry_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., entry_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class CompactRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CompactResponse(_message.Message):
    __slots__ = ("entries", "bytes_before", "bytes_after", "seconds")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_BEFORE_FIELD_NUMBER: _ClassVar[int]
    BYTES_AFTER_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    entries: int
    bytes_before: int
    bytes_after: int
    seconds: float
    def __init__(self, entries: _Optional[int] = ..., bytes_before: _Optional[int] = ..., bytes_after: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CorruptEntry(_message.Message):
    __slots__ = ("namespace", "entry_id", "reason")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    entry_id: int
    reason: str
    def __init__(self, namespace: _Optional[str] = ..., entry_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("entries_checked", "corrupt_entry_ids", "problems", "corrupt", "chunks_checked", "orphan_chunks", "seconds", "store_problems")
    ENTRIES_CHECKED_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_ENTRY_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_CHECKED_FIELD_NUMBER: _ClassVar[int]
    ORPHAN_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    STORE_PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    entries_checked: int
    corrupt_entry_ids: _containers.RepeatedScalarFieldContainer[int]
    problems: _containers.RepeatedScalarFieldContainer[str]
    corrupt: _containers.RepeatedCompositeFieldContainer[CorruptEntry]
    chunks_checked: int
    orphan_chunks: int
    seconds: float
    store_problems: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, entries_checked: _Optional[int] = ..., corrupt_entry_ids: _Optional[_Iterable[int]] = ..., problems: _Optional[_Iterable[str]] = ..., corrupt: _Optional[_Iterable[_Union[CorruptEntry, _Mapping]]] = ..., chunks_checked: _Optional[int] = ..., orphan_chunks: _Optional[int] = ..., seconds: _Optional[float] = ..., store_problems: _Optional[_Iterable[str]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BucketStats(_message.Message):
    __slots__ = ("namespace", "length", "codec", "entries", "stored_bytes", "raw_bytes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    length: int
    codec: str
    entries: int
    stored_bytes: int
    raw_bytes: int
    def __init__(self, namespace: _Optional[str] = ..., length: _Optional[int] = ..., codec: _Optional[str] = ..., entries: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., raw_bytes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("entries", "stored_bytes", "buckets", "dram_bytes", "dram_capacity_bytes", "dram_hits", "dram_misses", "dram_evictions", "store_evictions", "raw_bytes", "file_bytes", "max_bytes", "dram_entries", "stale_generations", "stale_generation_bytes", "written_back_entries", "written_back_bytes", "written_back_duplicates", "written_back_not_admitted", "admission_asked", "admission_admitted", "admission_sketch_bytes", "admit_after", "written_back_map_entries", "written_back_map_bytes", "written_back_refused", "scoped")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    DRAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAM_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAM_HITS_FIELD_NUMBER: _ClassVar[int]
    DRAM_MISSES_FIELD_NUMBER: _ClassVar[int]
    DRAM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    STORE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    FILE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAM_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    STALE_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    STALE_GENERATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BACK_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BACK_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BACK_DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BACK_NOT_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_ASKED_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_SKETCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADMIT_AFTER_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BACK_MAP_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BACK_MAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BACK_REFUSED_FIELD_NUMBER: _ClassVar[int]
    SCOPED_FIELD_NUMBER: _ClassVar[int]
    entries: int
    stored_bytes: int
    buckets: _containers.RepeatedCompositeFieldContainer[BucketStats]
    dram_bytes: int
    dram_capacity_bytes: int
    dram_hits: int
    dram_misses: int
    dram_evictions: int
    store_evictions: int
    raw_bytes: int
    file_bytes: int
    max_bytes: int
    dram_entries: int
    stale_generations: int
    stale_generation_bytes: int
    written_back_entries: int
    written_back_bytes: int
    written_back_duplicates: int
    written_back_not_admitted: int
    admission_asked: int
    admission_admitted: int
    admission_sketch_bytes: int
    admit_after: int
    written_back_map_entries: int
    written_back_map_bytes: int
    written_back_refused: int
    scoped: bool
    def __init__(self, entries: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., buckets: _Optional[_Iterable[_Union[BucketStats, _Mapping]]] = ..., dram_bytes: _Optional[int] = ..., dram_capacity_bytes: _Optional[int] = ..., dram_hits: _Optional[int] = ..., dram_misses: _Optional[int] = ..., dram_evictions: _Optional[int] = ..., store_evictions: _Optional[int] = ..., raw_bytes: _Optional[int] = ..., file_bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ..., dram_entries: _Optional[int] = ..., stale_generations: _Optional[int] = ..., stale_generation_bytes: _Optional[int] = ..., written_back_entries: _Optional[int] = ..., written_back_bytes: _Optional[int] = ..., written_back_duplicates: _Optional[int] = ..., written_back_not_admitted: _Optional[int] = ..., admission_asked: _Optional[int] = ..., admission_admitted: _Optional[int] = ..., admission_sketch_bytes: _Optional[int] = ..., admit_after: _Optional[int] = ..., written_back_map_entries: _Optional[int] = ..., written_back_map_bytes: _Optional[int] = ..., written_back_refused: _Optional[int] = ..., scoped: _Optional[bool] = ...) -> None: ...

class ListEntriesRequest(_message.Message):
    __slots__ = ("namespace", "maps_only", "writer")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MAPS_ONLY_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    maps_only: bool
    writer: str
    def __init__(self, namespace: _Optional[str] = ..., maps_only: _Optional[bool] = ..., writer: _Optional[str] = ...) -> None: ...

class StoredEntry(_message.Message):
    __slots__ = ("entry_id", "length", "token_hash", "token_ids", "has_maps", "has_feature", "writer")
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_MAPS_FIELD_NUMBER: _ClassVar[int]
    HAS_FEATURE_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    entry_id: int
    length: int
    token_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_maps: bool
    has_feature: bool
    writer: str
    def __init__(self, entry_id: _Optional[int] = ..., length: _Optional[int] = ..., token_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., has_maps: _Optional[bool] = ..., has_feature: _Optional[bool] = ..., writer: _Optional[str] = ...) -> None: ...

class EntryFeature(_message.Message):
    __slots__ = ("entry_id", "feature")
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    entry_id: int
    feature: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, entry_id: _Optional[int] = ..., feature: _Optional[_Iterable[float]] = ...) -> None: ...

class SetFeaturesRequest(_message.Message):
    __slots__ = ("namespace", "projector_version", "features")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PROJECTOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    projector_version: int
    features: _containers.RepeatedCompositeFieldContainer[EntryFeature]
    def __init__(self, namespace: _Optional[str] = ..., projector_version: _Optional[int] = ..., features: _Optional[_Iterable[_Union[EntryFeature, _Mapping]]] = ...) -> None: ...

class SetFeaturesResponse(_message.Message):
    __slots__ = ("updated", "missing")
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    updated: int
    missing: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, updated: _Optional[int] = ..., missing: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefixChain(_message.Message):
    __slots__ = ("chain_hashes",)
    CHAIN_HASHES_FIELD_NUMBER: _ClassVar[int]
    chain_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, chain_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrefixMatchRequest(_message.Message):
    __slots__ = ("namespace", "fingerprint", "block_size", "rows")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    fingerprint: str
    block_size: int
    rows: _containers.RepeatedCompositeFieldContainer[PrefixChain]
    def __init__(self, namespace: _Optional[str] = ..., fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., rows: _Optional[_Iterable[_Union[PrefixChain, _Mapping]]] = ...) -> None: ...

class PrefixMatchResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, blocks: _Optional[_Iterable[int]] = ...) -> None: ...

class FetchPrefixRequest(_message.Message):
    __slots__ = ("namespace", "fingerprint", "block_size", "rows")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    fingerprint: str
    block_size: int
    rows: _containers.RepeatedCompositeFieldContainer[PrefixChain]
    def __init__(self, namespace: _Optional[str] = ..., fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., rows: _Optional[_Iterable[_Union[PrefixChain, _Mapping]]] = ...) -> None: ...

class PrefixFrame(_message.Message):
    __slots__ = ("row", "part", "dtype", "shape", "data", "crc32c", "error")
    ROW_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    row: int
    part: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    crc32c: int
    error: RowError
    def __init__(self, row: _Optional[int] = ..., part: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., error: _Optional[_Union[RowError, _Mapping]] = ...) -> None: ...

class PrefixArray(_message.Message):
    __slots__ = ("dtype", "shape", "data", "crc32c")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    crc32c: int
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ...) -> None: ...

class PrefixBlockPut(_message.Message):
    __slots__ = ("chain_hash", "parent", "kv", "hidden", "token_ids")
    CHAIN_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    chain_hash: bytes
    parent: bytes
    kv: PrefixArray
    hidden: PrefixArray
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, chain_hash: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., kv: _Optional[_Union[PrefixArray, _Mapping]] = ..., hidden: _Optional[_Union[PrefixArray, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PutPrefixRequest(_message.Message):
    __slots__ = ("namespace", "fingerprint", "layout", "blocks")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    fingerprint: str
    layout: PrefixLayout
    blocks: _containers.RepeatedCompositeFieldContainer[PrefixBlockPut]
    def __init__(self, namespace: _Optional[str] = ..., fingerprint: _Optional[str] = ..., layout: _Optional[_Union[PrefixLayout, _Mapping]] = ..., blocks: _Optional[_Iterable[_Union[PrefixBlockPut, _Mapping]]] = ...) -> None: ...

class PutPrefixResponse(_message.Message):
    __slots__ = ("stored", "duplicates", "bytes", "not_admitted")
    STORED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NOT_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    duplicates: int
    bytes: int
    not_admitted: int
    def __init__(self, stored: _Optional[int] = ..., duplicates: _Optional[int] = ..., bytes: _Optional[int] = ..., not_admitted: _Optional[int] = ...) -> None: ...

class ChunkLayout(_message.Message):
    __slots__ = ("layers", "kv_heads", "head_dim", "dtype")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    def __init__(self, layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class ChunkMatchRequest(_message.Message):
    __slots__ = ("namespace", "fingerprint", "layout", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    fingerprint: str
    layout: ChunkLayout
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., fingerprint: _Optional[str] = ..., layout: _Optional[_Union[ChunkLayout, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ChunkMatchResponse(_message.Message):
    __slots__ = ("lengths",)
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class FetchChunksRequest(_message.Message):
    __slots__ = ("namespace", "fingerprint", "layout", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    fingerprint: str
    layout: ChunkLayout
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., fingerprint: _Optional[str] = ..., layout: _Optional[_Union[ChunkLayout, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ChunkData(_message.Message):
    __slots__ = ("chunk", "layer", "dtype", "shape", "data", "crc32c", "error")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    chunk: int
    layer: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    crc32c: int
    error: RowError
    def __init__(self, chunk: _Optional[int] = ..., layer: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., error: _Optional[_Union[RowError, _Mapping]] = ...) -> None: ...

class ChunkPut(_message.Message):
    __slots__ = ("key", "dtype", "shape", "data", "crc32c", "token_ids", "context_ids")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    crc32c: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    context_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., context_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PutChunksRequest(_message.Message):
    __slots__ = ("namespace", "fingerprint", "layout", "chunks")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    fingerprint: str
    layout: ChunkLayout
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkPut]
    def __init__(self, namespace: _Optional[str] = ..., fingerprint: _Optional[str] = ..., layout: _Optional[_Union[ChunkLayout, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[ChunkPut, _Mapping]]] = ...) -> None: ...

class PutChunksResponse(_message.Message):
    __slots__ = ("stored", "duplicates", "bytes", "not_admitted")
    STORED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NOT_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    duplicates: int
    bytes: int
    not_admitted: int
    def __init__(self, stored: _Optional[int] = ..., duplicates: _Optional[int] = ..., bytes: _Optional[int] = ..., not_admitted: _Optional[int] = ...) -> None: ...

class DropWriterRequest(_message.Message):
    __slots__ = ("namespace", "writer", "dry_run")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    writer: str
    dry_run: bool
    def __init__(self, namespace: _Optional[str] = ..., writer: _Optional[str] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class DropWriterResponse(_message.Message):
    __slots__ = ("prefix_blocks", "chunks")
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    prefix_blocks: int
    chunks: int
    def __init__(self, prefix_blocks: _Optional[int] = ..., chunks: _Optional[int] = ...) -> None: ...

class ReportMismatchRequest(_message.Message):
    __slots__ = ("namespace", "fingerprint", "kind", "key", "detail")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    fingerprint: str
    kind: str
    key: bytes
    detail: str
    def __init__(self, namespace: _Optional[str] = ..., fingerprint: _Optional[str] = ..., kind: _Optional[str] = ..., key: _Optional[bytes] = ..., detail: _Optional[str] = ...) -> None: ...

class QuarantinedObject(_message.Message):
    __slots__ = ("namespace", "kind", "key", "writer", "entry_id", "has_entry_id", "reporter", "detail", "since")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    REPORTER_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    kind: str
    key: bytes
    writer: str
    entry_id: int
    has_entry_id: bool
    reporter: str
    detail: str
    since: float
    def __init__(self, namespace: _Optional[str] = ..., kind: _Optional[str] = ..., key: _Optional[bytes] = ..., writer: _Optional[str] = ..., entry_id: _Optional[int] = ..., has_entry_id: _Optional[bool] = ..., reporter: _Optional[str] = ..., detail: _Optional[str] = ..., since: _Optional[float] = ...) -> None: ...

class ReportMismatchResponse(_message.Message):
    __slots__ = ("found", "quarantined", "object")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    found: bool
    quarantined: bool
    object: QuarantinedObject
    def __init__(self, found: _Optional[bool] = ..., quarantined: _Optional[bool] = ..., object: _Optional[_Union[QuarantinedObject, _Mapping]] = ...) -> None: ...

class ListQuarantineRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class ListQuarantineResponse(_message.Message):
    __slots__ = ("objects",)
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    objects: _containers.RepeatedCompositeFieldContainer[QuarantinedObject]
    def __init__(self, objects: _Optional[_Iterable[_Union[QuarantinedObject, _Mapping]]] = ...) -> None: ...

class ReleaseQuarantineRequest(_message.Message):
    __slots__ = ("namespace", "kind", "key", "drop")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DROP_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    kind: str
    key: bytes
    drop: bool
    def __init__(self, namespace: _Optional[str] = ..., kind: _Optional[str] = ..., key: _Optional[bytes] = ..., drop: _Optional[bool] = ...) -> None: ...

class ReleaseQuarantineResponse(_message.Message):
    __slots__ = ("object", "dropped")
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    object: QuarantinedObject
    dropped: bool
    def __init__(self, object: _Optional[_Union[QuarantinedObject, _Mapping]] = ..., dropped: _Optional[bool] = ...) -> None: ...
