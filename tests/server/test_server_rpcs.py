"""The servicer's protocol, on an in-process server over an in-memory store."""

from __future__ import annotations

import logging
import struct
import threading
from typing import Any

import crc32c
import grpc
import numpy as np
import pytest
import safetensors.numpy

from attnstore.errors import (
    ChecksumError,
    EntryNotFoundError,
    FingerprintMismatchError,
    MapShapeError,
    NamespaceExistsError,
    NamespaceNotFoundError,
    NamespaceNotReadyError,
    ProjectorChangedError,
    RequestLimitError,
    UnavailableError,
    WireFormatError,
)
from attnstore.projector.blob import GATE_METADATA_KEY
from attnstore.projector.gate import FidelityGate
from attnstore.protocol.records import LookupBatch
from attnstore.protocol.requests import ingest_requests, lookup_request
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.wire import map_frames
from attnstore.server.config import ServerLimits
from attnstore.service import AttnStoreService
from attnstore.store import NewEntry
from attnstore_tools.admin.train_projector import fetch_maps
from tests.support.server_fixtures import FP, LAYOUT, memory_service, served
from tests.support.stores import make_entry
from tests.support.wait import wait_until

L = 6


def _entries(*seeds: int, length: int = L) -> list[NewEntry]:
    return [make_entry(LAYOUT, length, seed) for seed in seeds]


def _request(
    entries: list[NewEntry], *, want_maps: bool = True, want_outputs: bool | None = None, **options: Any
) -> pb.LookupRequest:
    options.setdefault("max_distance", 0.01)
    batch = LookupBatch("ns", FP, np.stack([e.feature for e in entries]), [L] * len(entries), **options)
    return lookup_request(batch, want_maps=want_maps, want_outputs=want_outputs)


def _code(excinfo: pytest.ExceptionInfo[grpc.RpcError]) -> grpc.StatusCode:
    return excinfo.value.code()


class _FailingReads(AttnStoreService):
    """Reads of one entry fail from a given layer on (a corrupt stored object)."""

    bad_entry = -1
    bad_from_layer = 0

    def read_layer(self, namespace: str, entry_id: int, layer: int, length: int | None = None) -> np.ndarray:
        if entry_id == self.bad_entry and layer >= self.bad_from_layer:
            raise ChecksumError(f"entry {entry_id} layer {layer}: crc32c mismatch")
        return super().read_layer(namespace, entry_id, layer, length)


def test_lookup_streams_matches_then_outputs_then_maps_in_layer_order() -> None:
    service = memory_service()
    entries = _entries(1, 2, 3)
    with served(service) as (_, remote):
        ids = remote.ingest("ns", FP, entries).entry_ids
        request = _request(entries, token_hashes=[entries[0].token_hash, None, None])
        messages = list(remote.iter_lookup(request))
    assert messages[0].WhichOneof("body") == "matches"
    kinds = [(m.kind, m.entry_id) for m in messages[0].matches.matches]
    assert kinds == [(pb.MATCH_KIND_EXACT, ids[0]), (pb.MATCH_KIND_MAP, ids[1]), (pb.MATCH_KIND_MAP, ids[2])]
    assert [m.WhichOneof("body") for m in messages[1:2]] == ["outputs"]
    order = [(m.maps.layer, m.maps.query_index) for m in messages[2:]]
    assert order == [(layer, row) for layer in range(LAYOUT.layers) for row in (1, 2)]


def test_lookup_without_want_outputs_skips_the_exact_tier_and_without_want_maps_sends_matches_only() -> None:
    entries = _entries(1)
    with served(memory_service()) as (_, remote):
        remote.ingest("ns", FP, entries)
        no_outputs = remote.lookup(_request(entries, token_hashes=[entries[0].token_hash], want_outputs=False))
        no_maps = list(remote.iter_lookup(_request(entries, want_maps=False)))
    assert no_outputs.matches[0].kind == pb.MATCH_KIND_MAP and 0 in no_outputs.maps and not no_outputs.outputs
    assert [m.WhichOneof("body") for m in no_maps] == ["matches"]


