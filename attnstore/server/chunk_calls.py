"""The chunk tier's RPCs: ChunkMatch, FetchChunks and PutChunks, thin over ``AttnStoreService.chunks``.

A mixin of ``AttnStoreServicer``: it uses the servicer's ``_call`` (status
codes, metrics, the in-flight count), its request limit and its callers.
FetchChunks streams like FetchPrefix, layer by layer with every chunk of a layer
first, so a client may start on layer 0 while later layers are on their way; a
chunk that cannot be served gets one ``ChunkData`` with its ``RowError`` and
nothing more, the others go on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import grpc

from attnstore.protocol.prefix_wire import chunk_data, chunk_layout_from_pb, stored_chunk_of
from attnstore.protocol.status_codes import status_for
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.service import ROW_ERRORS, AttnStoreService
from attnstore.service.chunk_tier import check_chunk_keys

if TYPE_CHECKING:
    from attnstore.server.auth import Caller
    from attnstore.server.metrics import DaemonMetrics

log = logging.getLogger(__name__)


class ChunkCalls:
    """``ChunkMatch``, ``FetchChunks`` and ``PutChunks`` of the servicer."""

    _metrics: DaemonMetrics
    _callers: Callable[[grpc.ServicerContext], Caller]

    if TYPE_CHECKING:

        def _call(self, method: str, context: grpc.ServicerContext) -> AbstractContextManager[AttnStoreService]: ...

        def _check_count(self, call: str, count: int, what: str) -> None: ...

    def ChunkMatch(self, request: pb.ChunkMatchRequest, context: grpc.ServicerContext) -> pb.ChunkMatchResponse:
        with self._call("ChunkMatch", context) as service:
            self._check_count("ChunkMatch", len(request.keys), "keys")
            lengths = service.chunks.lengths(request.namespace, request.fingerprint,
                                            chunk_layout_from_pb(request.layout), [bytes(k) for k in request.keys])
            return pb.ChunkMatchResponse(lengths=[length or 0 for length in lengths])

    def FetchChunks(self, request: pb.FetchChunksRequest, context: grpc.ServicerContext) -> Iterator[pb.ChunkData]:
        """Layer 0 of every chunk, then layer 1, ...: the stored chunk's own bytes, checked against its checksum."""
        with self._call("FetchChunks", context) as service:
            self._check_count("FetchChunks", len(request.keys), "keys")
            keys = [bytes(k) for k in request.keys]
            check_chunk_keys(keys)
            layout = service.chunks.check_request(request.namespace, request.fingerprint,
                                                 chunk_layout_from_pb(request.layout))
            failed: set[int] = set()
            for layer in range(layout.layers):
                for chunk, key in enumerate(keys):
                    if chunk in failed or not context.is_active():
                        continue
                    try:
                        array = service.chunks.read_layer(request.namespace, key, layer)  # (2, KVH, C, d)
                    except ROW_ERRORS as exc:
                        # A damaged or missing chunk loses itself only; the client computes what needed it.
                        failed.add(chunk)
                        code, message = status_for(exc)
                        if code != grpc.StatusCode.NOT_FOUND:
                            log.warning("event=chunk_dropped namespace=%s chunk=%s layer=%d error=%s",
                                        request.namespace, key.hex()[:16], layer, exc)
                        self._metrics.row_error(request.namespace, code.name)
                        yield pb.ChunkData(chunk=chunk, layer=layer,
                                           error=pb.RowError(query_index=chunk, code=code.name, message=message))
                        continue
                    self._metrics.streamed("chunks", array.nbytes)
                    yield chunk_data(chunk, layer, array)

    def PutChunks(self, request: pb.PutChunksRequest, context: grpc.ServicerContext) -> pb.PutChunksResponse:
        with self._call("PutChunks", context) as service:
            self._check_count("PutChunks", len(request.chunks), "chunks")
            layout = chunk_layout_from_pb(request.layout)
            writer = self._callers(context).name
            chunks = [stored_chunk_of(message, layout, writer) for message in request.chunks]
            result = service.chunks.put(request.namespace, request.fingerprint, layout, chunks)
            self._metrics.chunks_put(request.namespace, result.stored, result.bytes)
            log.info("event=chunks_put namespace=%s chunks=%d stored=%d duplicates=%d bytes=%d writer=%s",
                     request.namespace, len(chunks), result.stored, result.duplicates, result.bytes, writer)
            return pb.PutChunksResponse(stored=result.stored, duplicates=result.duplicates, bytes=result.bytes)
