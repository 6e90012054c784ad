"""The client's view of a store: one small interface, a daemon or an embedded store behind it.

``connect("grpc://HOST:PORT")`` (``connection.connect``) talks to a daemon (``attnstore serve``);
``connect("local:PATH")`` opens the store at PATH in this process (embedded
mode: the same store and index, no server). A call goes to the store in three
steps, each asked only for the rows that need it: ``exact`` (stored outputs of
rows whose tokens are stored, by token hash alone), ``search`` (the map tier:
which stored entry each row may replay) and ``fetch_maps`` (those entries' maps,
layer by layer, so a forward may start replaying layer 0 before the last layer
has arrived). The prefix and chunk tiers of causal models have calls of their
own (``prefix_layout``/``match_prefix``/``fetch_prefix``/``put_prefix``,
``match_chunks``/``fetch_chunks``/``put_chunks``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import crc32c
import numpy as np

from attnstore.errors import AttnStoreError, ChecksumError, EntryNotFoundError, MapsUnavailableError, WriteBackOffError
from attnstore.protocol.chunks import ChunkLayout, StoredChunk
from attnstore.protocol.prefix import PrefixBlock, PrefixLayout
from attnstore.protocol.records import LookupBatch

MatchKind = Literal["miss", "exact", "map"]
URL_SCHEMES: tuple[str, ...] = ("grpc://", "grpcs://", "local:")


@dataclass(frozen=True, slots=True)
class NamespaceHandle:
    """What a client needs of a namespace: its model, layout and projector."""

    name: str
    model: str  # the model name it was built with
    fingerprint: str  # model_fingerprint of that model; requests must carry the same
    layers: int
    heads: int
    causal: bool
    hidden: int
    feature_dim: int
    projector: bytes | None  # safetensors bytes; None until a build has finished
    projector_version: int = 0  # 0 without a projector; +1 each time the namespace's is replaced
    prefix: PrefixLayout | None = None  # how it stores prefix blocks (causal models); None: it stores none
    chunks: ChunkLayout | None = None  # how it stores chunks (the chunk tier); None: it stores none


@dataclass(frozen=True, slots=True)
class RowToWrite:
    """One computed row a node writes back."""

    token_ids: Sequence[int]  # (L,)
    outputs: np.ndarray  # (L, hidden) last hidden states
    maps: np.ndarray | None = None  # (layers, heads, L, L) probabilities; None: outputs only (exact tier)
    feature: np.ndarray | None = None  # (feature_dim,) the projector output of its map lookup; only with maps
    projector_version: int = 0  # the namespace's projector version ``feature`` came from


@dataclass(frozen=True, slots=True)
class RefusedRow:
    """A row of a write-back call the store refused on its own; the call's other rows were judged as usual."""

    row: int  # its index in the rows of the call
    code: str  # a status code name: INVALID_ARGUMENT (a bad row), FAILED_PRECONDITION (a stale projector
    # version: project again), DATA_LOSS (its bytes were damaged on the way)
    message: str  # why, naming the bad value


@dataclass(frozen=True, slots=True)
class WriteBackCounts:
    """What the store did with one write-back call."""

    stored: int  # new entries
    duplicates: int  # rows stored already (another node was first)
    not_admitted: int  # rows the store's admission rule skipped
    maps_stored: int = 0  # of the new entries, those stored with maps
    refused: tuple[RefusedRow, ...] = ()  # rows refused one by one (the rest of the call was stored)


def checked_projector(name: str, projector: bytes | None, crc: int | None) -> bytes | None:
    """``projector``, once it matches the crc32c the store recorded for it (None: none recorded).

    Raises:
        ChecksumError: the bytes differ from what the store recorded: its weights are damaged.
    """
    if projector is not None and crc is not None and crc32c.crc32c(projector) != crc:
        raise ChecksumError(
            f"the projector of namespace {name!r} fails its crc32c check: its stored weights are damaged"
            " (admin verify reports it; store it again)"
        )
    return projector


