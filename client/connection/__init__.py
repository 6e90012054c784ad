"""The client's view of a store: ``connect(url)`` (``connect``) gives a daemon (``remote``, over the
synchronous ``daemon`` client, its ``channel`` and the ``resend`` loop of read-only streams) or an embedded
store (``local``) behind one small interface (``base``)."""

from attnstore_client.connection.base import (
    URL_SCHEMES,
    ChunkPutCounts,
    MapStream,
    Match,
    MatchKind,
    MismatchReport,
    NamespaceHandle,
    PrefixPutCounts,
    PrefixStream,
    RefusedRow,
    RowToWrite,
    StoreConnection,
    WriteBackCounts,
)
from attnstore_client.connection.connect import connect

__all__ = [
    "URL_SCHEMES", "ChunkPutCounts", "MapStream", "Match", "MatchKind", "MismatchReport", "NamespaceHandle",
    "PrefixPutCounts", "PrefixStream", "RefusedRow", "RowToWrite", "StoreConnection", "WriteBackCounts", "connect",
]
