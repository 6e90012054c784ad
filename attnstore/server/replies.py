"""The servicer's replies: service records as wire messages."""

from __future__ import annotations

import crc32c

from attnstore.projector.blob import without_embedding_layer
from attnstore.protocol.chunks import ChunkLayout
from attnstore.protocol.messages import layout_to_pb, limits_to_pb
from attnstore.protocol.prefix import PrefixLayout
from attnstore.protocol.prefix_wire import chunk_layout_to_pb, prefix_layout_to_pb
from attnstore.protocol.records import NamespaceInfo
from attnstore.protocol.status_codes import status_for
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.service import MatchResult
from attnstore.service.admission import AdmissionStats
from attnstore.service.quarantine import QuarantinedObject
from attnstore.service.write_back import RefusedRow, WriteBackStats
from attnstore.store.reports import StoreStats, VerifyReport

KIND_TO_PB = {"miss": pb.MATCH_KIND_MISS, "exact": pb.MATCH_KIND_EXACT, "map": pb.MATCH_KIND_MAP}


def namespace_to_pb(
    info: NamespaceInfo, *, projector: bool, prefix: PrefixLayout | None = None, chunks: ChunkLayout | None = None
) -> pb.Namespace:
    """A namespace as its wire message, with or without the projector bytes, with its prefix and chunk layouts
    if any.

    The projector is sent without the embedding layer a stored blob may carry (the daemon's, to derive
    written-back rows' features): its checksum is then the sent bytes'.
    """
    sent = without_embedding_layer(info.projector) if projector and info.projector is not None else b""
    return pb.Namespace(
        name=info.name,
        model=info.model,
        fingerprint=info.fingerprint,
        layout=layout_to_pb(info.layout),
        format_version=info.format_version,
        created=info.created,
        projector=sent,
        projector_crc32c=info.projector_crc32c if sent == (info.projector or b"") else crc32c.crc32c(sent),
        projector_version=info.projector_version,
        prefix=None if prefix is None else prefix_layout_to_pb(prefix),
        limits=limits_to_pb(info.limits),
        chunks=None if chunks is None else chunk_layout_to_pb(chunks),
    )


def match_to_pb(query_index: int, result: MatchResult) -> pb.Match:
    """One query's match as its wire message (entry id and stored length 0 on a miss)."""
    return pb.Match(
        query_index=query_index,
        kind=KIND_TO_PB[result.kind],
        entry_id=result.entry_id or 0,
        distance=result.distance,
        stored_length=result.stored_length or 0,
        admit=result.admit,
    )


def refused_to_pb(refused: RefusedRow) -> pb.RowError:
    """A write-back row refused on its own: its index in the call, the status code its error maps to, why."""
    code, message = status_for(refused.error)
    return pb.RowError(query_index=refused.row, code=code.name, message=message)


def stats_to_pb(
    stats: StoreStats, written: WriteBackStats, admission: AdmissionStats, *, admit_after: int,
    scope: frozenset[str] | None = None,
) -> pb.StatsResponse:
    """The Stats reply: store statistics (buckets flattened over namespaces), the rows written back and what
    admission saw, with its ``admit_after`` setting.

    ``scope`` (a scoped token's namespaces) narrows it to those namespaces: their buckets, entries and bytes,
    and none of the store-wide counters (``scoped_stats_to_pb``)."""
    if scope is not None:
        return scoped_stats_to_pb(stats, scope, admit_after=admit_after)
    buckets = [
        pb.BucketStats(
            namespace=ns.name,
            length=b.length,
            codec=ns.codec,
            entries=b.entries,
            stored_bytes=b.stored_bytes,
            raw_bytes=b.raw_bytes,
        )
        for ns in stats.namespaces
        for b in ns.buckets
    ]
    return pb.StatsResponse(
        entries=stats.entries,
        stored_bytes=stats.stored_bytes,
        buckets=buckets,
        dram_bytes=stats.dram.bytes,
        dram_capacity_bytes=stats.dram.capacity_bytes,
        dram_hits=stats.dram.hits,
        dram_misses=stats.dram.misses,
        dram_evictions=stats.dram.evictions,
        store_evictions=stats.evicted_entries,
        raw_bytes=stats.raw_bytes,
        file_bytes=stats.file_bytes,
        max_bytes=stats.max_bytes or 0,
        dram_entries=stats.dram.entries,
        stale_generations=stats.stale_generations,
        stale_generation_bytes=stats.stale_generation_bytes,
        written_back_entries=written.entries,
        written_back_bytes=written.bytes,
        written_back_duplicates=written.duplicates,
        written_back_not_admitted=written.not_admitted,
        written_back_map_entries=written.map_entries,
        written_back_map_bytes=written.map_bytes,
        written_back_refused=written.refused,
        admission_asked=admission.asked,
        admission_admitted=admission.admitted,
        admission_sketch_bytes=admission.sketch_bytes,
        admit_after=admit_after,
    )


def scoped_stats_to_pb(stats: StoreStats, scope: frozenset[str], *, admit_after: int) -> pb.StatsResponse:
    """The Stats reply a token scoped to ``scope`` sees: those namespaces' buckets, entries and bytes only.

    Everything store-wide (the DRAM cache, the data file, the byte cap and its evictions, stale generations,
    write-back and admission counters) is summed over every namespace, so it would reveal the others' traffic:
    it is left 0 and ``scoped`` says so. ``admit_after`` is a setting, not a count, and is shown."""
    mine = [ns for ns in stats.namespaces if ns.name in scope]
    buckets = [
        pb.BucketStats(namespace=ns.name, length=b.length, codec=ns.codec, entries=b.entries,
                       stored_bytes=b.stored_bytes, raw_bytes=b.raw_bytes)
        for ns in mine
        for b in ns.buckets
    ]
    return pb.StatsResponse(
        entries=sum(ns.entries for ns in mine), stored_bytes=sum(ns.stored_bytes for ns in mine),
        raw_bytes=sum(ns.raw_bytes for ns in mine), buckets=buckets, admit_after=admit_after, scoped=True,
    )


def verify_to_pb(report: VerifyReport) -> pb.VerifyResponse:
    """A verification's report as the Verify reply: corrupt entries (also as ids and lines, for older clients) and
    the store's problems, chunks' included."""
    return pb.VerifyResponse(
        entries_checked=report.entries_checked,
        corrupt_entry_ids=[c.id for c in report.corrupt],
        problems=[f"{c.namespace}/{c.id}: {c.reason}" for c in report.corrupt],
        corrupt=[pb.CorruptEntry(namespace=c.namespace, entry_id=c.id, reason=c.reason) for c in report.corrupt],
        store_problems=[*report.problems,
                        *(f"chunk {c.namespace}/{c.key}: {c.reason}" for c in report.chunks.corrupt)],
        # the wire's names for the stored objects' counts (fields 5 and 6, kept for compatibility)
        chunks_checked=report.objects_checked,
        orphan_chunks=report.orphan_objects,
        seconds=report.seconds,
    )


def quarantined_to_pb(item: QuarantinedObject) -> pb.QuarantinedObject:
    """A quarantined object as its wire message."""
    return pb.QuarantinedObject(
        namespace=item.namespace, kind=item.kind, key=item.key, writer=item.writer or "",
        entry_id=item.entry_id or 0, has_entry_id=item.entry_id is not None, reporter=item.reporter,
        detail=item.detail, since=item.since,
    )
