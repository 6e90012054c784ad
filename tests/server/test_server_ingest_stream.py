"""Staging an Ingest stream: assembly, layout checks, and the byte limit before allocation."""

from __future__ import annotations

import numpy as np
import pytest

from attnstore.errors import RequestLimitError, WireFormatError
from attnstore.protocol.requests import ingest_requests
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.wire import map_frames
from attnstore.server.ingest_stream import IngestStaging
from tests.support.server_fixtures import FP, LAYOUT
from tests.support.stores import make_entry


def _messages(*entries) -> list[pb.IngestRequest]:
    return list(ingest_requests("ns", FP, entries))[1:]  # after the begin


def test_entries_are_assembled_from_parts_in_stream_order() -> None:
    entries = [make_entry(LAYOUT, 5, 1), make_entry(LAYOUT, 7, 2, outputs=False, feature=False)]
    staging = IngestStaging(LAYOUT, max_bytes=1 << 20)
    assert [staging.add(m) for m in _messages(*entries)][-1] is True
    first, second = staging.entries()
    np.testing.assert_array_equal(first.maps, entries[0].maps)
    np.testing.assert_array_equal(first.outputs, entries[0].outputs)
    np.testing.assert_array_equal(first.feature, entries[0].feature)
    assert first.token_hash == entries[0].token_hash
    assert second.outputs is None and second.feature is None and second.maps.shape == (3, 2, 7, 7)
    assert staging.received_bytes == sum(e.maps.nbytes for e in entries) + entries[0].outputs.nbytes


def test_layers_split_into_parts_are_put_back_together() -> None:
    entry = make_entry(LAYOUT, 9, 3)
    staging = IngestStaging(LAYOUT, max_bytes=1 << 20)
    staging.add(pb.IngestRequest(entry=pb.EntryBegin(length=9, token_hash=entry.token_hash)))
    for layer in range(LAYOUT.layers):
        for frame in map_frames(entry.maps[layer], query_index=0, entry_id=0, layer=layer, max_bytes=100):
            staging.add(pb.IngestRequest(maps=frame))
    staging.add(pb.IngestRequest(commit=pb.IngestCommit()))
    np.testing.assert_array_equal(staging.entries()[0].maps, entry.maps)


def test_huge_entry_is_refused_before_memory_is_allocated() -> None:
    staging = IngestStaging(LAYOUT, max_bytes=1 << 20)
    staging.add(pb.IngestRequest(entry=pb.EntryBegin(length=2_000_000, token_hash=b"h" * 32)))
    (frame,) = map_frames(np.zeros((2, 2, 2), np.float16), query_index=0, entry_id=0, layer=0)
    frame.shape[:] = [2, 2_000_000, 2_000_000]  # 16 TB if it were allocated
    with pytest.raises(RequestLimitError, match="limit of 1048576 bytes"):
        staging.add(pb.IngestRequest(maps=frame))


def test_the_limit_counts_every_entry_of_the_stream() -> None:
    entry = make_entry(LAYOUT, 6, 1, outputs=False)
    staging = IngestStaging(LAYOUT, max_bytes=entry.maps.nbytes + 10)
    for message in _messages(entry)[:-1]:
        staging.add(message)
    second = make_entry(LAYOUT, 6, 2, outputs=False)
    with pytest.raises(RequestLimitError):
        for message in _messages(second):
            staging.add(message)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda ms: ms.insert(2, ms[1]), "sent twice"),
        (lambda ms: setattr(ms[1].maps, "layer", 7), "out of range"),
        (lambda ms: setattr(ms[1].maps, "dtype", "int8"), "dtype must be one of"),
        (lambda ms: ms[0].entry.__setattr__("length", 0), "length must be >= 1"),
        (lambda ms: ms.insert(0, pb.IngestRequest(begin=pb.IngestBegin())), "unexpected begin"),
    ],
)
def test_out_of_order_or_misfit_messages_are_refused(mutate, match: str) -> None:
    messages = _messages(make_entry(LAYOUT, 4, 1))
    mutate(messages)
    staging = IngestStaging(LAYOUT, max_bytes=1 << 20)
    with pytest.raises(WireFormatError, match=match):
        for message in messages:
            staging.add(message)


def test_layers_of_one_entry_must_share_a_dtype() -> None:
    entry = make_entry(LAYOUT, 4, 1, outputs=False)
    staging = IngestStaging(LAYOUT, max_bytes=1 << 20)
    staging.add(pb.IngestRequest(entry=pb.EntryBegin(length=4, token_hash=entry.token_hash)))
    (first,) = map_frames(entry.maps[0], query_index=0, entry_id=0, layer=0)
    (second,) = map_frames(entry.maps[1].astype(np.float16), query_index=0, entry_id=0, layer=1)
    staging.add(pb.IngestRequest(maps=first))
    with pytest.raises(WireFormatError, match="share one dtype"):
        staging.add(pb.IngestRequest(maps=second))
