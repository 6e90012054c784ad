"""A real ``attnstore node`` on a model without an adapter (issue 49, item 2): a tiny random ``electra`` and
``deberta-v2`` sentence-transformers folder over an exact-tier namespace. Its warm-up and calls run the model's own
forward (padded, length-sorted), its ``/v1/embeddings`` and ``/embed`` answers equal ``SentenceTransformer.encode``,
repeats are served by the exact tier, and ``/v1/models`` says which tiers it has and why the others are absent."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from attnstore_client.models import load_model
from tests.support.adapters import save_tiny_family
from tests.support.nodes import API_KEY, NodeProcess, tiny_store
from tests.support.vectors import row_cosines

TEXTS = ["A man is playing a guitar.", "hi", "The quick brown fox jumps over the lazy dog again and again.",
         "Failed password for invalid user admin from 10.0.0.1 port 22 ssh2", "ok then", "hi"]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
WHY = "no adapter for model_type {!r}: map replay, packed forwards, prefix and chunk tiers need one"


@pytest.fixture(scope="module", params=["electra", "deberta-v2"])
def folder(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    return save_tiny_family(request.param, tmp_path_factory.mktemp(request.param) / "model", pooling="mean")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, folder: Path):
    workdir = tmp_path_factory.mktemp("node-generic")
    store = tiny_store(workdir / "store", load_model(str(folder)))
    process = NodeProcess(str(folder), store, workdir, keys=True, args=("--max-inputs", "8", "--max-wait-ms", "20"))
    process.start()  # with its warm-up: forwards of the model's own
    yield process
    assert process.stop() == 0, process.log()


def test_embeddings_equal_sentence_transformers_and_repeats_are_exact_hits(node: NodeProcess, folder: Path) -> None:
    expected = SentenceTransformer(str(folder), device="cpu").encode(TEXTS)
    with node.counting(4):
        for _ in range(3):  # computed, computed and kept (the exact tier keeps a row offered twice), then served
            answer = httpx.post(f"{node.url}/v1/embeddings", json={"input": TEXTS, "model": str(folder)},
                                headers=HEADERS, timeout=60).raise_for_status().json()
            vectors = np.array([item["embedding"] for item in answer["data"]], np.float32)
            assert row_cosines(vectors, expected).min() >= 0.9999
        embed = httpx.post(f"{node.url}/embed", json={"inputs": TEXTS}, headers=HEADERS, timeout=60)
        assert row_cosines(np.array(embed.raise_for_status().json(), np.float32), expected).min() >= 0.9999
    assert node.metric('attnstore_node_rows_total{tier="local_exact"}') >= 5, node.log()
    assert "runs through its own forward: exact tiers and write-back only" in node.log()


def test_models_route_says_which_tiers_the_node_has_and_why_not_the_others(node: NodeProcess, folder: Path) -> None:
    (model,) = httpx.get(f"{node.url}/v1/models", headers=HEADERS).raise_for_status().json()["data"]
    why = WHY.format(load_model(str(folder)).model.config.model_type)
    assert model["tiers"] == ["exact"]
    assert model["absent_tiers"]["maps"] == model["absent_tiers"]["prefix"] == why
    assert model["absent_tiers"]["packed"].startswith(why)
