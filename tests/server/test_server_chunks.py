"""The chunk tier through the real daemon (LMDB): ChunkMatch, FetchChunks layer by layer, PutChunks with a write
token; another model or chunk layout is FAILED_PRECONDITION naming both; a damaged chunk is a DATA_LOSS row naming
it, a missing one NOT_FOUND, and the other chunks are served; only an admin's put records a namespace's missing chunk
layout (tests/server/test_server_puts.py has the keys, admission, encoders and drop-writer)."""

from __future__ import annotations

import dataclasses
import urllib.request

import grpc
import numpy as np
import pytest

from attnstore.errors import AuthError, ChecksumError, EntryNotFoundError, FingerprintMismatchError
from attnstore.protocol.chunks import ChunkLayout, StoredChunk
from attnstore.protocol.keys import chunk_key
from attnstore.protocol.prefix_wire import chunk_data_array, chunk_layout_to_pb
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.v1 import attnstore_pb2_grpc as pb_grpc
from attnstore.store import LmdbMapStore
from attnstore_client.connection import connect
from attnstore_client.connection.channel import open_channel
from tests.support.chunks import damage_chunk
from tests.support.daemon import ADMIN_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess
from tests.support.stores import small_layout

FP = "f" * 64
LAYOUT = ChunkLayout(layers=3, kv_heads=2, head_dim=5, dtype="float32")


def _chunk(seed: int, length: int) -> StoredChunk:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1000, size=length)
    return StoredChunk(chunk_key(None, ids),
                       rng.standard_normal((LAYOUT.layers, *LAYOUT.layer_shape(length))).astype(np.float32),
                       token_ids=ids)


CHUNKS = [_chunk(0, 4), _chunk(1, 7), _chunk(2, 1)]  # the third is damaged at its layer 1
MISSING = _chunk(3, 2)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("chunks")
    with LmdbMapStore.open(workdir / "store", create=True) as store:
        store.create_namespace("ns", model="tiny", fingerprint=FP, layout=small_layout())
        for name in ("empty", "blank"):
            store.create_namespace(name, model="tiny", fingerprint=FP, layout=small_layout())
        store.chunks.set_layout("ns", LAYOUT)
        store.chunks.put("ns", CHUNKS)
    damage_chunk(workdir / "store", "ns", CHUNKS[2].key, layer=1)
    process = DaemonProcess(workdir / "store", workdir, extra_args=("--admit-after", "1")).start()
    yield process
    assert process.stop() == 0, process.log()


def _stub(daemon: DaemonProcess) -> pb_grpc.AttnStoreStub:
    return pb_grpc.AttnStoreStub(open_channel(daemon.target))


