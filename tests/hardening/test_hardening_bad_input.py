"""Hostile and broken input on the gRPC surface, generated with hypothesis, against one real daemon.

Every call gets a specific status code and a message that names the problem,
never INTERNAL; nothing of a refused write is stored; after each test the
daemon still reports SERVING and serves a good lookup exactly; its memory stays
bounded over the whole module.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from collections.abc import Iterator

import crc32c
import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from attnstore.protocol.records import LookupBatch
from attnstore.protocol.requests import ingest_requests, lookup_request
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.wire import map_frames
from attnstore_client.connection.daemon import DaemonClient
from attnstore_tools.machine import status_bytes
from tests.support.daemon import DaemonProcess
from tests.support.server_fixtures import FP, LAYOUT
from tests.support.stores import make_entry

LENGTH = 8
MAX_QUERIES = 64
MAX_INGEST_BYTES = 4 << 20
# RSS the module may add to the daemon: gRPC buffers, allocator arenas, the index of a few entries.
RSS_GROWTH_BYTES = 96 << 20
# Derandomized: the same examples on every run, so CI never flakes on a new draw.
FUZZ = settings(
    max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# Codes a daemon may answer to bad input; INTERNAL or UNKNOWN would mean it was not caught.
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DATA_LOSS,
}


def _rss_bytes(pid: int) -> int:
    return status_bytes(pid, "VmRSS")["VmRSS"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    workdir = tmp_path_factory.mktemp("bad-input")
    process = DaemonProcess(
        workdir / "store", workdir,
        extra_args=("--max-queries", str(MAX_QUERIES), "--max-ingest-bytes", str(MAX_INGEST_BYTES),
                    "--max-message-bytes", "5MiB", "--ingest-idle-seconds", "2"),
    ).start()
    with process.client() as remote:
        remote.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
        remote.ingest("ns", FP, [make_entry(LAYOUT, LENGTH, seed) for seed in range(4)])
        remote.lookup(_good_request())  # warm: first-call allocations are not growth
    process.rss_start = _rss_bytes(process.process.pid)  # type: ignore[attr-defined]
    yield process
    process.kill()


@pytest.fixture(scope="module")
def remote(daemon: DaemonProcess) -> Iterator[DaemonClient]:
    # The client may send more than the daemon takes: the daemon must be the one refusing.
    with daemon.client(max_message_bytes=64 << 20, timeout=30) as client:
        yield client


def _good_request() -> pb.LookupRequest:
    entry = make_entry(LAYOUT, LENGTH, 2)
    return lookup_request(LookupBatch("ns", FP, entry.feature[None], [LENGTH], max_distance=0.01))


@pytest.fixture(autouse=True)
def still_serving(daemon: DaemonProcess, remote: DaemonClient) -> Iterator[None]:
    """After each test: alive, SERVING, and a good lookup still returns the right maps."""
    yield
    assert daemon.process.poll() is None, daemon.log()
    assert remote.health() == "SERVING"
    result = remote.lookup(_good_request())
    np.testing.assert_array_equal(result.maps[0], make_entry(LAYOUT, LENGTH, 2).maps.astype(np.float16))
    assert remote.stats().entries == 4, "a refused call stored something"


def _refused(call, request: object, remote: DaemonClient) -> grpc.RpcError:
    """The error of a call that must fail; streamed replies are drained."""
    with pytest.raises(grpc.RpcError) as caught:
        reply = call(request, metadata=remote.metadata, timeout=30)
        if isinstance(reply, Iterator):
            list(reply)
    return caught.value


def _query(feature: list[float], length: int = LENGTH, token_hash: bytes = b"") -> pb.Query:
    return pb.Query(feature=feature, length=length, token_hash=token_hash)


# ---- features -----------------------------------------------------------------


@FUZZ
@given(dim=st.integers(0, 300).filter(lambda d: d != LAYOUT.feature_dim), rows=st.integers(1, 4))
def test_wrong_feature_dimension_is_invalid_argument_naming_the_dimension(
    remote: DaemonClient, dim: int, rows: int
) -> None:
    queries = [_query([0.5] * dim) for _ in range(rows)]
    for call, request in (
        (remote.stub.Lookup, pb.LookupRequest(namespace="ns", fingerprint=FP, queries=queries, max_distance=1.0)),
        (remote.stub.Search, pb.SearchRequest(namespace="ns", fingerprint=FP, queries=queries, max_distance=1.0)),
    ):
        error = _refused(call, request, remote)
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert f"have {LAYOUT.feature_dim} values" in error.details() and f"({dim},)" in error.details()


@FUZZ
@given(
    feature=hnp.arrays(np.float32, LAYOUT.feature_dim, elements=st.floats(width=32, allow_nan=True,
                                                                         allow_infinity=True))
    .filter(lambda a: not np.isfinite(a).all())
)
def test_nan_or_inf_features_are_invalid_argument(remote: DaemonClient, feature: np.ndarray) -> None:
    request = pb.LookupRequest(namespace="ns", fingerprint=FP, queries=[_query(feature.tolist())], max_distance=1.0)
    error = _refused(remote.stub.Lookup, request, remote)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and "NaN or Inf" in error.details()


@FUZZ
@given(threshold=st.one_of(st.just(float("nan")), st.floats(max_value=-1e-6, allow_infinity=True)))
def test_nan_or_negative_threshold_is_invalid_argument(remote: DaemonClient, threshold: float) -> None:
    request = _good_request()
    request.max_distance = threshold
    error = _refused(remote.stub.Lookup, request, remote)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and "max_distance" in error.details()


# ---- lengths --------------------------------------------------------------------


@FUZZ
@given(length=st.one_of(st.just(0), st.integers(LENGTH + 1, 2**32 - 1)))
def test_zero_length_is_refused_and_lengths_longer_than_any_entry_miss(remote: DaemonClient, length: int) -> None:
    entry = make_entry(LAYOUT, LENGTH, 2)
    request = pb.LookupRequest(
        namespace="ns", fingerprint=FP, queries=[_query(entry.feature.tolist(), length)], max_distance=1e6,
        want_maps=True,
    )
    if length == 0:
        error = _refused(remote.stub.Lookup, request, remote)
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and "length must be >= 1" in error.details()
    else:
        result = remote.lookup(request)
        assert result.matches[0].kind == pb.MATCH_KIND_MISS and not result.maps


def test_negative_length_on_the_wire_arrives_as_a_huge_one_and_misses(remote: DaemonClient) -> None:
    # A client that writes -1 into the uint32 varint sends 2**32 - 1 after truncation.
    query = _query(make_entry(LAYOUT, LENGTH, 2).feature.tolist(), 1)
    raw = query.SerializeToString().replace(b"\x10\x01", b"\x10" + b"\xff" * 9 + b"\x01")
    parsed = pb.Query.FromString(raw)
    assert parsed.length == 2**32 - 1
    request = pb.LookupRequest(namespace="ns", fingerprint=FP, queries=[parsed], max_distance=1e6)
    assert remote.lookup(request).matches[0].kind == pb.MATCH_KIND_MISS


@FUZZ
@given(length=st.integers(LENGTH + 1, 2**32 - 1))
def test_fetch_longer_than_the_entry_is_invalid_argument(remote: DaemonClient, length: int) -> None:
    request = pb.FetchRequest(namespace="ns", fingerprint=FP, entry_ids=[1], length=length)
    error = _refused(remote.stub.Fetch, request, remote)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and f"cannot serve length {length}" in error.details()


@FUZZ
@given(length=st.integers(512, 2**16 - 1), layers_sent=st.integers(0, 2))
def test_huge_ingest_entry_is_resource_exhausted_before_allocation(
    remote: DaemonClient, length: int, layers_sent: int
) -> None:
    # Shape claims (heads, L, L) fp32, over 4 MiB for the 3 layers, with only a token of data:
    # refused on the claim, not after buffering.
    def messages() -> Iterator[pb.IngestRequest]:
        yield pb.IngestRequest(begin=pb.IngestBegin(namespace="ns", fingerprint=FP))
        yield pb.IngestRequest(entry=pb.EntryBegin(length=length, token_hash=b"\x01" * 32))
        for layer in range(layers_sent + 1):
            yield pb.IngestRequest(maps=pb.MapFrame(
                layer=layer, dtype="float32", shape=[LAYOUT.heads, length, length], data=b"\x00" * 64,
                crc32c=crc32c.crc32c(b"\x00" * 64), total_bytes=LAYOUT.heads * length * length * 4,
            ))
        yield pb.IngestRequest(commit=pb.IngestCommit())

    error = _refused(remote.stub.Ingest, messages(), remote)
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "limit" in error.details()


# ---- batch and message sizes ------------------------------------------------------------


@FUZZ
@given(rows=st.integers(MAX_QUERIES + 1, 4 * MAX_QUERIES))
def test_batch_over_the_query_limit_is_resource_exhausted_naming_the_limit(remote: DaemonClient, rows: int) -> None:
    features = np.zeros((rows, LAYOUT.feature_dim), dtype=np.float32)
    for call, request in (
        (remote.stub.Lookup, lookup_request(LookupBatch("ns", FP, features, [LENGTH] * rows, max_distance=1.0))),
        (remote.stub.Search, pb.SearchRequest(namespace="ns", fingerprint=FP, max_distance=1.0,
                                              queries=[_query([0.0] * LAYOUT.feature_dim)] * rows)),
        (remote.stub.Fetch, pb.FetchRequest(namespace="ns", fingerprint=FP, entry_ids=[1] * rows)),
    ):
        error = _refused(call, request, remote)
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and str(MAX_QUERIES) in error.details()


@pytest.mark.parametrize("megabytes", [6, 40])
def test_message_over_the_size_cap_is_resource_exhausted(remote: DaemonClient, megabytes: int) -> None:
    blob = b"\x00" * (megabytes << 20)
    for call, request in (
        (remote.stub.CreateNamespace, pb.CreateNamespaceRequest(name="oversize", projector=blob)),
        (remote.stub.Lookup, pb.LookupRequest(namespace="ns", fingerprint=FP, queries=[_query([], token_hash=blob)])),
    ):
        error = _refused(call, request, remote)
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in error.details()
    assert "oversize" not in [n.name for n in remote.list_namespaces()]


# ---- namespaces and projectors ----------------------------------------------------------


@FUZZ
@given(name=st.text(max_size=40).filter(lambda n: n != "ns"))
def test_unknown_namespace_is_not_found_on_every_read_and_write(remote: DaemonClient, name: str) -> None:
    entry = make_entry(LAYOUT, LENGTH, 2)
    calls = (
        (remote.stub.GetNamespace, pb.GetNamespaceRequest(name=name)),
        (remote.stub.Lookup, lookup_request(LookupBatch(name, FP, entry.feature[None], [LENGTH], max_distance=1.0))),
        (remote.stub.Search, pb.SearchRequest(namespace=name, fingerprint=FP, queries=[_query([0.0] * 16)])),
        (remote.stub.Fetch, pb.FetchRequest(namespace=name, fingerprint=FP, entry_ids=[1])),
        (remote.stub.Prefetch, pb.PrefetchRequest(namespace=name, entry_ids=[1])),
        (remote.stub.Delete, pb.DeleteRequest(namespace=name, entry_ids=[1])),
        (remote.stub.Ingest, ingest_requests(name, FP, [make_entry(LAYOUT, LENGTH, 90)])),
    )
    for call, request in calls:
        error = _refused(call, request, remote)
        assert error.code() is grpc.StatusCode.NOT_FOUND and "no namespace" in error.details()


@pytest.mark.parametrize("name", ["", "ns\n", "-ns", "n s", "a/b", "x" * 129, "né"])
def test_invalid_namespace_names_are_refused_on_create_and_unknown_on_read(remote: DaemonClient, name: str) -> None:
    create = pb.CreateNamespaceRequest(
        name=name, model="tiny-synthetic", fingerprint=FP, layout=pb.Layout(**LAYOUT.to_json_dict())
    )
    error = _refused(remote.stub.CreateNamespace, create, remote)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and "namespace name" in error.details()
    error = _refused(remote.stub.GetNamespace, pb.GetNamespaceRequest(name=name), remote)
    assert error.code() is grpc.StatusCode.NOT_FOUND


def _header_blob(header: bytes, claimed: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if claimed is None else claimed) + header


MALFORMED_PROJECTORS = st.one_of(
    st.binary(min_size=1, max_size=7),  # shorter than the header size field (empty means "no projector")
    st.binary(max_size=64).flatmap(  # header size past the end of the blob
        lambda body: st.integers(len(body) + 1, 2**64 - 1).map(lambda n: _header_blob(body, n))
    ),
    st.binary(min_size=1, max_size=64).filter(lambda b: not _is_json(b)).map(_header_blob),  # header not JSON
    st.one_of(st.integers(), st.text(max_size=8), st.lists(st.integers(), max_size=3), st.none()).map(
        lambda value: _header_blob(json.dumps(value).encode())  # JSON, but not an object
    ),
)


def _is_json(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


@FUZZ
@given(blob=MALFORMED_PROJECTORS, suffix=st.integers(0, 10**9))
def test_malformed_projector_is_invalid_argument_and_creates_no_namespace(
    remote: DaemonClient, blob: bytes, suffix: int
) -> None:
    name = f"proj-{suffix}"
    request = pb.CreateNamespaceRequest(
        name=name, model="tiny-synthetic", fingerprint=FP, projector=blob,
        layout=pb.Layout(**LAYOUT.to_json_dict()),
    )
    error = _refused(remote.stub.CreateNamespace, request, remote)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and "projector" in error.details()
    assert name not in [n.name for n in remote.list_namespaces()]


# ---- ingest streams ---------------------------------------------------------------------------


def _valid_stream(seed: int) -> list[pb.IngestRequest]:
    entries = [make_entry(LAYOUT, LENGTH, seed), make_entry(LAYOUT, LENGTH + 2, seed + 1)]
    return list(ingest_requests("ns", FP, entries))


@FUZZ
@given(cut=st.integers(0, 100), seed=st.integers(1000, 10**6))
def test_ingest_stream_ending_early_is_invalid_argument_and_writes_nothing(
    remote: DaemonClient, cut: int, seed: int
) -> None:
    messages = _valid_stream(seed)
    messages = messages[: cut % (len(messages) - 1)]  # never the commit
    error = _refused(remote.stub.Ingest, iter(messages), remote)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "IngestBegin" in error.details() or "without a commit" in error.details()


_MUTATIONS = ("crc", "dtype", "shape", "layer", "offset", "total_bytes", "codec", "duplicate", "drop", "empty")


def _mutate(messages: list[pb.IngestRequest], index: int, how: str) -> list[pb.IngestRequest]:
    """``messages`` with one message at ``index`` (1..commit-1) broken in one way."""
    messages = [pb.IngestRequest.FromString(m.SerializeToString()) for m in messages]
    target = messages[index]
    kind = target.WhichOneof("body")
    part = getattr(target, kind)
    if how == "drop" and kind != "outputs":  # outputs are optional: dropping them leaves a valid stream
        del messages[index]
    elif how == "duplicate":
        messages.insert(index, messages[index])
    elif how == "empty":
        messages[index] = pb.IngestRequest()
    elif kind == "entry":
        part.length = 0 if how in ("shape", "layer") else part.length + 1
        del part.feature[:]
        part.feature.extend([float("nan")] * LAYOUT.feature_dim)
    elif how == "crc":
        part.crc32c ^= 1
    elif how == "dtype":
        part.dtype = "int8"
    elif how == "shape":
        part.shape[-1] += 1
    elif how == "layer" and kind == "maps":
        part.layer += LAYOUT.layers
    elif how == "offset":
        part.offset += 2
    elif how == "total_bytes":
        part.total_bytes += 2
    elif how == "codec" and kind == "maps":
        part.codec = "zstd"
    else:
        part.data = part.data[:-2]  # truncated data: the crc no longer matches
    return messages


@FUZZ
@given(seed=st.integers(1000, 10**6), position=st.floats(0, 1, exclude_max=True), how=st.sampled_from(_MUTATIONS))
def test_ingest_stream_with_one_broken_message_is_refused_and_writes_nothing(
    remote: DaemonClient, seed: int, position: float, how: str
) -> None:
    messages = _valid_stream(seed)
    index = 1 + int(position * (len(messages) - 2))  # between the begin and the commit
    error = _refused(remote.stub.Ingest, iter(_mutate(messages, index, how)), remote)
    assert error.code() in REFUSALS - {grpc.StatusCode.NOT_FOUND}, (how, error.code(), error.details())
    assert error.details() and "internal error" not in error.details()


@FUZZ
@given(
    namespace=st.sampled_from(["ns", "", "nope"]),
    fingerprint=st.sampled_from([FP, "", "0" * 64]),
    queries=st.lists(
        st.builds(
            pb.Query,
            feature=st.lists(st.floats(width=32), max_size=20),
            length=st.integers(0, 2**32 - 1),
            token_hash=st.binary(max_size=40),
        ),
        max_size=8,
    ),
    max_distance=st.floats(width=32),
    want_maps=st.booleans(),
    want_outputs=st.booleans(),
)
def test_any_lookup_is_answered_or_refused_never_internal(
    remote: DaemonClient, namespace: str, fingerprint: str, queries: list[pb.Query], max_distance: float,
    want_maps: bool, want_outputs: bool,
) -> None:
    request = pb.LookupRequest(
        namespace=namespace, fingerprint=fingerprint, queries=queries, max_distance=max_distance,
        want_maps=want_maps, want_outputs=want_outputs,
    )
    try:
        list(remote.stub.Lookup(request, metadata=remote.metadata, timeout=30))
    except grpc.RpcError as error:
        assert error.code() in REFUSALS, (error.code(), error.details())


def test_undecodable_request_bytes_are_refused_by_grpc_and_the_daemon_goes_on(remote: DaemonClient) -> None:
    raw = remote._channel.unary_unary(
        "/attnstore.v1.AttnStore/Stats", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    with pytest.raises(grpc.RpcError) as caught:
        raw(b"\xff\xff\xff\x07not protobuf", metadata=remote.metadata, timeout=10)
    # grpc itself answers undecodable bytes, before any AttnStore code runs.
    assert caught.value.code() is grpc.StatusCode.INTERNAL and "deserializing" in caught.value.details()


# ---- issue 18: probes of bounds, echoes and partial effects -------------------------------------


def test_an_ingest_part_sent_twice_is_invalid_argument_and_writes_nothing(remote: DaemonClient) -> None:
    # Two parts per layer; the first part of layer 0 twice and never the second: counting bytes received
    # completed the layer with half of it uninitialised daemon memory.
    entry = make_entry(LAYOUT, LENGTH, 4242)
    messages = list(ingest_requests("ns", FP, [entry]))
    (begin, head), layer_bytes = messages[:2], entry.maps[0].astype(np.float16).nbytes
    parts = []
    for layer in range(LAYOUT.layers):
        first, second = map_frames(
            entry.maps[layer].astype(np.float16), query_index=0, entry_id=0, layer=layer, max_bytes=layer_bytes // 2
        )
        parts += [first, first] if layer == 0 else [first, second]
    stream = [begin, head, *(pb.IngestRequest(maps=c) for c in parts), pb.IngestRequest(commit=pb.IngestCommit())]
    error = _refused(remote.stub.Ingest, iter(stream), remote)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and "overlaps" in error.details()


def test_a_huge_namespace_name_is_invalid_argument_with_a_short_message(remote: DaemonClient) -> None:
    name = "x" * 10_000
    create = pb.CreateNamespaceRequest(
        name=name, model="tiny-synthetic", fingerprint=FP, layout=pb.Layout(**LAYOUT.to_json_dict())
    )
    error = _refused(remote.stub.CreateNamespace, create, remote)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "namespace name" in error.details() and len(error.details()) < 400
    error = _refused(remote.stub.GetNamespace, pb.GetNamespaceRequest(name=name), remote)
    assert error.code() is grpc.StatusCode.NOT_FOUND and len(error.details()) < 400


def test_not_found_messages_never_name_the_store_path(daemon: DaemonProcess, remote: DaemonClient) -> None:
    for request in (pb.GetNamespaceRequest(name="nope"), pb.FetchRequest(namespace="nope", fingerprint=FP)):
        call = remote.stub.GetNamespace if isinstance(request, pb.GetNamespaceRequest) else remote.stub.Fetch
        error = _refused(call, request, remote)
        assert error.code() is grpc.StatusCode.NOT_FOUND
        assert str(daemon.store) not in error.details() and "/" not in error.details(), error.details()


def test_prefetch_past_the_id_limit_is_resource_exhausted(remote: DaemonClient) -> None:
    request = pb.PrefetchRequest(namespace="ns", entry_ids=list(range(1, MAX_QUERIES + 2)))
    error = _refused(remote.stub.Prefetch, request, remote)
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and f"limit of {MAX_QUERIES}" in error.details()


def test_prefetch_reports_what_it_queued_and_logs_unknown_ids_once_as_a_count(
    daemon: DaemonProcess, remote: DaemonClient
) -> None:
    unknown = list(range(10**6, 10**6 + MAX_QUERIES - 1))
    reply = remote.prefetch("ns", [1, *unknown])
    # Entry 1 is queued unless an earlier test left it in the DRAM cache; unknown ids never are.
    assert reply.queued in (0, 1) and reply.unknown == len(unknown)
    log = daemon.log()
    assert log.count("event=prefetch_unknown namespace=ns unknown=63") == 1
    assert str(unknown[-1]) not in log


def test_a_delete_with_one_invalid_id_deletes_nothing(remote: DaemonClient) -> None:
    for bad in (2**63, 2**64 - 1, 0):
        error = _refused(remote.stub.Delete, pb.DeleteRequest(namespace="ns", entry_ids=[1, 2, 3, 4, bad]), remote)
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and "position 4" in error.details()
    # The autouse check then finds all four entries, and the good lookup's map hit (entry 3) served.


@pytest.mark.parametrize("length", [5, LENGTH + 1, 2**32 - 1])
def test_an_exact_hit_needs_the_stored_length(remote: DaemonClient, length: int) -> None:
    entry = make_entry(LAYOUT, LENGTH, 2)
    request = pb.LookupRequest(
        namespace="ns", fingerprint=FP, queries=[_query(entry.feature.tolist(), length, entry.token_hash)],
        max_distance=0.01, want_outputs=True,
    )
    (first, *_) = remote.stub.Lookup(request, metadata=remote.metadata, timeout=30)
    (match,) = first.matches.matches
    assert match.kind != pb.MATCH_KIND_EXACT and match.stored_length != length


def test_idle_ingest_streams_are_ended_and_free_their_slots(remote: DaemonClient) -> None:
    # Four streams (every slot) that send their begin and then nothing; the daemon's idle limit is 2 s.
    hold = threading.Event()

    def idle_stream() -> Iterator[pb.IngestRequest]:
        yield next(ingest_requests("ns", FP, []))
        hold.wait(30)

    errors: list[grpc.RpcError] = []

    def run() -> None:
        try:
            remote.stub.Ingest(idle_stream(), metadata=remote.metadata, timeout=30)
        except grpc.RpcError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    hold.set()
    assert time.monotonic() - start < 15 and len(errors) == 4
    assert {e.code() for e in errors} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert all("sent nothing for 2 s" in e.details() for e in errors)
    assert remote.ingest("ns", FP, [make_entry(LAYOUT, LENGTH, 0)]).duplicates == 1  # the slots are free


# ---- memory ------------------------------------------------------------------------------------


def test_daemon_memory_stays_bounded_after_the_suite(daemon: DaemonProcess, remote: DaemonClient) -> None:
    # Runs last in this module: everything above has been thrown at the daemon by now.
    growth = _rss_bytes(daemon.process.pid) - daemon.rss_start  # type: ignore[attr-defined]
    assert growth < RSS_GROWTH_BYTES, f"daemon RSS grew by {growth >> 20} MiB"
