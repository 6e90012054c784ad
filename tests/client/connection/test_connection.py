"""The client's store connections: one shared suite for embedded (local:) and daemon (grpc://) stores."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from cache_helpers import fill_namespace, sentences, tiny_loaded
from server_fixtures import FP, served, tls_server

from attnstore.errors import (
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
from attnstore_client.batch import tokenize
from attnstore_client.connection import StoreConnection, connect
from attnstore_client.keys import model_fingerprint, token_hash
from attnstore_client.models import LoadedModel
from attnstore_client.projector import Projector

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


def _query(loaded: LoadedModel, connection: StoreConnection, texts: list[str], *, exact: bool):
    adapter = adapter_for(loaded)
    handle = connection.namespace("default")
    projector = Projector.from_safetensors_bytes(handle.projector)
    batch = tokenize(loaded.tokenizer, texts)
    features = projector.project(adapter.feature_source(batch))
    hashes = [token_hash(batch.row_ids(row)) for row in range(batch.size)]
    request = LookupBatch("default", handle.fingerprint, features, batch.lengths,
                          token_hashes=hashes if exact else None, max_distance=1e-3)
    retrieval = connection.lookup(request, timeout=10.0)
    return batch, retrieval


# ---- the shared suite: every connection ------------------------------------------


def test_namespace_handle_carries_fingerprint_layout_and_projector(connection, loaded) -> None:
    handle = connection.namespace("default")
    assert handle.fingerprint == model_fingerprint(loaded.model, loaded.tokenizer)
    assert (handle.layers, handle.heads, handle.causal, handle.hidden) == (3, 4, False, 64)
    assert handle.model == "tiny-bert" and handle.projector
    with pytest.raises(NamespaceNotFoundError):
        connection.namespace("nope")


def test_exact_rows_get_their_stored_outputs_and_misses_get_nothing(connection, loaded) -> None:
    batch, retrieval = _query(loaded, connection, [TEXTS[1], TEXTS[5]], exact=True)
    assert [m.kind for m in retrieval.matches] == ["exact", "miss"]
    capture = adapter_for(loaded).capture(tokenize(loaded.tokenizer, [TEXTS[1]]))
    np.testing.assert_allclose(retrieval.outputs[0], capture.hidden[0].numpy(), atol=2e-3)
    assert sorted(retrieval.outputs) == [0] and retrieval.map_rows == [] and retrieval.failed() == {}
    assert retrieval.bytes_fetched == retrieval.outputs[0].nbytes
    retrieval.close()


def test_map_rows_deliver_every_layer_of_their_stored_maps(connection, loaded) -> None:
    batch, retrieval = _query(loaded, connection, [TEXTS[5], TEXTS[2], TEXTS[0]], exact=False)
    assert [m.kind for m in retrieval.matches] == ["miss", "map", "map"]
    capture = adapter_for(loaded).capture(tokenize(loaded.tokenizer, [TEXTS[2], TEXTS[0]]))
    for row, maps in zip((1, 2), capture.maps, strict=True):
        for layer in range(3):
            np.testing.assert_array_equal(retrieval.layer(row, layer), maps[layer].to(torch.float16).numpy())
    retrieval.wait()
    assert retrieval.failed() == {}
    assert retrieval.bytes_fetched == sum(m.numel() * 2 for m in capture.maps)
    with pytest.raises(MapsUnavailableError):
        retrieval.layer(0, 0)  # a miss has no maps
    retrieval.close()


def test_a_lookup_with_another_models_fingerprint_is_refused(connection, loaded) -> None:
    with pytest.raises(FingerprintMismatchError, match="fingerprint"):
        connection.lookup(LookupBatch("default", "0" * 64, np.zeros((1, 128), np.float32), [5], [None],
                                      max_distance=1.0), timeout=10.0)


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
