"""The node's routes around a stand-in embedder: status codes, error bodies, health, and what /metrics counts."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from starlette.testclient import TestClient

from attnstore_node.app import create_app
from attnstore_node.auth import KeyCheck
from attnstore_node.engine import Embedded, Embedder
from attnstore_node.metrics import NodeMetrics
from attnstore_node.schema import Input, ModelInfo, RequestLimits

KEY = "key-0123456789abcdef"


class _Ones(Embedder):
    """Every input's vector is ones; ``loaded`` says whether the model is "loaded"."""

    def __init__(self) -> None:
        self.loaded = True
        self.calls = 0
        self.stopped: BaseException | None = None

    @property
    def info(self) -> ModelInfo | None:
        return ModelInfo("m", 4, 100, 16) if self.loaded else None

    @property
    def fault(self) -> BaseException | None:
        return self.stopped

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    async def embed(self, inputs: Sequence[Input], *, truncate: bool, max_input_tokens: int,
                    prompt_name: str | None = None) -> Embedded:
        self.calls += 1
        await asyncio.sleep(0)
        return Embedded(np.ones((len(inputs), 4), np.float32), tokens=3 * len(inputs))


@pytest.fixture
def node(tmp_path: Path):
    keys = tmp_path / "keys"
    keys.write_text(KEY)
    embedder, metrics = _Ones(), NodeMetrics()
    app = create_app(embedder, keys=KeyCheck(keys), limits=RequestLimits(max_body_bytes=200), metrics=metrics)
    with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client, embedder, metrics


def test_an_embedding_request_is_answered_in_openai_schema(node) -> None:
    client, _, _ = node
    answer = client.post("/v1/embeddings", json={"model": "m", "input": ["a", "b"]}).json()
    assert [item["embedding"] for item in answer["data"]] == [[1.0] * 4] * 2
    assert answer["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
    assert client.post("/embed", json={"inputs": "a"}).json() == [[0.5] * 4]  # TEI normalises by default


@pytest.mark.parametrize(("call", "status", "code"), [
    (lambda c: c.post("/v1/embeddings", content=b"{", headers={"content-type": "application/json"}), 400,
     "invalid_json"),
    (lambda c: c.post("/v1/embeddings", json={"model": "m", "input": ["x" * 300]}), 413, "body_too_large"),
    (lambda c: c.post("/v1/embeddings", content=b"a", headers={"content-type": "text/plain"}), 415,
     "unsupported_media_type"),
    (lambda c: c.post("/v1/embeddings", json={"model": "m", "input": "a"}, headers={"Authorization": "Bearer no"}),
     401, "invalid_api_key"),
    (lambda c: c.post("/embed", json={"inputs": "a"}, headers={"Authorization": ""}), 401, "missing_api_key"),
])
def test_refusals_are_openai_error_bodies_and_nothing_is_embedded(node, call, status: int, code: str) -> None:
    client, embedder, metrics = node
    answer = call(client)
    assert answer.status_code == status
    assert answer.json()["error"]["code"] == code
    assert embedder.calls == 0
    route = "/embed" if answer.request.url.path == "/embed" else "/v1/embeddings"
    assert metrics.registry.get_sample_value("attnstore_node_requests_total", {"route": route,
                                                                              "status": str(status)}) == 1


def test_health_is_503_until_the_model_is_loaded_and_needs_no_key(node) -> None:
    client, embedder, _ = node
    embedder.loaded = False
    assert client.get("/health", headers={"Authorization": ""}).status_code == 503
    assert client.post("/v1/embeddings", json={"model": "m", "input": "a"}).status_code == 503
    embedder.loaded = True
    assert client.get("/health", headers={"Authorization": ""}).json() == {"status": "ok", "model": "m"}


def test_metrics_are_prometheus_text_with_every_route_and_status_from_zero(node) -> None:
    client, _, _ = node
    client.post("/v1/embeddings", json={"model": "m", "input": "a"})
    text = client.get("/metrics").text
    assert 'attnstore_node_requests_total{route="/v1/embeddings",status="200"} 1.0' in text
    assert 'attnstore_node_requests_total{route="/embed",status="400"} 0.0' in text
    assert "attnstore_node_request_seconds_bucket" in text
    assert client.get("/v1/models").json()["data"][0]["id"] == "m"


def test_health_and_embedding_routes_are_503_once_the_embedder_stopped_serving(node) -> None:
    client, embedder, _ = node
    embedder.stopped = RuntimeError("its thread ended")
    health = client.get("/health", headers={"Authorization": ""})
    assert (health.status_code, health.json()["error"]["code"]) == (503, "batcher_stopped")
    assert client.post("/v1/embeddings", json={"model": "m", "input": "a"}).status_code == 503
    assert embedder.calls == 0
