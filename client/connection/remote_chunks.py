"""The chunk tier over a daemon: ChunkMatch, a FetchChunks stream received whole, and PutChunks.

The chunk tier asks for a prompt's chunks before its fused forward, which needs
every layer of them at once, so a FetchChunks stream is received whole (sent
again, whole, on UNAVAILABLE where there are other daemons, see
``resend.read_whole``). A chunk the daemon cannot serve comes back as its
error (``EntryNotFoundError``: not stored; ``ChecksumError``: damaged), and so
does one damaged on the way; the others are served.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from attnstore.errors import AttnStoreError, ChecksumError, EntryNotFoundError, RemoteError
from attnstore.protocol.chunks import ChunkLayout, StoredChunk
from attnstore.protocol.prefix_wire import chunk_data_array, chunk_layout_to_pb, chunk_put
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore_client.connection.base import ChunkPutCounts
from attnstore_client.connection.daemon import DaemonClient

_ROW_ERRORS: dict[str, type[AttnStoreError]] = {"NOT_FOUND": EntryNotFoundError, "DATA_LOSS": ChecksumError}


def match_chunks(
    remote: DaemonClient, namespace: str, fingerprint: str, layout: ChunkLayout, keys: Sequence[bytes],
    timeout: float | None,
) -> list[int | None]:
    """One ChunkMatch (see ``StoreConnection.match_chunks``)."""
    request = pb.ChunkMatchRequest(namespace=namespace, fingerprint=fingerprint, layout=chunk_layout_to_pb(layout),
                                   keys=list(keys))
    reply = remote.unary(remote.stub.ChunkMatch, request, timeout)
    return [int(length) or None for length in reply.lengths]


def fetch_chunks(
    remote: DaemonClient, namespace: str, fingerprint: str, layout: ChunkLayout, keys: Sequence[bytes],
    timeout: float | None,
) -> list[np.ndarray | AttnStoreError]:
    """One FetchChunks, received whole (see ``StoreConnection.fetch_chunks``)."""
    request = pb.FetchChunksRequest(namespace=namespace, fingerprint=fingerprint, layout=chunk_layout_to_pb(layout),
                                    keys=list(keys))

    def read(left: float | None) -> list[np.ndarray | AttnStoreError]:
        layers: list[list[np.ndarray]] = [[] for _ in keys]
        failed: dict[int, AttnStoreError] = {}
        for message in remote.stub.FetchChunks(request, metadata=remote.metadata, timeout=left):
            chunk = int(message.chunk)
            if chunk in failed:
                continue
            if message.HasField("error"):
                failed[chunk] = _ROW_ERRORS.get(message.error.code, RemoteError)(
                    f"{message.error.code}: {message.error.message}")
                continue
            try:
                layers[chunk].append(chunk_data_array(message))  # (2, KVH, C, d), layers in order
            except AttnStoreError as exc:
                failed[chunk] = exc
        return [failed[i] if i in failed else _whole(i, parts, layout) for i, parts in enumerate(layers)]

    return remote.read_stream(read, timeout)


def put_chunks(
    remote: DaemonClient, namespace: str, fingerprint: str, layout: ChunkLayout, chunks: Sequence[StoredChunk],
    timeout: float | None,
) -> ChunkPutCounts:
    """One PutChunks (see ``StoreConnection.put_chunks``)."""
    request = pb.PutChunksRequest(namespace=namespace, fingerprint=fingerprint, layout=chunk_layout_to_pb(layout),
                                  chunks=[chunk_put(chunk) for chunk in chunks])
    reply = remote.unary(remote.stub.PutChunks, request, timeout)
    return ChunkPutCounts(int(reply.stored), int(reply.duplicates), int(reply.not_admitted))


def _whole(index: int, parts: list[np.ndarray], layout: ChunkLayout) -> np.ndarray | AttnStoreError:
    """A chunk's layers stacked ``(layers, 2, KVH, C, d)``; a chunk that came short is an error of its own."""
    if len(parts) != layout.layers:
        return ChecksumError(f"chunk {index}: {len(parts)} of {layout.layers} layers arrived")
    return np.stack(parts)