def test_exact_hit_stored_without_outputs_is_served_as_a_map_hit_at_distance_zero() -> None:
    entry = make_entry(LAYOUT, L, 4, outputs=False)
    with served(memory_service()) as (_, remote):
        remote.ingest("ns", FP, [entry])
        result = remote.lookup(_request([entry], token_hashes=[entry.token_hash]))
    match = result.matches[0]
    assert (match.kind, match.distance) == (pb.MATCH_KIND_MAP, 0.0)
    np.testing.assert_array_equal(result.maps[0], entry.maps.astype(np.float16))


def test_unreadable_entry_mid_stream_drops_only_its_row_with_a_row_error() -> None:
    service = _FailingReads(memory_service().store)
    entries = _entries(1, 2)
    with served(service) as (_, remote):
        ids = remote.ingest("ns", FP, entries).entry_ids
        service.bad_entry, service.bad_from_layer = ids[0], 1
        messages = list(remote.iter_lookup(_request(entries)))
        result = remote.lookup(_request(entries))
    frames = [(m.maps.query_index, m.maps.layer) for m in messages if m.WhichOneof("body") == "maps"]
    assert (0, 0) in frames and not any(q == 0 and layer > 0 for q, layer in frames)
    assert sorted(layer for q, layer in frames if q == 1) == list(range(LAYOUT.layers))
    (error,) = [m.error for m in messages if m.WhichOneof("body") == "error"]
    assert (error.query_index, error.entry_id, error.code) == (0, ids[0], "DATA_LOSS") and "crc32c" in error.message
    assert set(result.maps) == {1} and set(result.row_errors) == {0}


def test_rows_hitting_one_entry_read_each_layer_once() -> None:
    service = memory_service()
    reads: list[tuple[int, int]] = []
    original = service.read_layer

    def counting(namespace: str, entry_id: int, layer: int, length: int | None = None) -> np.ndarray:
        reads.append((entry_id, layer))
        return original(namespace, entry_id, layer, length)

    service.read_layer = counting  # type: ignore[method-assign]
    entry = _entries(1)[0]
    with served(service) as (_, remote):
        remote.ingest("ns", FP, [entry])
        result = remote.lookup(_request([entry, entry, entry]))
    assert len(reads) == LAYOUT.layers and set(result.maps) == {0, 1, 2}


def test_bad_lookups_get_their_status_codes() -> None:
    entries = _entries(1)
    limits = ServerLimits(max_queries=2)
    with served(memory_service(), limits=limits) as (_, remote):
        remote.ingest("ns", FP, entries)
        with pytest.raises(RequestLimitError, match="limit of 2"):
            remote.lookup(_request(entries * 3))
        nan = _request(entries)
        nan.queries[0].feature[0] = float("nan")
        with pytest.raises(grpc.RpcError) as caught:
            list(remote.stub.Lookup(nan))
        assert _code(caught) is grpc.StatusCode.INVALID_ARGUMENT
        short = lookup_request(LookupBatch("ns", FP, np.zeros((1, 3), np.float32), [L], max_distance=1.0))
        with pytest.raises(MapShapeError, match="16 values"):
            remote.lookup(short)
        with pytest.raises(NamespaceNotFoundError, match="nope"):
            remote.lookup(lookup_request(LookupBatch("nope", FP, np.zeros((1, 16), np.float32), [L], max_distance=1.0)))


def test_search_matches_without_streaming_maps() -> None:
    entries = _entries(1, 2)
    with served(memory_service()) as (_, remote):
        ids = remote.ingest("ns", FP, entries).entry_ids
        request = _request(entries)
        search = pb.SearchRequest(namespace="ns", fingerprint=FP, queries=request.queries, max_distance=0.01)
        matches = remote.search(search)
    assert [m.entry_id for m in matches] == list(ids)


def test_fetch_streams_cropped_maps_and_refuses_unknown_ids_and_wrong_fingerprints() -> None:
    entries = _entries(1, 2)
    with served(memory_service()) as (_, remote):
        ids = remote.ingest("ns", FP, entries).entry_ids
        maps = fetch_maps(remote, "ns", FP, [ids[1], ids[0]], length=4)
        with pytest.raises(EntryNotFoundError):
            fetch_maps(remote, "ns", FP, [ids[0], 999])
        with pytest.raises(FingerprintMismatchError):
            fetch_maps(remote, "ns", "0" * 64, ids)
    np.testing.assert_array_equal(maps[0], entries[1].maps.astype(np.float16)[..., :4, :4])
    np.testing.assert_array_equal(maps[1], entries[0].maps.astype(np.float16)[..., :4, :4])


