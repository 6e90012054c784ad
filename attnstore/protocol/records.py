"""Value objects of the map store: namespace layout and info, new entries, entry info.

These are the types other components code against; they import neither lmdb nor
zarr, so any module may use them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np

from attnstore.errors import ConfigError, shown
from attnstore.protocol.keys import TokenHash

if TYPE_CHECKING:
    import torch

Codec = Literal["fp16", "zstd", "q8", "q8+zstd"]
MapDtype = Literal["float16"]

CODECS: tuple[str, ...] = get_args(Codec)
MAP_DTYPES: tuple[str, ...] = get_args(MapDtype)

# Version of the on-disk format (records, keys, zarr layout). Bumped on any
# incompatible change; stores of another version are refused, never guessed at.
FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS: frozenset[int] = frozenset({1})

# sha256 of the token ids: the exact-tier key.

# Namespace names become zarr paths and LMDB key prefixes: no "/" and no NUL.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


def is_namespace_name(name: object) -> bool:
    """True if ``name`` is a valid namespace name (see :func:`check_namespace_name`)."""
    return isinstance(name, str) and _NAME_RE.fullmatch(name) is not None


def check_namespace_name(name: str) -> str:
    """Return ``name`` if it is a valid namespace name.

    Raises:
        ConfigError: ``name`` is empty, too long or has characters other than
            letters, digits, ``_``, ``.`` and ``-`` (first character alphanumeric).
    """
    if not is_namespace_name(name):
        raise ConfigError(
            f"namespace name {shown(name)} is invalid: use 1-128 letters, digits, '_', '.' or '-',"
            " starting with a letter or digit"
        )
    return name


def check_entry_ids(ids: Iterable[object]) -> list[int]:
    """``ids`` as a list of ints, once every one is a valid entry id: 1 to 2**63 - 1 (int64 vector index keys).

    Raises:
        ConfigError: the first id that is not one, named with its position.
    """
    checked = []
    for position, entry_id in enumerate(ids):
        if isinstance(entry_id, bool) or not isinstance(entry_id, int | np.integer) or not 0 < entry_id < 2**63:
            raise ConfigError(f"entry id {shown(entry_id, 40)} (position {position}) is not an int in [1, 2**63)")
        checked.append(int(entry_id))
    return checked


def _positive_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{owner}.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class NamespaceLayout:
    """Shape and encoding of every entry of one namespace.

    Raises:
        ConfigError: a count is not a positive int, or ``dtype``/``codec`` is not
            one of the supported choices.
    """

    layers: int  # transformer layers whose maps are stored
    heads: int  # query heads per layer (GQA: maps are per query head)
    causal: bool  # causal maps are lower-triangular; longer entries can be cropped
    hidden: int  # width of the stored final outputs (exact tier)
    feature_dim: int = 128  # projector output dimension
    dtype: MapDtype = "float16"  # stored map dtype; maps are computed in fp32
    codec: Codec = "fp16"  # how stored maps are encoded; q8 variants are lossy and opt-in

    def __post_init__(self) -> None:
        for name in ("layers", "heads", "hidden", "feature_dim"):
            _positive_int("NamespaceLayout", name, getattr(self, name))
        if not isinstance(self.causal, bool):
            raise ConfigError(f"NamespaceLayout.causal must be a bool, got {self.causal!r}")
        if self.dtype not in MAP_DTYPES:
            raise ConfigError(f"NamespaceLayout.dtype {shown(self.dtype)} is not supported; choose one of {MAP_DTYPES}")
        if self.codec not in CODECS:
            raise ConfigError(f"NamespaceLayout.codec {shown(self.codec)} is not supported; choose one of {CODECS}")

    def map_shape(self, length: int) -> tuple[int, int, int, int]:
        """Shape ``(layers, heads, L, L)`` of one entry's maps of token length ``length``."""
        return (self.layers, self.heads, length, length)

    def map_nbytes(self, length: int) -> int:
        """Decoded (fp16) size in bytes of one entry's maps of token length ``length``."""
        return 2 * math.prod(self.map_shape(length))

    def outputs_nbytes(self, length: int) -> int:
        """Size in bytes of one entry's fp16 final outputs ``(L, hidden)``."""
        return 2 * length * self.hidden

    def to_json_dict(self) -> dict[str, Any]:
        """Plain dict for JSON (catalog records, zarr attributes, the wire)."""
        return {
            "layers": self.layers,
            "heads": self.heads,
            "causal": self.causal,
            "hidden": self.hidden,
            "feature_dim": self.feature_dim,
            "dtype": self.dtype,
            "codec": self.codec,
        }

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> NamespaceLayout:
        """Inverse of :meth:`to_json_dict`.

        Raises:
            ConfigError: a field is missing or invalid.
        """
        try:
            return cls(
                layers=data["layers"],
                heads=data["heads"],
                causal=data["causal"],
                hidden=data["hidden"],
                feature_dim=data["feature_dim"],
                dtype=data["dtype"],
                codec=data["codec"],
            )
        except KeyError as exc:
            raise ConfigError(f"namespace layout is missing field {exc.args[0]!r}") from None