def _auth(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def _fetch(daemon: DaemonProcess, keys: list[bytes], *, layout: ChunkLayout = LAYOUT, fingerprint: str = FP,
           namespace: str = "ns") -> list[pb.ChunkData]:
    request = pb.FetchChunksRequest(namespace=namespace, fingerprint=fingerprint, layout=chunk_layout_to_pb(layout),
                                    keys=keys)
    return list(_stub(daemon).FetchChunks(request, metadata=_auth(READ_TOKEN)))


def test_chunk_match_answers_each_keys_stored_length_and_zero_for_a_missing_one(daemon: DaemonProcess) -> None:
    request = pb.ChunkMatchRequest(namespace="ns", fingerprint=FP, layout=chunk_layout_to_pb(LAYOUT),
                                   keys=[c.key for c in (*CHUNKS, MISSING)])
    assert list(_stub(daemon).ChunkMatch(request, metadata=_auth(READ_TOKEN)).lengths) == [4, 7, 1, 0]


def test_fetched_chunks_come_layer_by_layer_and_equal_the_stored_arrays(daemon: DaemonProcess) -> None:
    messages = _fetch(daemon, [CHUNKS[1].key, CHUNKS[0].key])
    assert [(m.layer, m.chunk) for m in messages] == [(layer, c) for layer in range(3) for c in (0, 1)]
    for index, chunk in enumerate((CHUNKS[1], CHUNKS[0])):
        layers = [chunk_data_array(m) for m in messages if m.chunk == index]
        np.testing.assert_array_equal(np.stack(layers), chunk.kv)


def test_a_damaged_chunk_is_data_loss_naming_it_a_missing_one_not_found_and_the_others_are_served(
    daemon: DaemonProcess,
) -> None:
    messages = _fetch(daemon, [CHUNKS[2].key, MISSING.key, CHUNKS[0].key])
    errors = {m.chunk: m.error for m in messages if m.HasField("error")}
    assert errors[1].code == "NOT_FOUND" and set(errors) == {0, 1}
    assert errors[0].code == "DATA_LOSS" and CHUNKS[2].key.hex() in errors[0].message
    assert [(m.layer, m.chunk) for m in messages if not m.HasField("error")] == [(0, 0), (0, 2), (1, 2), (2, 2)]
    assert f"event=chunk_dropped namespace=ns chunk={CHUNKS[2].key.hex()[:16]} layer=1" in daemon.log()


@pytest.mark.parametrize(("fingerprint", "layout", "named"), [
    ("e" * 64, LAYOUT, ("ffffffffffffffff", "eeeeeeeeeeeeeeee")),
    (FP, ChunkLayout(layers=3, kv_heads=2, head_dim=5, dtype="float16"), ("'float32'", "'float16'")),
    (FP, ChunkLayout(layers=3, kv_heads=1, head_dim=10, dtype="float32"), ("kv_heads=2", "kv_heads=1")),
])
def test_another_model_or_chunk_layout_is_failed_precondition_naming_both(
    daemon: DaemonProcess, fingerprint: str, layout: ChunkLayout, named: tuple[str, str],
) -> None:
    with pytest.raises(grpc.RpcError) as failed:
        _fetch(daemon, [CHUNKS[0].key], layout=layout, fingerprint=fingerprint)
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert all(name in failed.value.details() for name in named), failed.value.details()
    with connect(f"grpc://{daemon.target}", token=READ_TOKEN) as connection, pytest.raises(FingerprintMismatchError):
        connection.match_chunks("ns", fingerprint, layout, [CHUNKS[0].key], timeout=10)


def test_a_namespace_without_chunks_refuses_chunk_requests(daemon: DaemonProcess) -> None:
    with pytest.raises(grpc.RpcError) as failed:
        _fetch(daemon, [CHUNKS[0].key], namespace="empty")
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "stores no chunks" in failed.value.details()


def test_the_client_connection_returns_arrays_and_each_unservable_chunks_error(daemon: DaemonProcess) -> None:
    with connect(f"grpc://{daemon.target}", token=READ_TOKEN) as connection:
        assert connection.namespace("ns").chunks == LAYOUT and connection.namespace("empty").chunks is None
        got = connection.fetch_chunks("ns", FP, LAYOUT, [CHUNKS[0].key, MISSING.key, CHUNKS[2].key], timeout=10)
    assert isinstance(got[0], np.ndarray) and np.array_equal(got[0], CHUNKS[0].kv)
    assert isinstance(got[1], EntryNotFoundError) and isinstance(got[2], ChecksumError)
    assert CHUNKS[2].key.hex() in str(got[2])


def test_put_chunks_needs_a_write_token_stores_all_or_nothing_and_counts_duplicates(daemon: DaemonProcess) -> None:
    fresh = [_chunk(10, 3), _chunk(11, 5)]
    with connect(f"grpc://{daemon.target}", token=READ_TOKEN) as reader, pytest.raises(AuthError):
        reader.put_chunks("ns", FP, LAYOUT, fresh, timeout=10)
    bad = dataclasses.replace(_chunk(12, 2), kv=np.full((3, 2, 2, 2, 5), np.nan, dtype=np.float32))
    with connect(f"grpc://{daemon.target}", token=WRITE_TOKEN) as writer:
        with pytest.raises(Exception, match="not finite"):
            writer.put_chunks("ns", FP, LAYOUT, [*fresh, bad], timeout=10)
        assert writer.match_chunks("ns", FP, LAYOUT, [c.key for c in fresh], timeout=10) == [None, None]  # admits
        counts = writer.put_chunks("ns", FP, LAYOUT, [*fresh, CHUNKS[0]], timeout=10)
        assert (counts.stored, counts.duplicates) == (2, 1)
        got = writer.fetch_chunks("ns", FP, LAYOUT, [c.key for c in fresh], timeout=10)
        assert all(np.array_equal(g, c.kv) for g, c in zip(got, fresh, strict=True))
        with pytest.raises(FingerprintMismatchError, match="kv_heads=1"):
            other = ChunkLayout(3, 1, 10, "float32")
            chunk = StoredChunk(chunk_key(None, [3]), np.zeros((3, *other.layer_shape(1)), np.float32),
                                token_ids=np.array([3]))
            writer.put_chunks("ns", FP, other, [chunk], timeout=10)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10).read().decode()
    assert 'attnstore_chunks_put_total{namespace="ns"} 2.0' in metrics


def test_only_an_admin_put_records_a_namespaces_missing_chunk_layout(daemon: DaemonProcess) -> None:
    with connect(f"grpc://{daemon.target}", token=ADMIN_TOKEN) as admin, \
            connect(f"grpc://{daemon.target}", token=WRITE_TOKEN) as writer:
        assert admin.namespace("blank").chunks is None
        with pytest.raises(FingerprintMismatchError, match="records no chunk layout"):
            writer.put_chunks("blank", FP, LAYOUT, [_chunk(20, 2)], timeout=10)
        admin.put_chunks("blank", FP, LAYOUT, [_chunk(20, 2)], timeout=10)
        assert admin.namespace("blank").chunks == LAYOUT
