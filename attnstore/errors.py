"""Every error AttnStore raises on purpose.

Each class also inherits the built-in exception a caller would naturally catch
(``KeyError`` for a missing entry, ``ValueError`` for bad input), so code that
does not know AttnStore still handles them sensibly. Backend errors (lmdb, faiss,
grpc) are translated into these where they enter our code.
"""

from __future__ import annotations

# Longest piece of a request a message repeats: error details travel in gRPC trailers,
# whose size is capped, and a client's own input needs no echo in full.
ECHO_CHARS = 64


def shown(value: object, limit: int = ECHO_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages that name a caller's input.

    A longer repr ends in ``...`` and its full length, so the message still says what was wrong.
    """
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


class AttnStoreError(Exception):
    """Base class of every AttnStore error."""


class ConfigError(AttnStoreError, ValueError):
    """A setting, alias or option is not one of the supported choices."""


class UnsupportedModelError(AttnStoreError, ValueError):
    """The model's architecture has no adapter."""


class MapShapeError(AttnStoreError, ValueError):
    """Attention maps do not match the model or namespace (shape, length, heads, dtype)."""


class NamespaceNotFoundError(AttnStoreError, KeyError):
    """No namespace of that name exists in the store."""


class NamespaceExistsError(AttnStoreError, FileExistsError):
    """A namespace of that name already exists with a different fingerprint or layout, or another projector
    that the request did not ask to replace."""


class FingerprintMismatchError(AttnStoreError, ValueError):
    """A request's model fingerprint or layout differs from the namespace's."""


class ProjectorChangedError(AttnStoreError, ValueError):
    """A request was made with a projector version the namespace no longer has (it was replaced).

    Its feature vectors come from the old projector and would be compared with the new one's:
    fetch the namespace again (its projector and ``projector_version``) and re-project.
    """


class EntryNotFoundError(AttnStoreError, KeyError):
    """No live entry has that id."""


class ChecksumError(AttnStoreError, IOError):
    """Stored bytes do not match their checksum: the entry is corrupt and is never served."""


class PrefixBlockError(AttnStoreError):
    """A block of a row's prefix chain cannot be served; ``block`` is its position in the chain (from 0) and
    ``chain_hash`` its key: the row's stored prefix ends before it."""

    def __init__(self, message: str, *, block: int, chain_hash: bytes) -> None:
        super().__init__(message)
        self.block = block
        self.chain_hash = chain_hash


class PrefixBlockCorruptError(PrefixBlockError, ChecksumError):
    """A stored prefix block fails its checksum (see ``PrefixBlockError``)."""


class PrefixBlockMissingError(PrefixBlockError, EntryNotFoundError):
    """A prefix block is not stored, or is not the child of the block before it in the row's chain (a chain is
    served only from its first block on; see ``PrefixBlockError``)."""


class FormatVersionError(AttnStoreError, ValueError):
    """The store on disk was written in a format version this code does not read."""


class StoreFullError(AttnStoreError, OSError):
    """The store's map size or disk is full; nothing of the failed write is visible."""


class StorageError(AttnStoreError, OSError):
    """The store's storage failed under a call (an I/O error); details are in the log."""


class StoreUnsafeError(AttnStoreError, RuntimeError):
    """The store cannot take writes now: Redis lost the store's data (its marker is gone), or runs a maxmemory
    policy that evicts more than entries. Writes are taken again once the cause is fixed."""


class StoreDamagedError(StorageError):
    """The store's database structure is damaged (LMDB found a page of the wrong kind, or none, or an
    unreadable record): restore the store from a backup. ``verify`` lists what it can reach."""


class CorpusError(AttnStoreError, ValueError):
    """A build corpus is empty, unreadable or too small to train on."""


class VectorIndexError(AttnStoreError, ValueError):
    """Vectors, ids or serialised bytes handed to a vector index are invalid."""


class FeatureSourceError(AttnStoreError, ValueError):
    """A feature source (input embedding) handed to the projector has the wrong shape or holds NaN/Inf."""


class WireFormatError(AttnStoreError, ValueError):
    """A message on the wire is malformed: bad shape, dtype, offsets or sizes."""


class StoreNotFoundError(AttnStoreError, FileNotFoundError):
    """No map store exists at that path (and it was not asked to be created), or its directory was
    removed while the store was open (writes are then refused)."""


class StoreOpenError(AttnStoreError, OSError):
    """A map store cannot be opened: another writer holds it, or this process has it open already."""


class ReadOnlyStoreError(AttnStoreError, PermissionError):
    """A write was attempted on a map store opened read-only."""


class RequestLimitError(AttnStoreError, ValueError):
    """A request exceeds a limit of the daemon (queries or ids per call, staged ingest bytes, concurrent
    streams, the idle time of an Ingest stream)."""


class AuthError(AttnStoreError, PermissionError):
    """The daemon refused the request's token: missing, unknown, or not allowed to make that call."""


class UnavailableError(AttnStoreError, ConnectionError):
    """The daemon is not serving right now (loading, draining, unreachable, past the deadline); retry later."""


class RemoteError(AttnStoreError, RuntimeError):
    """The daemon answered with an error status no more specific AttnStore error describes."""


class DaemonProcessError(AttnStoreError, RuntimeError):
    """A daemon started as a child process exited at start, did not serve in time, or did not stop."""


class NamespaceNotReadyError(AttnStoreError, LookupError):
    """A namespace exists but cannot serve clients yet: it has no projector (a build is running or was killed)."""


class MapsUnavailableError(AttnStoreError, LookupError):
    """A hit row's maps or outputs could not be delivered (row error, checksum, outage mid-stream).

    Raised inside the client while it replays; the row is computed instead.
    ``row`` is the batch row, ``cause`` the fallback cause (see ``attnstore_client.resilience``).
    """

    def __init__(self, message: str, *, row: int, cause: str) -> None:
        super().__init__(message)
        self.row = row
        self.cause = cause


class MapsNotStoredError(EntryNotFoundError):
    """The entry stores outputs only (written back by a node for the exact tier): it has no maps to replay."""


class WriteBackOffError(AttnStoreError, RuntimeError):
    """Write-back is turned off where it was asked for (the daemon runs with ``--admit-after 0``, or the
    client is embedded: write-back needs the daemon)."""


class UnwrittenRowError(AttnStoreError, RuntimeError):
    """A call ended with an input row its sink never received: an internal error, raised instead of a garbage row."""