@dataclass(frozen=True, slots=True)
class TokenLimits:
    """The model's limits on a row: what the daemon checks written-back token ids against.

    Raises:
        ConfigError: a limit is not a positive int.
    """

    vocab_size: int  # token ids are in [0, vocab_size)
    max_length: int  # tokens per row at most (the model's position embeddings)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_length"):
            _positive_int("TokenLimits", name, getattr(self, name))


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    """One namespace: a model, its fingerprint, its layout and its projector."""

    name: str
    model: str  # model id, informational (e.g. "HuggingFaceTB/SmolLM2-135M-Instruct")
    fingerprint: str  # sha256 hex over config, vocabulary and weights digest
    layout: NamespaceLayout
    format_version: int  # store format version the namespace was written in
    created: float  # unix time
    projector: bytes | None = field(default=None, repr=False)  # safetensors blob
    # 0 without a projector, 1 for the first, +1 on each replacement: which projector made the stored features
    projector_version: int = 0
    projector_crc32c: int | None = None  # of the blob, recorded when stored (None in stores written before)
    limits: TokenLimits | None = None  # None: created before limits were recorded (write-back refused)

    def to_json_dict(self) -> dict[str, Any]:
        """Plain dict for JSON, without the projector blob (stored apart as raw bytes)."""
        data: dict[str, Any] = {
            "name": self.name,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "layout": self.layout.to_json_dict(),
            "format_version": self.format_version,
            "created": self.created,
            "projector_version": self.projector_version,
        }
        if self.projector_crc32c is not None:
            data["projector_crc32c"] = self.projector_crc32c
        if self.limits is not None:
            data["vocab_size"], data["max_length"] = self.limits.vocab_size, self.limits.max_length
        return data

    @classmethod
    def from_json_dict(cls, data: dict[str, Any], projector: bytes | None) -> NamespaceInfo:
        """Inverse of :meth:`to_json_dict`, with the projector blob added back.

        Records written before projector versions count a stored projector as version 1; records
        written before token limits have none.

        Raises:
            KeyError, TypeError, ValueError: a field is missing or of the wrong type (a damaged record).
        """
        crc = data.get("projector_crc32c")
        limits = TokenLimits(int(data["vocab_size"]), int(data["max_length"])) if "vocab_size" in data else None
        return cls(
            name=data["name"],
            model=data["model"],
            fingerprint=data["fingerprint"],
            layout=NamespaceLayout.from_json_dict(data["layout"]),
            format_version=int(data["format_version"]),
            created=float(data["created"]),
            projector=projector,
            projector_version=int(data.get("projector_version", 0 if projector is None else 1)),
            projector_crc32c=None if crc is None else int(crc),
            limits=limits,
        )