def test_ingest_counts_duplicates_and_delete_removes_entries_from_lookups() -> None:
    entries = _entries(1, 2)
    with served(memory_service()) as (_, remote):
        first = remote.ingest("ns", FP, entries)
        again = remote.ingest("ns", FP, entries[:1])
        assert (again.duplicates, list(again.entry_ids)) == (1, [first.entry_ids[0]])
        assert remote.delete("ns", [first.entry_ids[0]]) == 1
        result = remote.lookup(_request(entries))
        # The memory store holds every entry in memory already: nothing to queue, nothing unknown.
        prefetched = remote.prefetch("ns", [first.entry_ids[1]])
        assert remote.stats().entries == 1 and (prefetched.queued, prefetched.unknown) == (0, 0)
    assert [m.kind for m in result.matches] == [pb.MATCH_KIND_MISS, pb.MATCH_KIND_MAP]


def test_ingested_token_ids_reach_the_store_and_gated_lookups_use_them() -> None:
    service = memory_service()
    gate = FidelityGate(weights=(0.0, 0.0, 0.0, 0.0, -5.0, 0.0), bias=3.0, min_probability=0.9, candidates=2,
                        fidelity=0.99, precision=0.95)
    service.set_projector("ns", safetensors.numpy.save({"w": np.zeros(1, np.float32)},
                                                      metadata={GATE_METADATA_KEY: gate.to_json()}))
    entries = _entries(1, 2)
    with served(service) as (_, remote):
        ids = remote.ingest("ns", FP, entries).entry_ids
        tokens = [entries[1].token_ids, np.zeros(L, dtype=np.int64)]  # row 0 has entry 1's tokens, row 1 no match
        request = _request([entries[0], entries[0]], token_ids=tokens, gate=True)
        result = remote.lookup(request)
        with pytest.raises(MapShapeError, match="INVALID_ARGUMENT: query 0: a gated lookup needs the row's token ids"):
            remote.lookup(_request(entries, gate=True))
    np.testing.assert_array_equal(service.store.entry("ns", ids[1]).token_ids, entries[1].token_ids)
    assert [(m.kind, m.entry_id) for m in result.matches] == [(pb.MATCH_KIND_MAP, ids[1]), (pb.MATCH_KIND_MISS, 0)]
    np.testing.assert_array_equal(result.maps[0], entries[1].maps.astype(np.float16))


def test_a_gated_lookup_on_a_namespace_without_a_gate_is_failed_precondition() -> None:
    entries = _entries(1)
    with served(memory_service()) as (_, remote):
        remote.ingest("ns", FP, entries)
        with pytest.raises(NamespaceNotReadyError, match="FAILED_PRECONDITION: namespace 'ns' has no fidelity gate"):
            remote.lookup(_request(entries, token_ids=[entries[0].token_ids], gate=True))


def _stream(entry: NewEntry, *, drop: str = "", extra: list[pb.IngestRequest] | None = None) -> list[pb.IngestRequest]:
    messages = [m for m in ingest_requests("ns", FP, [entry]) if m.WhichOneof("body") != drop]
    return messages + (extra or [])


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("no_begin", "start with an IngestBegin"),
        ("frame_first", "before any EntryBegin"),
        ("missing_layer", "incomplete"),
        ("wrong_shape", "does not fit the layout"),
        ("after_commit", "after its commit"),
        ("bad_crc", "crc32c"),
    ],
)
def test_malformed_ingest_streams_write_nothing(case: str, match: str) -> None:
    entry = _entries(1)[0]
    messages = _stream(entry)
    if case == "no_begin":
        messages = messages[1:]
    elif case == "frame_first":
        messages = [messages[0], *messages[2:]]
    elif case == "missing_layer":
        messages = [m for m in messages if not (m.WhichOneof("body") == "maps" and m.maps.layer == 2)]
    elif case == "wrong_shape":
        (bad,) = map_frames(np.zeros((LAYOUT.heads, L + 1, L + 1), np.float16), query_index=0, entry_id=0, layer=0)
        messages = [messages[0], messages[1], pb.IngestRequest(maps=bad), *messages[2:]]
    elif case == "after_commit":
        messages = [*messages, pb.IngestRequest(commit=pb.IngestCommit())]
    elif case == "bad_crc":
        messages[2].maps.crc32c ^= 1
    with served(memory_service()) as (_, remote):
        with pytest.raises(grpc.RpcError) as caught:
            remote.stub.Ingest(iter(messages))
        assert caught.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DATA_LOSS)
        assert match in caught.value.details()
        assert remote.stats().entries == 0


