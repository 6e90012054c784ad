"""WriteBack over gRPC: admission marks in Lookup, the write scope, validation, visibility (exact and map
tiers), stats."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from attnstore.errors import AuthError, WriteBackOffError
from attnstore.protocol.keys import token_hash
from attnstore.protocol.records import LookupBatch
from attnstore.protocol.requests import exact_request, search_request
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.write_back import row_to_pb
from attnstore.server.auth import TokenTable, default_token_name
from attnstore.service import AttnStoreService
from attnstore.service.admission import Admission, AdmissionConfig
from attnstore_client.connection.daemon import DaemonClient
from tests.support.server_fixtures import FP, LAYOUT, LIMITS, memory_service, served
from tests.support.stores import projector_blob, softmax_maps

READ, WRITE, ADMIN, OTHER = "r" * 20, "w" * 20, "a" * 20, "o" * 20
TOKENS = TokenTable((("read", READ), ("write", WRITE), ("admin", ADMIN), ("write", OTHER)))


@contextmanager
def _two_callers(service: AttnStoreService) -> Iterator[tuple[DaemonClient, DaemonClient]]:
    """A writer (write token) and another node (another write token): two callers for admission (a read
    token's asks count nothing)."""
    with served(service, tokens=TOKENS, client_token=WRITE) as (_, writer):
        with DaemonClient(writer.target, token=OTHER, timeout=30.0) as other:
            yield writer, other


def _row(seed: int, length: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 1000, size=length), rng.normal(size=(length, LAYOUT.hidden)).astype(np.float32)


def _service(admit_after: int = 2):
    service = memory_service()
    service.admission = Admission(AdmissionConfig(admit_after=admit_after))
    return service


def _ask(remote, rows) -> list[pb.Match]:
    request = exact_request("ns", FP, [token_hash(ids) for ids, _ in rows], [len(ids) for ids, _ in rows])
    return remote.lookup(request).matches


def test_lookup_marks_a_miss_admit_once_a_second_caller_asks_by_default():
    row = _row(1)
    with _two_callers(_service()) as (writer, other):
        assert [m.admit for m in _ask(writer, [row])] == [False]
        assert [m.admit for m in _ask(writer, [row])] == [False]  # the same caller again counts nothing
        assert [m.admit for m in _ask(other, [row])] == [True]
        assert [m.admit for m in _ask(writer, [row])] == [True]


def test_a_writer_cannot_admit_its_own_rows_by_asking_for_them():
    row = _row(9)
    with _two_callers(_service()) as (writer, _):
        for _ in range(3):
            _ask(writer, [row])
        reply = writer.write_back("ns", FP, [row_to_pb(*row)])
        assert (reply.stored, reply.not_admitted) == (0, 1)


def test_written_back_row_is_an_exact_hit_for_the_next_lookup_with_its_outputs():
    row = _row(2)
    with _two_callers(_service()) as (remote, other):
        _ask(remote, [row]), _ask(other, [row])
        reply = remote.write_back("ns", FP, [row_to_pb(*row)])
        assert (reply.stored, reply.duplicates, reply.not_admitted) == (1, 0, 0)
        assert reply.bytes == row[1].size * 2
        request = exact_request("ns", FP, [token_hash(row[0])], [len(row[0])])
        result = remote.lookup(request)
        assert result.matches[0].kind == pb.MATCH_KIND_EXACT and not result.matches[0].admit
        np.testing.assert_array_equal(result.outputs[0], row[1].astype(np.float16))
        again = remote.write_back("ns", FP, [row_to_pb(*row)])
        assert (again.stored, again.duplicates) == (0, 1)
        stats = remote.stats()
        assert (stats.written_back_entries, stats.written_back_duplicates, stats.admit_after) == (1, 1, 2)
        assert stats.admission_admitted == 1 and stats.admission_asked == 2  # a hit is not counted


def test_rows_not_yet_admitted_are_skipped_and_counted():
    row = _row(3)
    with served(_service()) as (_, remote):
        _ask(remote, [row])
        reply = remote.write_back("ns", FP, [row_to_pb(*row)])
        assert (reply.stored, reply.not_admitted) == (0, 1)
        assert _ask(remote, [row])[0].kind == pb.MATCH_KIND_MISS


def _refused(reply: pb.WriteBackResponse) -> list[tuple[int, str]]:
    return [(r.query_index, r.code) for r in reply.refused]


def test_a_row_whose_outputs_disagree_with_its_tokens_is_refused_alone_and_the_others_are_stored():
    good, (ids, outputs) = _row(4), _row(5, length=6)
    with _two_callers(_service()) as (remote, other):
        for caller in (remote, other):
            _ask(caller, [good, (ids[:5], outputs)])
        reply = remote.write_back("ns", FP, [row_to_pb(ids[:5], outputs), row_to_pb(*good)])
        assert _refused(reply) == [(0, "INVALID_ARGUMENT")]
        assert "outputs shape (6, 8) disagrees with its 5 tokens" in reply.refused[0].message
        assert (reply.stored, reply.not_admitted) == (1, 0)
        assert _ask(remote, [good])[0].kind == pb.MATCH_KIND_EXACT
        assert remote.stats().written_back_refused == 1


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_a_row_with_non_finite_fp16_outputs_is_refused_alone():
    good, (ids, outputs) = _row(15), _row(16)
    outputs[2, 3] = 1e6  # finite in fp32, inf in fp16: what the store would keep
    with served(_service(1)) as (_, remote):
        _ask(remote, [good, (ids, outputs)])
        reply = remote.write_back("ns", FP, [row_to_pb(*good), row_to_pb(ids, outputs)])
        assert _refused(reply) == [(1, "INVALID_ARGUMENT")] and "NaN or inf" in reply.refused[0].message
        assert reply.stored == 1


def test_outputs_bytes_that_disagree_with_their_shape_refuse_that_row():
    row = row_to_pb(*_row(6))
    row.shape[0] = 7
    with served(_service(1)) as (_, remote):
        reply = remote.write_back("ns", FP, [row])
        assert _refused(reply) == [(0, "INVALID_ARGUMENT")] and "bytes of outputs" in reply.refused[0].message


def test_a_daemon_with_admit_after_zero_marks_nothing_and_refuses_write_back():
    service = _service(0)
    row = _row(7)
    with served(service) as (_, remote):
        assert [m.admit for m in _ask(remote, [row]) + _ask(remote, [row])] == [False, False]
        with pytest.raises(WriteBackOffError, match="--admit-after 0"):
            remote.write_back("ns", FP, [row_to_pb(*row)])


@pytest.mark.parametrize(("token", "allowed"), [(READ, False), (WRITE, True), (ADMIN, True)])
def test_write_back_needs_a_write_or_admin_token(token, allowed):
    service = _service(1)
    row = _row(8)
    with served(service, tokens=TOKENS, client_token=token) as (_, remote):
        _ask(remote, [row])
        if allowed:
            assert remote.write_back("ns", FP, [row_to_pb(*row)]).stored == 1
        else:
            with pytest.raises(AuthError, match="needs a write or admin token; this is a read token"):
                remote.write_back("ns", FP, [row_to_pb(*row)])


@pytest.mark.parametrize("call", ["delete", "compact", "verify"])
def test_a_write_token_cannot_delete_compact_or_verify(call):
    with served(_service(), tokens=TOKENS, client_token=WRITE) as (_, remote):
        method = getattr(remote, call)
        with pytest.raises(AuthError, match="needs an admin token; this is a write token"):
            method("ns", [1]) if call == "delete" else method()


def _with_maps(seed: int, length: int = 5) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    ids, outputs = _row(seed, length)
    maps = softmax_maps(LAYOUT.layers, LAYOUT.heads, length, seed=seed)  # (layers, heads, L, L), causal
    feature = np.random.default_rng(seed).normal(size=LAYOUT.feature_dim).astype(np.float32)
    return ids, outputs, maps, feature


def _projector_service() -> AttnStoreService:
    service = _service(1)
    service.set_projector("ns", projector_blob())
    return service


def test_a_sent_feature_is_never_stored_a_projector_without_embedding_layer_leaves_the_row_unsearched():
    """The daemon derives written-back features from tokens (tests/client/test_write_back_decoy_daemon.py); a
    projector stored without the model's embedding layer cannot, so the row waits for train-projector."""
    ids, outputs, maps, feature = _with_maps(10)
    with served(_projector_service()) as (_, remote):
        _ask(remote, [(ids, outputs)])
        reply = remote.write_back("ns", FP, [row_to_pb(ids, outputs, maps, feature, 1)])
        assert (reply.stored, reply.maps_stored, reply.maps_bytes) == (1, 1, LAYOUT.map_nbytes(5))
        assert reply.bytes == LAYOUT.map_nbytes(5) + LAYOUT.outputs_nbytes(5)
        batch = LookupBatch("ns", FP, feature[None] + 1e-3, [5], max_distance=1.0, projector_version=1)
        (match,) = remote.search(search_request(batch))
        assert match.kind == pb.MATCH_KIND_MISS
        stats = remote.stats()
        assert (stats.written_back_map_entries, stats.written_back_map_bytes) == (1, LAYOUT.map_nbytes(5))


def test_maps_without_a_feature_are_stored_but_not_searched_in_a_namespace_without_projector():
    ids, outputs, maps, _ = _with_maps(11)
    service = _service(1)
    with served(service) as (_, remote):
        _ask(remote, [(ids, outputs)])
        assert remote.write_back("ns", FP, [row_to_pb(ids, outputs, maps)]).maps_stored == 1
    (entry,) = service.store.entries("ns")
    assert entry.feature is None
    np.testing.assert_array_equal(service.read_maps("ns", entry.id), maps.astype(np.float16))


@pytest.mark.parametrize(
    ("change", "code", "message"),
    [
        ("dim", "INVALID_ARGUMENT", r"feature shape \(15,\) is not the namespace's \(16,\)"),
        ("version", "FAILED_PRECONDITION", "projected with version 7"),
        ("maps", "INVALID_ARGUMENT", r"maps shape \(3, 2, 4, 4\) disagrees with its 5 tokens"),
    ],
)
def test_a_bad_row_with_maps_is_refused_alone_and_the_good_row_is_stored(change, code, message):
    good, (ids, outputs, maps, feature) = _with_maps(12), _with_maps(13)
    version = 7 if change == "version" else 1
    if change == "dim":
        feature = feature[:-1]
    if change == "maps":
        maps = maps[:, :, :4, :4]
    with served(_projector_service()) as (_, remote):
        _ask(remote, [good[:2], (ids, outputs)])
        reply = remote.write_back("ns", FP, [row_to_pb(*good, 1), row_to_pb(ids, outputs, maps, feature, version)])
        assert _refused(reply) == [(1, code)]
        assert re.search(message, reply.refused[0].message)
        assert (reply.stored, reply.maps_stored) == (1, 1)


def test_maps_bytes_that_fail_their_crc_refuse_that_row_as_data_loss():
    row = row_to_pb(*_with_maps(14)[:3])
    row.maps_crc32c ^= 1
    with served(_service(1)) as (_, remote):
        reply = remote.write_back("ns", FP, [row])
        assert _refused(reply) == [(0, "DATA_LOSS")] and "maps fail their crc32c" in reply.refused[0].message


# ---- the trust model: what a write token can no longer do -------------------------------------------


def _admitted_write(service: AttnStoreService, rows: list[pb.WrittenRow]) -> pb.WriteBackResponse:
    """Write ``rows`` back after a second caller asked for each (so admission is no obstacle)."""
    with _two_callers(service) as (writer, other):
        keys = [token_hash(np.array(r.token_ids)) for r in rows]
        for caller in (writer, other):
            caller.lookup(exact_request("ns", FP, keys, [len(r.token_ids) for r in rows]))
        return writer.write_back("ns", FP, rows)


def test_a_decoy_with_all_zero_maps_is_refused_and_never_becomes_a_map_hit():
    victim_ids, victim_outputs, _, victim_feature = _with_maps(20)
    decoy_ids = np.arange(100, 105)  # the victim's length, other tokens
    zero_maps = np.zeros((LAYOUT.layers, LAYOUT.heads, 5, 5), np.float32)
    service = _projector_service()
    reply = _admitted_write(service, [row_to_pb(decoy_ids, victim_outputs, zero_maps, victim_feature, 1)])
    assert _refused(reply) == [(0, "INVALID_ARGUMENT")] and reply.stored == 0
    assert "rows must sum to 1" in reply.refused[0].message
    with served(service) as (_, remote):
        batch = LookupBatch("ns", FP, victim_feature[None], [5], max_distance=1.0, projector_version=1)
        assert remote.search(search_request(batch))[0].kind == pb.MATCH_KIND_MISS


@pytest.mark.parametrize(
    ("ids", "message"),
    [(np.array([1, 2, 4_000_000_000]), r"token id 4000000000 is outside the vocabulary of 1000"),
     (np.arange(65) % 1000, "65 tokens is over the model's maximum of 64")],
)
def test_token_ids_outside_the_vocabulary_or_rows_over_the_models_length_are_refused(ids, message):
    outputs = np.random.default_rng(1).normal(size=(len(ids), LAYOUT.hidden)).astype(np.float32)
    reply = _admitted_write(_service(1), [row_to_pb(ids, outputs)])
    assert _refused(reply) == [(0, "INVALID_ARGUMENT")] and re.search(message, reply.refused[0].message)


@pytest.mark.parametrize("value", [0.0, 3.5])
def test_outputs_constant_across_the_hidden_size_are_refused(value):
    ids = np.arange(1, 6)
    reply = _admitted_write(_service(1), [row_to_pb(ids, np.full((5, LAYOUT.hidden), value, np.float32))])
    assert _refused(reply) == [(0, "INVALID_ARGUMENT")] and "constant" in reply.refused[0].message


def test_a_namespace_without_recorded_limits_takes_no_write_back_until_they_are_recorded():
    service = _service(1)
    service.create_namespace("old", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)  # made before limits
    row = _row(21)
    with served(service) as (_, remote):
        remote.lookup(exact_request("old", FP, [token_hash(row[0])], [5]))
        with pytest.raises(WriteBackOffError, match="records no vocabulary size"):
            remote.write_back("old", FP, [row_to_pb(*row)])
        remote.create_namespace("old", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT, limits=LIMITS)
        assert remote.get_namespace("old").limits.vocab_size == 1000
        assert remote.write_back("old", FP, [row_to_pb(*row)]).stored == 1


def test_written_entries_are_recorded_with_their_writers_name():
    row = _row(22)
    service = _service()
    reply = _admitted_write(service, [row_to_pb(*row)])
    assert reply.stored == 1
    (entry,) = service.store.entries("ns")
    assert entry.writer == default_token_name(WRITE)
