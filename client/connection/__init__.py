"""The client's view of a store: ``connect(url)`` gives a daemon (``remote``) or an
embedded store (``local``) behind one small interface (``base``)."""

from attnstore_client.connection.base import (
    URL_SCHEMES,
    MapStream,
    Match,
    MatchKind,
    NamespaceHandle,
    PrefixStream,
    RefusedRow,
    RowToWrite,
    StoreConnection,
    WriteBackCounts,
    connect,
)

__all__ = [
    "URL_SCHEMES", "MapStream", "Match", "MatchKind", "NamespaceHandle", "PrefixStream", "RefusedRow", "RowToWrite",
    "StoreConnection", "WriteBackCounts", "connect",
]
