"""Key/value streams of the servicer: prefix rows (FetchPrefix) and chunks (FetchChunks) in layer order.

Both send layer 0 of every row (or chunk), then layer 1, ..., so a client's
forward may start on layer 0 while later layers are on their way (a prefix row
ends with its hidden states, one step past the last layer). A row that cannot be
read (damaged, gone) gets one message with its ``RowError`` and nothing more; the
others go on, and the client computes what needed it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import grpc

from attnstore.errors import PrefixBlockError
from attnstore.protocol.chunks import ChunkLayout
from attnstore.protocol.prefix import PrefixLayout
from attnstore.protocol.prefix_wire import chunk_data, prefix_frame
from attnstore.protocol.status_codes import status_for
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.server.metrics import DaemonMetrics
from attnstore.service import ROW_ERRORS, AttnStoreService

log = logging.getLogger(__name__)


def prefix_stream(
    service: AttnStoreService, metrics: DaemonMetrics, namespace: str, layout: PrefixLayout,
    rows: Sequence[Sequence[bytes]], context: grpc.ServicerContext,
) -> Iterator[pb.PrefixFrame]:
    """Part 0 (layer 0) of every row of chain hashes ``rows``, then part 1, ...; last the hidden states."""
    failed: set[int] = set()
    for part in range(layout.layers + 1):
        for row, chain in enumerate(rows):
            if row in failed or not context.is_active():
                continue
            try:
                array = service.prefixes.read(namespace, layout.block_size, chain, part)
            except ROW_ERRORS as exc:
                failed.add(row)
                block = exc.block if isinstance(exc, PrefixBlockError) else None
                log.warning("event=prefix_row_dropped namespace=%s row=%d part=%d block=%s error=%s",
                            namespace, row, part, block, exc)
                code, message = status_for(exc)
                metrics.row_error(namespace, code.name)
                yield pb.PrefixFrame(row=row, part=part,
                                     error=pb.RowError(query_index=row, code=code.name, message=message, block=block))
                continue
            metrics.streamed("prefix", array.nbytes)
            yield prefix_frame(row, part, array)


def chunk_stream(
    service: AttnStoreService, metrics: DaemonMetrics, namespace: str, layout: ChunkLayout, keys: Sequence[bytes],
    context: grpc.ServicerContext,
) -> Iterator[pb.ChunkData]:
    """Layer 0 of every chunk of ``keys``, then layer 1, ...: the stored chunk's own bytes, checked against its
    checksum."""
    failed: set[int] = set()
    for layer in range(layout.layers):
        for chunk, key in enumerate(keys):
            if chunk in failed or not context.is_active():
                continue
            try:
                array = service.chunks.read_layer(namespace, key, layer)  # (2, KVH, C, d)
            except ROW_ERRORS as exc:
                failed.add(chunk)
                code, message = status_for(exc)
                if code != grpc.StatusCode.NOT_FOUND:
                    log.warning("event=chunk_dropped namespace=%s chunk=%s layer=%d error=%s",
                                namespace, key.hex()[:16], layer, exc)
                metrics.row_error(namespace, code.name)
                yield pb.ChunkData(chunk=chunk, layer=layer,
                                   error=pb.RowError(query_index=chunk, code=code.name, message=message))
                continue
            metrics.streamed("chunks", array.nbytes)
            yield chunk_data(chunk, layer, array)
