"""The AttnStore servicer: thin methods over ``AttnStoreService``.

Each method decodes the request, calls the service (or one of its parts:
``service.prefixes``, ``service.chunks``) and builds the reply: replies in
``replies``, streams of stored layers in ``map_streams`` and ``kv_streams``;
exceptions become status codes only in ``status_codes`` (through ``_call``).
Each call runs on one thread of the server's pool, so LMDB read transactions
never cross threads. See the proto for the stream protocols of Lookup, Fetch
and Ingest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import grpc
import numpy as np

from attnstore.errors import (
    AttnStoreError,
    ChecksumError,
    ConfigError,
    MapShapeError,
    RequestLimitError,
    UnavailableError,
    WireFormatError,
)
from attnstore.projector.blob import projector_metadata
from attnstore.protocol.messages import layout_from_pb, limits_from_pb
from attnstore.protocol.prefix import check_prefix_request
from attnstore.protocol.prefix_wire import (
    chunk_layout_from_pb,
    prefix_block_of,
    prefix_layout_from_pb,
    stored_chunk_of,
)
from attnstore.protocol.status_codes import abort, status_for
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.v1 import attnstore_pb2_grpc as pb_grpc
from attnstore.protocol.wire import output_frames
from attnstore.protocol.write_back import row_from_pb
from attnstore.server.auth import Caller, anonymous_caller
from attnstore.server.config import ServerLimits
from attnstore.server.ingest_stream import IngestStaging, idle_limited
from attnstore.server.kv_streams import chunk_stream, prefix_stream
from attnstore.server.map_streams import MapRow, layer_frames, row_stream
from attnstore.server.metrics import DaemonMetrics
from attnstore.server.replies import (
    match_to_pb,
    namespace_to_pb,
    quarantined_to_pb,
    refused_to_pb,
    stats_to_pb,
    verify_to_pb,
)
from attnstore.service import AttnStoreService, Query
from attnstore.service.chunks import check_chunk_keys
from attnstore.service.put_rules import PutCaller
from attnstore.service.write_back import WrittenRow

log = logging.getLogger(__name__)


def _decoded_row(row: pb.WrittenRow, index: int) -> WrittenRow | AttnStoreError:
    """A written-back row, or the error its message raised (that row alone is refused)."""
    try:
        return WrittenRow(*row_from_pb(row, index))
    except (WireFormatError, ChecksumError) as exc:
        return exc


def _decoded_features(request: pb.SetFeaturesRequest, dim: int) -> tuple[list[int], np.ndarray]:
    """SetFeatures' entry ids and their ``(n, dim)`` features.

    Raises:
        MapShapeError: a feature vector is not ``dim`` floats (the namespace's ``feature_dim``).
    """
    ids = [int(f.entry_id) for f in request.features]
    widths = {len(f.feature) for f in request.features}
    if widths - {dim}:
        raise MapShapeError(
            f"SetFeatures: feature vectors of {sorted(widths - {dim})} floats; namespace"
            f" {request.namespace!r} has feature_dim {dim}"
        )
    return ids, np.array([list(f.feature) for f in request.features], dtype=np.float32).reshape(len(ids), dim)


class AttnStoreServicer(pb_grpc.AttnStoreServicer):
    """Implements ``attnstore.v1.AttnStore`` over an ``AttnStoreService``.

    The service may be attached after the server starts (the daemon builds its
    indexes while health says NOT_SERVING); until then every call is UNAVAILABLE.
    """

    def __init__(
        self, service: AttnStoreService | None, *, limits: ServerLimits, metrics: DaemonMetrics,
        callers: Callable[[grpc.ServicerContext], Caller] = anonymous_caller,
    ) -> None:
        self._service = service
        self._limits = limits
        self._metrics = metrics
        self._callers = callers  # who makes a call (the auth interceptor knows its token)
        self._idle = threading.Condition()
        self._in_flight = 0
        self._ingest_slots = threading.BoundedSemaphore(limits.max_ingest_streams)

    def attach(self, service: AttnStoreService | None) -> None:
        """Serve ``service`` from now on (None: refuse new calls with UNAVAILABLE)."""
        if service is not None:
            for info in service.list_namespaces():
                self._metrics.namespace_known(info.name)
        self._service = service

    def wait_idle(self, timeout: float | None) -> bool:
        """Block until no call runs in this servicer; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout)

    @contextmanager
    def _call(self, method: str, context: grpc.ServicerContext) -> Iterator[AttnStoreService]:
        """Run one call: count and time it, and turn what it raises into a status."""
        start = time.perf_counter()
        code = "OK"
        with self._idle:
            self._in_flight += 1
        self._metrics.rpc_started()
        try:
            service = self._service
            if service is None:
                raise UnavailableError("the daemon is not serving (loading its store or shutting down); retry shortly")
            yield service
        except GeneratorExit:
            code = "CANCELLED"  # the client went away, or the drain's grace ran out
            log.info("event=rpc_cancelled method=%s", method)
            raise
        except Exception as exc:
            code = status_for(exc)[0].name if context.is_active() else "CANCELLED"
            abort(context, exc, method)
        finally:
            self._metrics.rpc_finished(method, code, time.perf_counter() - start)
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    # ---- namespaces ---------------------------------------------------------

    def CreateNamespace(self, request: pb.CreateNamespaceRequest, context: grpc.ServicerContext) -> pb.Namespace:
        with self._call("CreateNamespace", context) as service:
            layout = layout_from_pb(request.layout)
            # Checked before anything is written: a refused call must leave no namespace behind.
            if request.projector:
                projector_metadata(request.projector)
            prefix = prefix_layout_from_pb(request.prefix) if request.HasField("prefix") else None
            chunks = chunk_layout_from_pb(request.chunks) if request.HasField("chunks") else None
            if (prefix or chunks) and not layout.causal:
                raise ConfigError(f"CreateNamespace: namespace {request.name!r} is bidirectional (an encoder):"
                                  " it takes no prefix or chunk layout")
            service.create_namespace(
                request.name, model=request.model, fingerprint=request.fingerprint, layout=layout,
                limits=limits_from_pb(request),
            )
            # The model's layouts: recorded here (where none is yet), never by a writer's first put.
            if prefix is not None and service.prefixes.layout(request.name) is None:
                service.prefixes.set_layout(request.name, prefix)
            if chunks is not None and service.chunks.layout(request.name) is None:
                service.chunks.set_layout(request.name, chunks)
            if request.projector:
                before = service.get_namespace(request.name).projector_version
                info = service.set_projector(request.name, request.projector, replace=request.replace_projector)
                if before and info.projector_version != before:
                    log.warning(
                        "event=projector_replaced namespace=%s projector_version=%d", request.name,
                        info.projector_version,
                    )
            self._metrics.namespace_known(request.name)
            log.info("event=namespace_created namespace=%s model=%s", request.name, request.model)
            return namespace_to_pb(service.get_namespace(request.name), projector=True,
                                   prefix=service.prefixes.layout(request.name),
                                   chunks=service.chunks.layout(request.name))

    def GetNamespace(self, request: pb.GetNamespaceRequest, context: grpc.ServicerContext) -> pb.Namespace:
        with self._call("GetNamespace", context) as service:
            return namespace_to_pb(service.get_namespace(request.name), projector=not request.without_projector,
                                   prefix=service.prefixes.layout(request.name),
                                   chunks=service.chunks.layout(request.name))

    def ListNamespaces(
        self, request: pb.ListNamespacesRequest, context: grpc.ServicerContext
    ) -> pb.ListNamespacesResponse:
        with self._call("ListNamespaces", context) as service:
            caller = self._callers(context)
            return pb.ListNamespacesResponse(
                namespaces=[namespace_to_pb(info, projector=False) for info in service.list_namespaces()
                            if caller.allows(info.name)]
            )

    # ---- serving ------------------------------------------------------------

    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> Iterator[pb.LookupResponse]:
        """Matches, then the exact hits' outputs, then (``want_maps``) the map hits' maps.

        The client library asks it for the exact tier (outputs only, ``exact_request``); its map tier asks
        Search and FetchMaps. Lookup with maps, one call for a whole batch, serves the load bench
        (``attnstore_tools.bench.load``) and older clients: kept for wire compatibility.
        """
        with self._call("Lookup", context) as service:
            namespace = request.namespace
            start = time.perf_counter()
            results = service.lookup(
                namespace,
                request.fingerprint,
                self._queries(request.queries),
                max_distance=request.max_distance,
                exact=request.want_outputs or request.exact_only,
                maps=not request.exact_only,
                gate=request.gate,
                projector_version=request.projector_version or None,
                caller=self._callers(context).key,  # None (a read token): its asks admit nothing
            )
            seconds = time.perf_counter() - start
            served = service.read_exact_outputs(namespace, results, on_read=self._metrics.fetched)
            results, outputs = served.results, served.outputs
            self._metrics.matched(namespace, [r.kind for r in results], seconds, lookup=True)
            admitted = sum(r.admit for r in results)
            if admitted:
                self._metrics.admitted(namespace, admitted)
            yield pb.LookupResponse(matches=pb.Matches(matches=[match_to_pb(i, r) for i, r in enumerate(results)]))
            for query_index, (entry_id, array) in outputs.items():
                self._metrics.streamed("outputs", array.nbytes)
                for frame in output_frames(array, query_index=query_index, entry_id=entry_id):
                    yield pb.LookupResponse(outputs=frame)
            if not request.want_maps:
                return
            rows = [
                MapRow(i, int(r.entry_id), request.queries[i].length)
                for i, r in enumerate(results)
                if r.kind == "map" and r.entry_id is not None
            ]
            yield from row_stream(service, self._metrics, namespace, rows, context)

    def Search(self, request: pb.SearchRequest, context: grpc.ServicerContext) -> pb.SearchResponse:
        with self._call("Search", context) as service:
            start = time.perf_counter()
            results = service.lookup(
                request.namespace,
                request.fingerprint,
                self._queries(request.queries),
                max_distance=request.max_distance,
                gate=request.gate,
                projector_version=request.projector_version or None,
                caller=self._callers(context).key,  # a Search asks the exact tier too: the same admission rule
            )
            seconds = time.perf_counter() - start
            self._metrics.matched(request.namespace, [r.kind for r in results], seconds, lookup=False)
            # Read-ahead: a Fetch of the map hits usually follows a Search.
            hits = [r.entry_id for r in results if r.kind == "map" and r.entry_id is not None]
            if hits:
                service.store.prefetch(request.namespace, hits)
            return pb.SearchResponse(matches=[match_to_pb(i, r) for i, r in enumerate(results)])

    def Fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[pb.MapFrame]:
        """Named entries' maps, in layer order; an unknown id ends the call before any frame.

        It serves the admin tools (``admin train-projector`` reads stored rows' maps,
        ``attnstore_tools.admin.train_projector.fetch_maps``); a node's map tier asks FetchMaps, whose rows
        fail alone. Kept for wire compatibility; the client library has no method for it.
        """
        with self._call("Fetch", context) as service:
            service.check_fingerprint(request.namespace, request.fingerprint)
            self._check_count("Fetch", len(request.entry_ids), "entries")
            # Unknown ids end the call before any frame is sent.
            stored = [service.store.entry(request.namespace, int(entry_id)).length for entry_id in request.entry_ids]
            rows = [
                MapRow(i, int(entry_id), request.length or length)
                for i, (entry_id, length) in enumerate(zip(request.entry_ids, stored, strict=True))
            ]
            for frame in layer_frames(service, self._metrics, request.namespace, rows, context, drop_failed_rows=False):
                assert isinstance(frame, pb.MapFrame)  # without drop_failed_rows a failed read raises instead
                yield frame

    def FetchMaps(self, request: pb.FetchMapsRequest, context: grpc.ServicerContext) -> Iterator[pb.LookupResponse]:
        with self._call("FetchMaps", context) as service:
            service.check_fingerprint(request.namespace, request.fingerprint)
            self._check_count("FetchMaps", len(request.rows), "rows")
            rows = [MapRow(i, int(row.entry_id), int(row.length) or None) for i, row in enumerate(request.rows)]
            yield from row_stream(service, self._metrics, request.namespace, rows, context)

    def PrefixMatch(self, request: pb.PrefixMatchRequest, context: grpc.ServicerContext) -> pb.PrefixMatchResponse:
        with self._call("PrefixMatch", context) as service:
            self._check_count("PrefixMatch", len(request.rows), "rows")
            rows = [list(row.chain_hashes) for row in request.rows]
            blocks = service.prefixes.matches(request.namespace, request.fingerprint, int(request.block_size), rows,
                                              caller=self._callers(context).key)
            return pb.PrefixMatchResponse(blocks=blocks)

    def FetchPrefix(self, request: pb.FetchPrefixRequest, context: grpc.ServicerContext) -> Iterator[pb.PrefixFrame]:
        """Part 0 (layer 0) of every row, then part 1, ...; last the hidden states: the client's forward
        starts on layer 0 while later layers are still on their way."""
        with self._call("FetchPrefix", context) as service:
            service.check_fingerprint(request.namespace, request.fingerprint)
            self._check_count("FetchPrefix", len(request.rows), "rows")
            layout = check_prefix_request(service.prefixes.layout(request.namespace), request.namespace,
                                          int(request.block_size))
            rows = [list(row.chain_hashes) for row in request.rows]
            yield from prefix_stream(service, self._metrics, request.namespace, layout, rows, context)

    def PutPrefix(self, request: pb.PutPrefixRequest, context: grpc.ServicerContext) -> pb.PutPrefixResponse:
        with self._call("PutPrefix", context) as service:
            self._check_count("PutPrefix", len(request.blocks), "blocks")
            layout = prefix_layout_from_pb(request.layout)
            caller = self._put_caller(context)
            blocks = [prefix_block_of(message, layout) for message in request.blocks]
            result = service.prefixes.put(request.namespace, request.fingerprint, layout, blocks, caller)
            self._metrics.prefix_blocks_put(request.namespace, result.stored, result.bytes)
            log.info("event=prefix_put namespace=%s blocks=%d stored=%d duplicates=%d not_admitted=%d bytes=%d"
                     " writer=%s", request.namespace, len(blocks), result.stored, result.duplicates,
                     result.not_admitted, result.bytes, caller.writer)
            return pb.PutPrefixResponse(stored=result.stored, duplicates=result.duplicates, bytes=result.bytes,
                                        not_admitted=result.not_admitted)

    def Prefetch(self, request: pb.PrefetchRequest, context: grpc.ServicerContext) -> pb.PrefetchResponse:
        with self._call("Prefetch", context) as service:
            # (The DRAM cache's queue holds a few thousand anyway.)
            self._check_count("Prefetch", len(request.entry_ids), "ids")
            service.get_namespace(request.namespace)
            report = service.store.prefetch(request.namespace, [int(i) for i in request.entry_ids])
            if report.unknown:
                # One line per call, not per id: a client sending unknown ids must not flood the log.
                log.info("event=prefetch_unknown namespace=%s unknown=%d", request.namespace, report.unknown)
            return pb.PrefetchResponse(queued=report.queued, unknown=report.unknown)

    # ---- chunks -------------------------------------------------------------

    def ChunkMatch(self, request: pb.ChunkMatchRequest, context: grpc.ServicerContext) -> pb.ChunkMatchResponse:
        with self._call("ChunkMatch", context) as service:
            self._check_count("ChunkMatch", len(request.keys), "keys")
            lengths = service.chunks.lengths(request.namespace, request.fingerprint,
                                            chunk_layout_from_pb(request.layout), [bytes(k) for k in request.keys],
                                            caller=self._callers(context).key)
            return pb.ChunkMatchResponse(lengths=[length or 0 for length in lengths])

    def FetchChunks(self, request: pb.FetchChunksRequest, context: grpc.ServicerContext) -> Iterator[pb.ChunkData]:
        """Layer 0 of every chunk, then layer 1, ...; a chunk that cannot be served gets its RowError alone."""
        with self._call("FetchChunks", context) as service:
            self._check_count("FetchChunks", len(request.keys), "keys")
            keys = [bytes(k) for k in request.keys]
            check_chunk_keys(keys)
            layout = service.chunks.check_request(request.namespace, request.fingerprint,
                                                 chunk_layout_from_pb(request.layout))
            asking = self._callers(context).key
            if asking is not None:  # a fetch of chunks not stored asks for them, as a ChunkMatch does (admission)
                service.chunks.lengths(request.namespace, request.fingerprint, layout, keys, caller=asking)
            yield from chunk_stream(service, self._metrics, request.namespace, layout, keys, context)

    def PutChunks(self, request: pb.PutChunksRequest, context: grpc.ServicerContext) -> pb.PutChunksResponse:
        with self._call("PutChunks", context) as service:
            self._check_count("PutChunks", len(request.chunks), "chunks")
            layout = chunk_layout_from_pb(request.layout)
            caller = self._put_caller(context)
            chunks = [stored_chunk_of(message, layout, caller.writer) for message in request.chunks]
            result = service.chunks.put(request.namespace, request.fingerprint, layout, chunks, caller)
            self._metrics.chunks_put(request.namespace, result.stored, result.bytes)
            log.info("event=chunks_put namespace=%s chunks=%d stored=%d duplicates=%d not_admitted=%d bytes=%d"
                     " writer=%s", request.namespace, len(chunks), result.stored, result.duplicates,
                     result.not_admitted, result.bytes, caller.writer)
            return pb.PutChunksResponse(stored=result.stored, duplicates=result.duplicates, bytes=result.bytes,
                                        not_admitted=result.not_admitted)

    # ---- admin --------------------------------------------------------------

    def Ingest(self, request_iterator: Iterator[pb.IngestRequest], context: grpc.ServicerContext) -> pb.IngestSummary:
        with self._call("Ingest", context) as service, self._ingest_slot():
            request_iterator = idle_limited(request_iterator, self._limits.ingest_idle_seconds)
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("body") != "begin":
                raise WireFormatError("an Ingest stream must start with an IngestBegin message")
            namespace, fingerprint = first.begin.namespace, first.begin.fingerprint
            projector_version = first.begin.projector_version or None
            info = service.check_fingerprint(namespace, fingerprint)
            staging = IngestStaging(info.layout, max_bytes=self._limits.max_ingest_bytes)
            if not any(staging.add(message) for message in request_iterator):
                raise WireFormatError("the Ingest stream ended without a commit: nothing was written")
            if next(request_iterator, None) is not None:
                raise WireFormatError("the Ingest stream went on after its commit: nothing was written")
            entries = staging.entries()
            result = service.ingest(namespace, fingerprint, entries, projector_version=projector_version)
            self._metrics.ingested(namespace, len(entries), staging.received_bytes)
            log.info(
                "event=ingested namespace=%s entries=%d duplicates=%d bytes=%d",
                namespace, len(entries), result.duplicates, staging.received_bytes,
            )
            return pb.IngestSummary(
                entry_ids=result.entry_ids,
                entries=len(entries),
                duplicates=result.duplicates,
                bytes=staging.received_bytes,
            )

    def WriteBack(self, request: pb.WriteBackRequest, context: grpc.ServicerContext) -> pb.WriteBackResponse:
        with self._call("WriteBack", context) as service:
            self._check_count("WriteBack", len(request.rows), "rows")
            rows = [_decoded_row(row, i) for i, row in enumerate(request.rows)]
            result = service.write_back(request.namespace, request.fingerprint, rows,
                                        writer=self._callers(context).name)
            self._metrics.written_back(request.namespace, result)
            log.info(
                "event=written_back namespace=%s rows=%d stored=%d with_maps=%d duplicates=%d not_admitted=%d"
                " refused=%d bytes=%d", request.namespace, len(rows), result.stored, result.maps_stored,
                result.duplicates, result.not_admitted, len(result.refused), result.bytes,
            )
            return pb.WriteBackResponse(
                stored=result.stored, duplicates=result.duplicates, not_admitted=result.not_admitted,
                bytes=result.bytes, maps_stored=result.maps_stored, maps_bytes=result.maps_bytes,
                refused=[refused_to_pb(r) for r in result.refused],
            )

    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> pb.DeleteResponse:
        with self._call("Delete", context) as service:
            deleted = service.delete(request.namespace, [int(i) for i in request.entry_ids])
            log.info(
                "event=deleted namespace=%s requested=%d deleted=%d",
                request.namespace, len(request.entry_ids), deleted,
            )
            return pb.DeleteResponse(deleted=deleted)

    def DropWriter(self, request: pb.DropWriterRequest, context: grpc.ServicerContext) -> pb.DropWriterResponse:
        with self._call("DropWriter", context) as service:
            if not request.writer:
                raise ConfigError("DropWriter needs a writer name: an empty one would match every admin build")
            blocks = service.prefixes.drop_writer(request.namespace, request.writer, dry_run=request.dry_run)
            chunks = service.chunks.drop_writer(request.namespace, request.writer, dry_run=request.dry_run)
            log.warning("event=writer_dropped namespace=%s writer=%s prefix_blocks=%d chunks=%d dry_run=%s",
                        request.namespace, request.writer, blocks, chunks, request.dry_run)
            return pb.DropWriterResponse(prefix_blocks=blocks, chunks=chunks)

    def Compact(self, request: pb.CompactRequest, context: grpc.ServicerContext) -> pb.CompactResponse:
        with self._call("Compact", context) as service:
            report = service.compact()
            log.info(
                "event=compacted entries=%d bytes_before=%d bytes_after=%d seconds=%.3f",
                report.entries, report.bytes_before, report.bytes_after, report.seconds,
            )
            return pb.CompactResponse(
                entries=report.entries,
                bytes_before=report.bytes_before,
                bytes_after=report.bytes_after,
                seconds=report.seconds,
            )

    def Verify(self, request: pb.VerifyRequest, context: grpc.ServicerContext) -> pb.VerifyResponse:
        with self._call("Verify", context) as service:
            report = service.store.verify()
            log.info(
                "event=verified entries=%d corrupt=%d problems=%d",
                report.entries_checked, len(report.corrupt), len(report.problems),
            )
            return verify_to_pb(report)

    # ---- quarantine ---------------------------------------------------------

    def ReportMismatch(
        self, request: pb.ReportMismatchRequest, context: grpc.ServicerContext
    ) -> pb.ReportMismatchResponse:
        with self._call("ReportMismatch", context) as service:
            reported = service.report_mismatch(request.namespace, request.fingerprint, request.kind, request.key,
                                               reporter=self._callers(context).name, detail=request.detail)
            if reported is None:
                log.info("event=mismatch_not_stored namespace=%s kind=%s key=%s", request.namespace, request.kind,
                         request.key.hex()[:16])
                return pb.ReportMismatchResponse(found=False)
            item, quarantined = reported
            self._metrics.mismatch_reported(request.namespace, item.kind, quarantined=quarantined)
            return pb.ReportMismatchResponse(found=True, quarantined=quarantined, object=quarantined_to_pb(item))

    def ListQuarantine(
        self, request: pb.ListQuarantineRequest, context: grpc.ServicerContext
    ) -> pb.ListQuarantineResponse:
        with self._call("ListQuarantine", context) as service:
            items = service.quarantine.items(request.namespace or None)
            return pb.ListQuarantineResponse(objects=[quarantined_to_pb(item) for item in items])

    def ReleaseQuarantine(
        self, request: pb.ReleaseQuarantineRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseQuarantineResponse:
        with self._call("ReleaseQuarantine", context) as service:
            item = service.release_quarantined(request.namespace, request.kind, request.key, drop=request.drop)
            log.info("event=quarantine_%s namespace=%s kind=%s key=%s writer=%s", "dropped" if request.drop else
                     "released", item.namespace, item.kind, item.key.hex()[:16], item.writer or "(admin)")
            return pb.ReleaseQuarantineResponse(object=quarantined_to_pb(item), dropped=request.drop)

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        with self._call("Stats", context) as service:
            # A scoped token sees its namespaces only, and no store-wide counter (they sum every namespace's).
            return stats_to_pb(service.store.stats(), service.write_backs.stats(), service.admission.stats(),
                               admit_after=service.admission.config.admit_after,
                               scope=self._callers(context).namespaces)

    def ListEntries(self, request: pb.ListEntriesRequest, context: grpc.ServicerContext) -> Iterator[pb.StoredEntry]:
        with self._call("ListEntries", context) as service:
            for info in service.store.entries(request.namespace):
                if not context.is_active():
                    return
                if (request.maps_only and not info.has_maps) or (request.writer and info.writer != request.writer):
                    continue
                yield pb.StoredEntry(
                    entry_id=info.id, length=info.length, token_hash=info.token_hash,
                    token_ids=[] if info.token_ids is None else info.token_ids.tolist(),
                    has_maps=info.has_maps, has_feature=info.feature is not None, writer=info.writer or "",
                )

    def SetFeatures(self, request: pb.SetFeaturesRequest, context: grpc.ServicerContext) -> pb.SetFeaturesResponse:
        with self._call("SetFeatures", context) as service:
            self._check_count("SetFeatures", len(request.features), "features")
            ids, features = _decoded_features(request, service.get_namespace(request.namespace).layout.feature_dim)
            report = service.set_features(request.namespace, ids, features,
                                          projector_version=int(request.projector_version))
            log.info(
                "event=features_set namespace=%s projector_version=%d updated=%d missing=%d",
                request.namespace, request.projector_version, len(report.updated), len(report.missing),
            )
            return pb.SetFeaturesResponse(updated=len(report.updated), missing=report.missing)

    def _put_caller(self, context: grpc.ServicerContext) -> PutCaller:
        """A PutPrefix or PutChunks caller: its token's name is recorded with what it stores; an identified admin
        (the operator) is trusted, every other caller is admitted by the rule."""
        caller = self._callers(context)
        return PutCaller(writer=caller.name, trusted=caller.role == "admin" and caller.identified)

    # ---- helpers ------------------------------------------------------------

    def _check_count(self, call: str, count: int, what: str) -> None:
        """Refuse a call naming more rows, ids or queries than ``--max-queries`` (RESOURCE_EXHAUSTED)."""
        if count > self._limits.max_queries:
            raise RequestLimitError(
                f"{call}: {count} {what} is over this daemon's limit of {self._limits.max_queries}; split it"
            )

    def _queries(self, queries: Sequence[pb.Query]) -> list[Query]:
        """Wire queries as service queries; refuses batches over the limit."""
        self._check_count("one call", len(queries), "queries")
        return [
            Query(
                feature=np.fromiter(q.feature, dtype=np.float32, count=len(q.feature)),
                length=int(q.length),
                token_hash=bytes(q.token_hash) or None,
                token_ids=np.fromiter(q.token_ids, dtype=np.int64, count=len(q.token_ids)) if q.token_ids else None,
            )
            for q in queries
        ]

    @contextmanager
    def _ingest_slot(self) -> Iterator[None]:
        if not self._ingest_slots.acquire(blocking=False):
            raise RequestLimitError(
                f"{self._limits.max_ingest_streams} Ingest streams are running, the most this daemon takes; retry later"
            )
        try:
            yield
        finally:
            self._ingest_slots.release()