def test_ingest_stream_over_its_staging_limit_is_resource_exhausted_before_allocating() -> None:
    limits = ServerLimits(max_ingest_bytes=10_000)
    huge = pb.EntryBegin(length=1_000_000, token_hash=b"h" * 32)
    (frame,) = map_frames(np.zeros((LAYOUT.heads, 2, 2), np.float16), query_index=0, entry_id=0, layer=0)
    frame.shape[:] = [LAYOUT.heads, 1_000_000, 1_000_000]
    messages = [next(ingest_requests("ns", FP, [])), pb.IngestRequest(entry=huge), pb.IngestRequest(maps=frame)]
    with served(memory_service(), limits=limits) as (_, remote):
        with pytest.raises(grpc.RpcError) as caught:
            remote.stub.Ingest(iter(messages))
        assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(RequestLimitError):
            remote.ingest("ns", FP, _entries(*range(20)))  # about 21 kB of fp32 arrays
        assert remote.stats().entries == 0


def test_ingest_streams_past_the_concurrency_limit_are_refused() -> None:
    limits = ServerLimits(max_ingest_streams=1)
    release = threading.Event()

    def slow_stream():
        yield from ingest_requests("ns", FP, [], commit=False)
        release.wait(10)
        yield pb.IngestRequest(commit=pb.IngestCommit())

    with served(memory_service(), limits=limits) as (server, remote):
        first = remote.stub.Ingest.future(slow_stream())
        wait_until(lambda: not server.servicer._ingest_slots._value, 10, "the first Ingest stream holding the slot")
        with pytest.raises(RequestLimitError, match="Ingest streams are running"):
            remote.ingest("ns", FP, _entries(1))
        release.set()
        assert first.result(10).entries == 0


def test_create_namespace_keeps_a_safetensors_projector_and_refuses_garbage() -> None:
    header = b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    blob = struct.pack("<Q", len(header)) + header + b"\0\0\0\0"
    with served(memory_service()) as (_, remote):
        created = remote.create_namespace("p", model="m", fingerprint=FP, layout=LAYOUT, projector=blob)
        assert created.projector == blob and remote.get_namespace("p").projector == blob
        assert {n.name: n.projector for n in remote.list_namespaces()} == {"ns": b"", "p": b""}
        with pytest.raises(WireFormatError, match="safetensors"):
            remote.create_namespace("q", model="m", fingerprint=FP, layout=LAYOUT, projector=b"\x80pickle")


def test_replacing_a_projector_is_explicit_versioned_and_stale_lookups_are_told_so() -> None:
    one, two = (safetensors.numpy.save({"w": np.full(1, v, np.float32)}) for v in (1.0, 2.0))
    entries = _entries(1, 2)
    with served(memory_service()) as (_, remote):
        created = remote.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT, projector=one)
        assert (created.projector_version, created.projector_crc32c) == (1, crc32c.crc32c(one))
        remote.ingest("ns", FP, entries, projector_version=1)
        assert remote.lookup(_request(entries, projector_version=1)).matches[0].kind == pb.MATCH_KIND_MAP
        with pytest.raises(NamespaceExistsError, match="ALREADY_EXISTS.*another projector"):
            remote.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT, projector=two)
        assert remote.get_namespace("ns").projector == one
        replaced = remote.create_namespace(
            "ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT, projector=two, replace_projector=True
        )
        assert (replaced.projector_version, replaced.projector) == (2, two)
        for call in (
            lambda: remote.lookup(_request(entries, projector_version=1)),
            lambda: remote.ingest("ns", FP, entries, projector_version=1),
        ):
            with pytest.raises(ProjectorChangedError, match="FAILED_PRECONDITION.*version 2"):
                call()
        # The old features are gone: no map hit until entries come again with the new projector's.
        assert remote.lookup(_request(entries, projector_version=2)).matches[0].kind == pb.MATCH_KIND_MISS
        assert remote.ingest("ns", FP, entries[:1], projector_version=2).duplicates == 1
        kinds = [m.kind for m in remote.lookup(_request(entries, projector_version=2)).matches]
        assert kinds == [pb.MATCH_KIND_MAP, pb.MATCH_KIND_MISS]


