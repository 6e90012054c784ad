"""Map streams of the servicer: chosen rows' maps as frames in layer order, a RowError for a row that fails.

Lookup, FetchMaps and Fetch send maps the same way: layer 0 of every row, then
layer 1, ..., so a client's forward can start replaying layer 0 before the last
layer arrives. A row whose entry cannot be read (corrupt, gone) gets one
RowError and nothing more, and the others go on (Fetch, which has no RowError,
ends the call instead).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np

from attnstore.errors import AttnStoreError
from attnstore.protocol.status_codes import status_for
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.wire import map_frames
from attnstore.server.metrics import DaemonMetrics
from attnstore.service import ROW_ERRORS, AttnStoreService

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MapRow:
    """One hit row to stream maps for."""

    query_index: int
    entry_id: int
    length: int | None  # crop length (the query's); None: the stored length


def row_stream(
    service: AttnStoreService, metrics: DaemonMetrics, namespace: str, rows: list[MapRow],
    context: grpc.ServicerContext,
) -> Iterator[pb.LookupResponse]:
    """The maps of ``rows`` as LookupResponse messages: frames, and a RowError for a row that cannot be served."""
    for frame_or_error in layer_frames(service, metrics, namespace, rows, context, drop_failed_rows=True):
        if isinstance(frame_or_error, pb.RowError):
            metrics.row_error(namespace, frame_or_error.code)
            yield pb.LookupResponse(error=frame_or_error)
        else:
            yield pb.LookupResponse(maps=frame_or_error)


def layer_frames(
    service: AttnStoreService,
    metrics: DaemonMetrics,
    namespace: str,
    rows: list[MapRow],
    context: grpc.ServicerContext,
    *,
    drop_failed_rows: bool,
) -> Iterator[pb.MapFrame | pb.RowError]:
    """Map frames of ``rows`` in layer order: layer 0 of every row, then layer 1, ...

    A row whose entry cannot be read yields one RowError and nothing more when
    ``drop_failed_rows``; otherwise the error ends the call.
    """
    if not rows:
        return
    layers = service.get_namespace(namespace).layout.layers
    live = list(rows)
    for layer in range(layers):
        if not context.is_active():
            return
        # Rows of one batch often hit the same popular entry: read each (entry, crop) once per layer.
        read: dict[tuple[int, int | None], np.ndarray | AttnStoreError] = {}
        for row in list(live):
            key = (row.entry_id, row.length)
            if key not in read:
                start = time.perf_counter()
                try:
                    # (heads, L, L), cropped to the query's length
                    read[key] = service.read_layer(namespace, row.entry_id, layer, length=row.length)
                except ROW_ERRORS as exc:
                    if not drop_failed_rows:
                        raise
                    read[key] = exc
                    log.warning(
                        "event=row_dropped namespace=%s entry=%d layer=%d error=%r",
                        namespace, row.entry_id, layer, exc,
                    )
                else:
                    metrics.fetched(time.perf_counter() - start)
            maps = read[key]
            if isinstance(maps, AttnStoreError):
                live.remove(row)
                code, message = status_for(maps)
                yield pb.RowError(query_index=row.query_index, entry_id=row.entry_id, code=code.name, message=message)
                continue
            metrics.streamed("maps", maps.nbytes)
            yield from map_frames(maps, query_index=row.query_index, entry_id=row.entry_id, layer=layer)
    # Every layer went out: repeated hits earn a place in the DRAM cache (its admission policy).
    service.store.maps_served(namespace, sorted({row.entry_id for row in live}))