@dataclass(frozen=True, slots=True)
class ChunkPutCounts:
    """What the store did with one put of chunks."""

    stored: int  # chunks new to the store
    duplicates: int  # chunks it had already
    not_admitted: int = 0  # chunks the store skipped: not asked for by --admit-after writers yet


@dataclass(frozen=True, slots=True)
class PrefixPutCounts:
    """What the store did with one put of prefix blocks."""

    stored: int  # blocks new to the store
    duplicates: int  # blocks it had already
    not_admitted: int = 0  # blocks the store skipped: not asked for by --admit-after writers yet (or after one)


@dataclass(frozen=True, slots=True)
class MismatchReport:
    """What the store did with a reported mismatch (``StoreConnection.report_mismatch``)."""

    found: bool  # an object is stored under the key
    quarantined: bool  # this report quarantined it (False: it already was, or nothing is stored)
    writer: str | None  # the token name that stored it (None: an admin ingested it, or nothing is stored)
    entry_id: int | None = None  # a row's entry id


@dataclass(frozen=True, slots=True)
class Match:
    """The store's answer for one row."""

    kind: MatchKind
    entry_id: int | None  # None on a miss
    distance: float  # predicted map distance (0 for exact hits)
    stored_length: int | None  # the entry's length (>= the row's for a causal crop); None on a miss


class MapStream(ABC):
    """The maps of chosen rows (one stored entry and a crop length each), layer by layer as they arrive.

    Attributes:
        bytes_fetched: array bytes received so far.
        fetch_seconds: time spent receiving (with streaming, overlapped with the forward).
        outage: the error that broke the stream for every remaining row, if one did.
    """

    def __init__(self) -> None:
        self.bytes_fetched = 0
        self.fetch_seconds = 0.0
        self.outage: BaseException | None = None

    @abstractmethod
    def layer(self, row: int, layer: int) -> np.ndarray:
        """One row's maps for one layer, ``(heads, L, L)``, blocking until they arrive.

        Raises:
            MapsUnavailableError: the row's maps cannot be delivered (its ``cause`` says why).
        """

    @abstractmethod
    def failed(self) -> dict[int, str]:
        """Rows known not to be deliverable so far, with their fallback causes."""

    @abstractmethod
    def wait(self) -> None:
        """Block until every row has arrived in full or failed."""

    def close(self) -> None:  # noqa: B027 (optional: a stream that holds nothing has nothing to close)
        """Stop receiving (a no-op once everything arrived)."""


class PrefixStream(ABC):
    """The stored prefixes of chosen rows, one part (a layer, or the hidden states) at a time as the forward asks.

    Attributes:
        bytes_fetched: array bytes received so far.
        fetch_seconds: time spent receiving.
    """

    def __init__(self) -> None:
        self.bytes_fetched = 0
        self.fetch_seconds = 0.0

    @abstractmethod
    def layer(self, row: int, layer: int) -> np.ndarray:
        """One row's keys and values of one layer, ``(2, kv_heads, p, head_dim)``.

        Raises:
            MapsUnavailableError: the row's prefix cannot be delivered (its ``cause`` says why).
        """

    @abstractmethod
    def hidden(self, row: int) -> np.ndarray:
        """One row's last hidden states over its prefix, ``(p, hidden)``.

        Raises:
            MapsUnavailableError: as :meth:`layer`.
        """

    def close(self) -> None:  # noqa: B027 (optional: a stream that holds nothing has nothing to close)
        """Stop receiving."""


