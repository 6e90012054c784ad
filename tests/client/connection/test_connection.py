"""The client's store connections: one shared suite for embedded (local:) and daemon (grpc://) stores."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch

from attnstore.errors import (
    ChecksumError,
    ConfigError,
    FingerprintMismatchError,
    MapsUnavailableError,
    NamespaceNotFoundError,
    StoreNotFoundError,
    UnavailableError,
)
from attnstore.protocol.records import LookupBatch
from attnstore.service import AttnStoreService
from attnstore_client.adapters import adapter_for
from attnstore_client.adapters.batch import tokenize
from attnstore_client.connection import StoreConnection, connect
from attnstore_client.connection.base import checked_projector
from attnstore_client.keys import model_fingerprint, token_hash
from attnstore_client.models import LoadedModel
from attnstore_client.projector import Projector
from tests.support.caches import fill_namespace, sentences, tiny_loaded
from tests.support.server_fixtures import FP, served, tls_server

TEXTS = sentences(6, seed=3)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return tiny_loaded("bert")


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory, loaded: LoadedModel) -> Path:
    """A real LMDB store: TEXTS[:4] stored, TEXTS[4:] not."""
    path = tmp_path_factory.mktemp("conn") / "store"
    with AttnStoreService.open(path, create=True) as service:
        fill_namespace(service, loaded, TEXTS[:4])
    return path


@pytest.fixture(params=["local", "grpc"])
def connection(request: pytest.FixtureRequest, store_path: Path) -> Iterator[StoreConnection]:
    if request.param == "local":
        with connect(f"local:{store_path}") as conn:
            yield conn
        return
    with AttnStoreService.open(store_path, readonly=True) as service, served(service) as (_, remote):
        with connect(f"grpc://{remote.target}") as conn:
            yield conn


def _features(loaded: LoadedModel, connection: StoreConnection, texts: list[str]):
    """The rows' batch and a search request for them under the namespace's projector."""
    handle = connection.namespace("default")
    projector = Projector.from_safetensors_bytes(handle.projector)
    batch = tokenize(loaded.tokenizer, texts)
    features = projector.project(adapter_for(loaded).feature_source(batch))
    return batch, LookupBatch("default", handle.fingerprint, features, batch.lengths, max_distance=1e-3)


# ---- the shared suite: every connection ------------------------------------------


def test_namespace_handle_carries_fingerprint_layout_and_projector(connection, loaded) -> None:
    handle = connection.namespace("default")
    assert handle.fingerprint == model_fingerprint(loaded.model, loaded.tokenizer)
    assert (handle.layers, handle.heads, handle.causal, handle.hidden) == (3, 4, False, 64)
    assert handle.model == "tiny-bert" and handle.projector
    with pytest.raises(NamespaceNotFoundError):
        connection.namespace("nope")


def test_exact_gives_the_stored_outputs_of_stored_rows_only_by_hash_and_length(connection, loaded) -> None:
    batch = tokenize(loaded.tokenizer, [TEXTS[1], TEXTS[5], TEXTS[3]])
    hashes = [token_hash(batch.row_ids(row)) for row in range(batch.size)]
    fingerprint = connection.namespace("default").fingerprint
    outputs = connection.exact("default", fingerprint, hashes, batch.lengths, timeout=10.0)
    assert sorted(outputs) == [0, 2]
    capture = adapter_for(loaded).capture(tokenize(loaded.tokenizer, [TEXTS[1]]))
    np.testing.assert_allclose(outputs[0], capture.hidden[0].numpy(), atol=2e-3)
    wrong_length = [length + 1 for length in batch.lengths]
    assert connection.exact("default", fingerprint, hashes, wrong_length, timeout=10.0) == {}


def test_search_names_the_stored_entry_each_row_may_replay(connection, loaded) -> None:
    _, request = _features(loaded, connection, [TEXTS[5], TEXTS[2], TEXTS[0]])
    matches = connection.search(request, timeout=10.0)
    assert [m.kind for m in matches] == ["miss", "map", "map"]
    assert matches[0].entry_id is None and matches[1].entry_id and matches[1].stored_length == request.lengths[1]


def test_fetch_maps_delivers_every_layer_of_the_chosen_rows(connection, loaded) -> None:
    _, request = _features(loaded, connection, [TEXTS[2], TEXTS[0]])
    matches = connection.search(request, timeout=10.0)
    rows = [(int(m.entry_id or 0), length) for m, length in zip(matches, request.lengths, strict=True)]
    stream = connection.fetch_maps("default", request.fingerprint, rows, timeout=10.0)
    capture = adapter_for(loaded).capture(tokenize(loaded.tokenizer, [TEXTS[2], TEXTS[0]]))
    for row, maps in enumerate(capture.maps):
        for layer in range(3):
            np.testing.assert_array_equal(stream.layer(row, layer), maps[layer].to(torch.float16).numpy())
    stream.wait()
    assert stream.failed() == {} and stream.outage is None
    assert stream.bytes_fetched == sum(m.numel() * 2 for m in capture.maps)
    stream.close()


def test_fetch_maps_of_an_unknown_entry_fails_that_row_only(connection, loaded) -> None:
    _, request = _features(loaded, connection, [TEXTS[2]])
    (match,) = connection.search(request, timeout=10.0)
    stream = connection.fetch_maps(
        "default", request.fingerprint, [(10_000, 3), (int(match.entry_id or 0), request.lengths[0])], timeout=10.0
    )
    with pytest.raises(MapsUnavailableError):
        stream.layer(0, 0)
    assert stream.layer(1, 2).shape == (4, request.lengths[0], request.lengths[0])
    stream.wait()
    assert stream.failed() == {0: "row_error"}
    stream.close()


def test_a_search_with_another_models_fingerprint_is_refused(connection, loaded) -> None:
    with pytest.raises(FingerprintMismatchError, match="fingerprint"):
        connection.search(LookupBatch("default", "0" * 64, np.zeros((1, 128), np.float32), [5], max_distance=1.0),
                          timeout=10.0)
    with pytest.raises(FingerprintMismatchError, match="fingerprint"):
        connection.exact("default", "0" * 64, [token_hash([1, 2])], [2], timeout=10.0)


def test_health_is_serving(connection) -> None:
    assert connection.health() == "SERVING"


# ---- per implementation ----------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "message"),
    [("http://host:1", "must start with one of"), ("grpc://", "HOST:PORT"), ("grpc://hostonly", "HOST:PORT"),
     ("local:", "needs a path")],
)
def test_bad_store_urls_are_config_errors_naming_the_forms(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        connect(url)


def test_token_on_a_local_store_and_tls_ca_on_plain_grpc_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="apply to grpc:// stores"):
        connect(f"local:{tmp_path}", token="abc")
    with pytest.raises(ConfigError, match="not a grpcs:// URL"):
        connect("grpc://127.0.0.1:1", tls_ca=tmp_path / "ca.pem")


def test_local_store_that_does_not_exist_is_store_not_found(tmp_path: Path) -> None:
    with pytest.raises(StoreNotFoundError):
        connect(f"local:{tmp_path / 'missing'}")


def test_grpcs_with_client_certificate_reaches_an_mtls_daemon(pki: Path) -> None:
    server, target = tls_server(pki, mtls=True)
    try:
        with connect(f"grpcs://{target}", tls_ca=pki / "ca.pem", client_cert=pki / "client.pem",
                     client_key=pki / "client.key") as connection:
            assert connection.namespace("ns").fingerprint == FP
        with connect(f"grpcs://{target}", tls_ca=pki / "ca.pem") as anonymous, pytest.raises(UnavailableError):
            anonymous.namespace("ns")
        with pytest.raises(ConfigError, match="both"):
            connect(f"grpcs://{target}", client_cert=pki / "client.pem")
    finally:
        server.stop(0)


def test_a_projector_that_fails_its_recorded_crc32c_is_refused_by_the_client() -> None:
    blob = b"projector bytes"
    assert checked_projector("ns", blob, crc32c.crc32c(blob)) == blob
    assert checked_projector("ns", blob, None) == blob  # recorded before checksums: nothing to check against
    with pytest.raises(ChecksumError, match="projector of namespace 'ns' fails its crc32c"):
        checked_projector("ns", blob[:-1] + b"X", crc32c.crc32c(blob))
