"""Conversions between the service's records and the wire messages of attnstore.v1."""

from __future__ import annotations

import json
import struct

from typing import TYPE_CHECKING

from attnstore.errors import WireFormatError
from attnstore.protocol.records import NamespaceInfo, NamespaceLayout
from attnstore.store.reports import StoreStats
from attnstore.protocol.v1 import attnstore_pb2 as pb

if TYPE_CHECKING:
    from attnstore.service import MatchResult  # the service imports faiss; this module stays light

KIND_TO_PB = {"miss": pb.MATCH_KIND_MISS, "exact": pb.MATCH_KIND_EXACT, "map": pb.MATCH_KIND_MAP}


def layout_from_pb(layout: pb.Layout) -> NamespaceLayout:
    """A wire layout as a NamespaceLayout; empty dtype and codec take their defaults."""
    return NamespaceLayout(
        layers=layout.layers,
        heads=layout.heads,
        causal=layout.causal,
        hidden=layout.hidden,
        feature_dim=layout.feature_dim,
        dtype=layout.dtype or "float16",  # type: ignore[arg-type]
        codec=layout.codec or "fp16",  # type: ignore[arg-type]
    )


def layout_to_pb(layout: NamespaceLayout) -> pb.Layout:
    """A NamespaceLayout as its wire message."""
    return pb.Layout(**layout.to_json_dict())


def namespace_to_pb(info: NamespaceInfo, *, projector: bool) -> pb.Namespace:
    """A namespace as its wire message, with or without the projector bytes."""
    return pb.Namespace(
        name=info.name,
        model=info.model,
        fingerprint=info.fingerprint,
        layout=layout_to_pb(info.layout),
        format_version=info.format_version,
        created=info.created,
        projector=(info.projector or b"") if projector else b"",
    )


def match_to_pb(query_index: int, result: MatchResult) -> pb.Match:
    """One query's match as its wire message (entry id and stored length 0 on a miss)."""
    return pb.Match(
        query_index=query_index,
        kind=KIND_TO_PB[result.kind],
        entry_id=result.entry_id or 0,
        distance=result.distance,
        stored_length=result.stored_length or 0,
    )


def stats_to_pb(stats: StoreStats) -> pb.StatsResponse:
    """Store statistics as the Stats reply (buckets flattened over namespaces)."""
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
    )


def check_safetensors(blob: bytes) -> None:
    """Refuse a projector blob that is not safetensors (8-byte header size, then a JSON object)."""
    if len(blob) < 8:
        raise WireFormatError(f"projector must be safetensors bytes; got {len(blob)} bytes")
    (header_size,) = struct.unpack("<Q", blob[:8])
    if header_size > len(blob) - 8:
        raise WireFormatError(f"projector safetensors header claims {header_size} bytes; the blob has {len(blob) - 8}")
    try:
        header = json.loads(blob[8 : 8 + header_size])
    except (UnicodeDecodeError, ValueError):
        raise WireFormatError("projector safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise WireFormatError("projector safetensors header must be a JSON object")