@dataclass(frozen=True, slots=True)
class NewEntry:
    """One input to ingest: its maps, exact-tier key, final outputs, feature vector and token ids.

    ``maps`` may be None for an exact-tier-only entry (a node's written-back row): then
    ``outputs`` is required, and the entry is never searched or replayed.
    """

    maps: np.ndarray | torch.Tensor | None  # (layers, heads, L, L) fp32 or fp16; None: outputs only
    token_hash: TokenHash  # sha256 of the token ids (32 bytes): exact-tier key (``protocol.keys``)
    outputs: np.ndarray | torch.Tensor | None = None  # (L, hidden) last hidden states, stored fp16
    feature: np.ndarray | torch.Tensor | None = None  # (feature_dim,) projector output, stored fp32
    # (L,) the input's token ids, stored uint32: what the fidelity gate compares queries with
    token_ids: Sequence[int] | np.ndarray | None = None
    writer: str | None = None  # the name of the token that wrote it back (None: an admin ingested it)


@dataclass(frozen=True, slots=True)
class EntryRef:
    """A live entry found by its token hash: its id and token length."""

    id: int
    length: int


@dataclass(frozen=True, slots=True)
class EntryInfo:
    """Metadata of one live entry (no maps)."""

    id: int
    length: int  # token length L
    token_hash: TokenHash
    created: float  # unix time of ingest
    hits: int  # times served, including hits not yet flushed to disk
    last_hit: float  # unix time of the last hit; 0.0 if never hit
    feature: np.ndarray | None = field(compare=False)  # (feature_dim,) float32
    nbytes: int  # stored bytes of the entry's stored objects (maps and outputs)
    token_ids: np.ndarray | None = field(default=None, compare=False)  # (L,) uint32; None if not stored
    has_maps: bool = True  # False: outputs only (written back for the exact tier), never searched or replayed
    writer: str | None = None  # the name of the token that wrote it back (None: an admin ingested it)


@dataclass(frozen=True, slots=True)
class LookupBatch:
    """One batch lookup, as every store connection (a daemon, an embedded store) is asked it.

    Raises:
        ConfigError: ``features`` is not ``(B, d)`` with one length (and hash, token ids) per row.
    """

    namespace: str
    fingerprint: str  # the caller's model fingerprint; must equal the namespace's
    features: np.ndarray  # (B, feature_dim) float32 projector outputs
    lengths: Sequence[int]  # each row's token length
    token_hashes: Sequence[bytes | None] | None = None  # exact-tier keys (None: the exact tier is skipped)
    # Each row's token ids (a sequence of ints, or a 1-D array or tensor); needed when gated.
    token_ids: Sequence[Sequence[int] | np.ndarray | torch.Tensor] | None = None
    max_distance: float = 0.0  # threshold on the predicted map distance (ignored when gated)
    gate: bool = False  # decide map hits with the namespace's fidelity gate
    # The namespace's projector_version the features come from; 0 states none (see ProjectorChangedError)
    projector_version: int = 0

    def __post_init__(self) -> None:
        features = np.asarray(self.features, dtype=np.float32)
        rows = len(self.lengths)
        if features.ndim != 2 or len(features) != rows:
            raise ConfigError(
                f"LookupBatch: features must be (B, d) with one length per row; got {features.shape} and {rows} lengths"
            )
        for name in ("token_hashes", "token_ids"):
            given = getattr(self, name)
            if given is not None and len(given) != rows:
                raise ConfigError(f"LookupBatch: {len(given)} {name} for {rows} rows")
        object.__setattr__(self, "features", features)

    @property
    def size(self) -> int:
        """Rows in the batch."""
        return len(self.lengths)

    @property
    def exact(self) -> bool:
        """Whether the exact tier is consulted (token hashes given)."""
        return self.token_hashes is not None
