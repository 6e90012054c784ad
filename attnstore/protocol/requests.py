"""Request messages built from the records both sides share, and a Lookup's reply put back together.

What a client sends (``lookup_request``, ``exact_request``, ``search_request``, ``ingest_requests``) and how
a streamed Lookup reply becomes arrays (``LookupResult``): the protocol's, so that a client, a test or a
tool builds the same messages the daemon parses.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from attnstore.errors import WireFormatError
from attnstore.protocol.records import LookupBatch, NewEntry
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.wire import FrameAssembler, map_frames, output_frames


@dataclass(frozen=True, slots=True)
class LookupResult:
    """A Lookup's answer, assembled: matches, and the arrays of the hit rows by query index."""

    matches: list[pb.Match]  # one per query, in order
    maps: dict[int, np.ndarray] = field(default_factory=dict)  # query -> (layers, heads, L, L) of MAP rows
    outputs: dict[int, np.ndarray] = field(default_factory=dict)  # query -> (L, hidden) of EXACT rows
    row_errors: dict[int, pb.RowError] = field(default_factory=dict)  # MAP rows the daemon could not serve


def lookup_request(batch: LookupBatch, *, want_maps: bool = True, want_outputs: bool | None = None) -> pb.LookupRequest:
    """The LookupRequest of ``batch``.

    Args:
        batch: the rows to look up.
        want_maps: stream the map hits' maps (else matches and outputs only).
        want_outputs: consult the exact tier and stream its outputs; by default
            when the batch has token hashes.
    """
    hashes = batch.token_hashes if batch.token_hashes is not None else [None] * batch.size
    ids = batch.token_ids if batch.token_ids is not None else [()] * batch.size
    return pb.LookupRequest(
        namespace=batch.namespace,
        fingerprint=batch.fingerprint,
        queries=[
            pb.Query(feature=row.tolist(), length=int(length), token_hash=token_hash or b"", token_ids=list(row_ids))
            for row, length, token_hash, row_ids in zip(batch.features, batch.lengths, hashes, ids, strict=True)
        ],
        max_distance=batch.max_distance,
        want_maps=want_maps,
        want_outputs=batch.exact if want_outputs is None else want_outputs,
        gate=batch.gate,
        projector_version=batch.projector_version,
    )


def exact_request(
    namespace: str, fingerprint: str, token_hashes: Sequence[bytes], lengths: Sequence[int]
) -> pb.LookupRequest:
    """A Lookup of the exact tier alone: the rows' token hashes and lengths, no features, nothing searched."""
    return pb.LookupRequest(
        namespace=namespace,
        fingerprint=fingerprint,
        queries=[
            pb.Query(length=int(length), token_hash=bytes(token_hash))
            for token_hash, length in zip(token_hashes, lengths, strict=True)
        ],
        want_outputs=True,
        exact_only=True,
    )


def search_request(batch: LookupBatch) -> pb.SearchRequest:
    """The SearchRequest of ``batch``: the map tier's matches only (token hashes are not sent)."""
    ids = batch.token_ids if batch.token_ids is not None else [()] * batch.size
    return pb.SearchRequest(
        namespace=batch.namespace,
        fingerprint=batch.fingerprint,
        queries=[
            pb.Query(feature=row.tolist(), length=int(length), token_ids=list(row_ids))
            for row, length, row_ids in zip(batch.features, batch.lengths, ids, strict=True)
        ],
        max_distance=batch.max_distance,
        gate=batch.gate,
        projector_version=batch.projector_version,
    )


def ingest_requests(
    namespace: str, fingerprint: str, entries: Iterable[NewEntry], *, commit: bool = True, projector_version: int = 0
) -> Iterator[pb.IngestRequest]:
    """The messages of one Ingest stream for ``entries`` (maps sent in their own dtype, fp16 or fp32).

    ``commit=False`` leaves the commit out (a stream that must write nothing). ``projector_version``
    states which projector made the features (0: none stated).
    """
    yield pb.IngestRequest(
        begin=pb.IngestBegin(namespace=namespace, fingerprint=fingerprint, projector_version=projector_version)
    )
    for index, entry in enumerate(entries):
        maps = np.asarray(entry.maps)  # (layers, heads, L, L)
        feature = [] if entry.feature is None else np.asarray(entry.feature, dtype=np.float32).tolist()
        token_ids = [] if entry.token_ids is None else np.asarray(entry.token_ids).tolist()
        yield pb.IngestRequest(
            entry=pb.EntryBegin(length=maps.shape[-1], token_hash=bytes(entry.token_hash), feature=feature,
                                token_ids=token_ids)
        )
        for layer in range(maps.shape[0]):
            for frame in map_frames(maps[layer], query_index=index, entry_id=0, layer=layer):
                yield pb.IngestRequest(maps=frame)
        if entry.outputs is not None:
            for part in output_frames(np.asarray(entry.outputs), query_index=index, entry_id=0):
                yield pb.IngestRequest(outputs=part)
    if commit:
        yield pb.IngestRequest(commit=pb.IngestCommit())




def assembled_lookup(stream: Iterator[pb.LookupResponse]) -> LookupResult:
    """Every message of one Lookup stream, assembled (a broken stream raises its grpc.RpcError)."""
    first = next(stream, None)
    if first is None or first.WhichOneof("body") != "matches":
        raise WireFormatError("a Lookup stream must start with the matches")
    result = LookupResult(matches=list(first.matches.matches))
    layers: dict[int, dict[int, np.ndarray]] = {}
    assembler = FrameAssembler(max_array_bytes=1 << 40)
    for message in stream:
        kind = message.WhichOneof("body")
        if kind == "error":
            result.row_errors[message.error.query_index] = message.error
            layers.pop(message.error.query_index, None)
            continue
        done = assembler.add(message.maps if kind == "maps" else message.outputs)
        if done is None:
            continue
        (query_index, what), array = done
        if what == "outputs":
            result.outputs[query_index] = array
        else:
            layers.setdefault(query_index, {})[int(what)] = array
    for query_index, by_layer in layers.items():
        result.maps[query_index] = np.stack([by_layer[i] for i in sorted(by_layer)])  # (layers, heads, L, L)
    return result