def test_calls_before_a_service_is_attached_are_unavailable_and_health_not_serving() -> None:
    with served(None) as (server, remote):
        assert remote.health() == "NOT_SERVING"
        with pytest.raises(UnavailableError, match="not serving"):
            remote.stats()
        server.attach(memory_service())
        assert remote.health() == "SERVING" and remote.stats().entries == 0


def test_unexpected_exception_is_internal_and_logged_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    service = memory_service()

    def broken() -> None:
        raise RuntimeError("boom in stats")

    service.store.stats = broken  # type: ignore[method-assign]
    with served(service) as (_, remote), caplog.at_level(logging.ERROR, logger="attnstore.protocol.status_codes"):
        with pytest.raises(grpc.RpcError) as caught:
            remote.stub.Stats(pb.StatsRequest())
    assert caught.value.code() is grpc.StatusCode.INTERNAL and "boom" not in caught.value.details()
    (record,) = [r for r in caplog.records if "rpc_failed" in r.getMessage()]
    assert record.exc_info is not None and "boom in stats" in str(record.exc_info[1])


def test_verify_and_compact_report_through_the_wire() -> None:
    with served(memory_service()) as (_, remote):
        remote.ingest("ns", FP, _entries(1, 2))
        report = remote.verify()
        compacted = remote.compact()
    assert (report.entries_checked, list(report.corrupt)) == (2, [])
    assert compacted.entries == 2


def test_list_entries_and_set_features_feature_stored_entries_for_lookups_at_once() -> None:
    one = safetensors.numpy.save({"w": np.full(1, 1.0, np.float32)})
    featured = _entries(1, 2, 3)
    service = memory_service()
    with served(service) as (_, remote):
        remote.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT, projector=one)
        ids = list(remote.ingest("ns", FP, [make_entry(LAYOUT, L, s, feature=False) for s in (1, 2, 3)]).entry_ids)
        outputs_only = make_entry(LAYOUT, L, 4, feature=False)
        service.ingest("ns", FP, [NewEntry(maps=None, token_hash=outputs_only.token_hash,
                                           outputs=outputs_only.outputs, token_ids=outputs_only.token_ids)])
        listed = list(remote.iter_entries("ns"))
        assert [(e.has_maps, e.has_feature, len(e.token_ids)) for e in listed] == [(True, False, L)] * 3 + [
            (False, False, L)
        ]
        assert [e.entry_id for e in remote.iter_entries("ns", maps_only=True)] == ids
        assert remote.lookup(_request(featured, projector_version=1)).matches[0].kind == pb.MATCH_KIND_MISS
        features = np.stack([e.feature for e in featured])
        with pytest.raises(ProjectorChangedError, match="FAILED_PRECONDITION.*version 1.*version 2"):
            remote.set_features("ns", 2, ids, features)
        with pytest.raises(MapShapeError, match=r"INVALID_ARGUMENT.*\[8\] floats.*feature_dim 16"):
            remote.set_features("ns", 1, ids, features[:, :8])
        with pytest.raises(MapShapeError, match="INVALID_ARGUMENT.*outputs only"):
            remote.set_features("ns", 1, [ids[0], listed[3].entry_id], features[:2])
        assert not any(e.has_feature for e in remote.iter_entries("ns"))  # every refusal wrote nothing
        remote.delete("ns", [ids[2]])
        reply = remote.set_features("ns", 1, ids, features)
        assert (reply.updated, list(reply.missing)) == (2, [ids[2]])
        kinds = [m.kind for m in remote.lookup(_request(featured, projector_version=1)).matches]
        assert kinds == [pb.MATCH_KIND_MAP, pb.MATCH_KIND_MAP, pb.MATCH_KIND_MISS]