class StoreConnection(ABC):
    """A store the client reads from. Use as a context manager, or ``close()``."""

    url: str

    @abstractmethod
    def namespace(self, name: str) -> NamespaceHandle:
        """The namespace called ``name``, with its projector.

        Raises:
            NamespaceNotFoundError: no such namespace.
            AuthError, UnavailableError: see the daemon.
        """

    @abstractmethod
    def exact(
        self, namespace: str, fingerprint: str, token_hashes: Sequence[bytes], lengths: Sequence[int], *,
        timeout: float | None,
    ) -> dict[int, np.ndarray]:
        """The stored outputs of the rows whose tokens are stored (the exact tier), nothing searched.

        Args:
            namespace, fingerprint: the namespace and the caller's model fingerprint.
            token_hashes: each row's exact-tier key.
            lengths: each row's token length (an entry of another length is not the same input).
            timeout: deadline in seconds of the whole call (None: none).

        Returns:
            Row -> its stored outputs ``(L, hidden)`` fp16, for the rows found.

        Raises:
            AttnStoreError: the call failed (the caller computes the rows).
        """

    def exact_admitting(
        self, namespace: str, fingerprint: str, token_hashes: Sequence[bytes], lengths: Sequence[int], *,
        timeout: float | None,
    ) -> tuple[dict[int, np.ndarray], frozenset[int]]:
        """As :meth:`exact`, plus the missed rows the store admits for write-back (none where it cannot take them)."""
        return self.exact(namespace, fingerprint, token_hashes, lengths, timeout=timeout), frozenset()

    @property
    def supports_write_back(self) -> bool:
        """Whether :meth:`write_back` can store rows (a daemon can; an embedded store cannot)."""
        return False

    def write_back(
        self, namespace: str, fingerprint: str, rows: Sequence[RowToWrite], *, timeout: float | None,
    ) -> WriteBackCounts:
        """Store computed rows for every node: their outputs (exact tier), and their maps where given (map tier).

        Raises:
            WriteBackOffError: this connection cannot write back (see ``supports_write_back``).
            AttnStoreError: the call failed (the rows are dropped: they are only a cache's fill).
        """
        raise WriteBackOffError(f"{type(self).__name__} cannot write back: write-back needs a daemon (grpc://)")

    @abstractmethod
    def search(self, batch: LookupBatch, *, timeout: float | None) -> list[Match]:
        """The map tier's answer for each row: which stored entry it may replay (maps are not sent).

        Raises:
            AttnStoreError: the call failed (the caller computes the rows).
        """

    @abstractmethod
    def fetch_maps(
        self, namespace: str, fingerprint: str, rows: Sequence[tuple[int, int]], *, timeout: float | None
    ) -> MapStream:
        """Start delivering the maps of ``rows``: ``(entry id, length)`` each, cropped to that length.

        Raises:
            AttnStoreError: the call failed before any map arrived (the caller computes the rows).
        """

    def prefix_layout(self, namespace: str) -> PrefixLayout | None:
        """How the namespace stores prefix blocks now (None: it stores none), read again without its projector.

        Raises:
            NamespaceNotFoundError: no such namespace.
            AttnStoreError: the call failed.
        """
        return self.namespace(namespace).prefix

    def match_prefix(
        self, namespace: str, fingerprint: str, block_size: int, rows: Sequence[Sequence[bytes]], *,
        timeout: float | None,
    ) -> list[int]:
        """Each row's stored prefix in whole blocks, from its first block on (rows: chains of block hashes).

        A connection without a prefix tier answers 0 for every row.

        Raises:
            FingerprintMismatchError: another model, or a namespace of another block size.
            AttnStoreError: the call failed (the caller computes the rows).
        """
        return [0] * len(rows)

    def fetch_prefix(
        self, namespace: str, fingerprint: str, block_size: int, rows: Sequence[Sequence[bytes]], *,
        timeout: float | None,
    ) -> PrefixStream:
        """Start delivering the stored prefixes of ``rows`` (each the chain of blocks it takes).

        Raises:
            AttnStoreError: the call failed before anything arrived (the caller computes the rows).
        """
        raise MapsUnavailableError(f"{type(self).__name__} has no prefix tier", row=0, cause="row_error")

    def put_prefix(
        self, namespace: str, fingerprint: str, layout: PrefixLayout, blocks: Sequence[PrefixBlock], *,
        timeout: float | None,
    ) -> PrefixPutCounts:
        """Store prefix blocks for every node, all or none, parents before children (the namespace takes
        ``layout`` when it records none).

        Raises:
            WriteBackOffError: this connection cannot store prefix blocks (see ``supports_write_back``).
            FingerprintMismatchError: another model, or another prefix layout.
            AttnStoreError: the call failed (nothing stored).
        """
        raise WriteBackOffError(f"{type(self).__name__} cannot store prefix blocks: that needs a daemon (grpc://)")

    def match_chunks(
        self, namespace: str, fingerprint: str, layout: ChunkLayout, keys: Sequence[bytes], *, timeout: float | None,
    ) -> list[int | None]:
        """Each chunk key's stored length in tokens, None where it is not stored (a connection without a chunk
        tier stores none).

        Raises:
            FingerprintMismatchError: another model, or a namespace of another chunk layout (or none).
            AttnStoreError: the call failed.
        """
        return [None] * len(keys)

    def fetch_chunks(
        self, namespace: str, fingerprint: str, layout: ChunkLayout, keys: Sequence[bytes], *, timeout: float | None,
    ) -> list[np.ndarray | AttnStoreError]:
        """Each chunk's keys and values ``(layers, 2, KVH, C, d)``, or what kept it: ``EntryNotFoundError``
        (not stored), ``ChecksumError`` (damaged in the store or on the way; the message names it).

        Raises:
            FingerprintMismatchError: as :meth:`match_chunks`.
            AttnStoreError: the call failed as a whole.
        """
        return [EntryNotFoundError(f"{type(self).__name__} has no chunk tier") for _ in keys]

    def put_chunks(
        self, namespace: str, fingerprint: str, layout: ChunkLayout, chunks: Sequence[StoredChunk], *,
        timeout: float | None,
    ) -> ChunkPutCounts:
        """Store chunks for every node, all or none (the namespace takes ``layout`` when it records none).

        Raises:
            WriteBackOffError: this connection cannot store chunks (see ``supports_write_back``).
            FingerprintMismatchError: another model, or another chunk layout.
            AttnStoreError: the call failed (nothing stored).
        """
        raise WriteBackOffError(f"{type(self).__name__} cannot store chunks: that needs a daemon (grpc://)")

    @property
    def supports_quarantine(self) -> bool:
        """Whether :meth:`report_mismatch` can quarantine an object (a daemon with a write or admin token, or an
        embedded store)."""
        return False

    def report_mismatch(
        self, namespace: str, fingerprint: str, kind: Literal["row", "prefix", "chunk"], key: bytes, *, detail: str,
        timeout: float | None,
    ) -> MismatchReport:
        """Report a stored object an audit found wrong: the store quarantines it (a miss for every node until an
        admin looks) and names its writer.

        Args:
            namespace, fingerprint: the namespace and the caller's model fingerprint.
            kind: ``"row"`` (key: its token hash), ``"prefix"`` (a block's chain hash) or ``"chunk"``.
            key: the object's key.
            detail: what the audit measured.
            timeout: deadline in seconds (None: none).

        Raises:
            WriteBackOffError: this connection cannot quarantine (see ``supports_quarantine``).
            AuthError: a read token (quarantine needs a write or admin token).
            AttnStoreError: the call failed.
        """
        raise WriteBackOffError(f"{type(self).__name__} cannot quarantine stored objects")

    @abstractmethod
    def health(self) -> str:
        """``"SERVING"`` when the store answers lookups, else another health status name."""

    @property
    def resident_bytes(self) -> int:
        """Memory the store takes in this process: its indexes in embedded mode; nothing for a daemon's."""
        return 0

    @abstractmethod
    def close(self) -> None:
        """Release the channel or the store. Idempotent."""

    def __enter__(self) -> StoreConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
