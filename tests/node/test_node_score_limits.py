"""Bounded work per request on a decoder node's scoring routes (a real ``attnstore node``, tiny random Llama).

The probe of issue 48 sent ``/v1/score`` 16 items x 196,608 ``label_token_ids`` (a 1.3 MB body) and got a 70 MB
answer; and ``/v1/classify`` with ``"labels": null`` on a node started with ``--labels yes no`` was refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from attnstore_node.schema import RequestLimits
from tests.support.nodes import NodeProcess, decoder_store, save_tiny_llama

LIMITS = RequestLimits()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    folder = tmp_path_factory.mktemp("tiny-llama-limits")
    loaded = save_tiny_llama(folder)
    workdir = tmp_path_factory.mktemp("limits-node")
    process = NodeProcess(str(folder), decoder_store(workdir / "store", loaded), workdir,
                          args=("--no-warmup", "--max-wait-ms", "5", "--labels", "yes", "no")).start()
    yield process
    process.kill()


def _post(node: NodeProcess, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{node.url}{route}", json=body, timeout=120)


def test_16_items_by_196608_label_ids_is_a_400_naming_the_limit(node: NodeProcess) -> None:
    labels = [i % 1000 + 1 for i in range(196_608)]
    answer = _post(node, "/v1/score", {"query": "q", "items": [f"item {i}" for i in range(16)],
                                       "label_token_ids": labels})
    assert answer.status_code == 400, answer.text[:300]
    error = answer.json()["error"]
    assert error["code"] == "too_many_labels" and error["param"] == "label_token_ids"
    assert f"max_labels={LIMITS.max_labels}" in error["message"] and "--max-labels" in error["message"]
    assert len(answer.content) < 1000  # the error does not echo the request


def test_items_times_labels_past_the_limit_is_a_400_naming_it(node: NodeProcess) -> None:
    items, labels = 100, 1000  # each under its own limit; 100,000 scores over max_scores
    assert labels <= LIMITS.max_labels and items <= LIMITS.max_inputs and items * labels > LIMITS.max_scores
    answer = _post(node, "/v1/score", {"query": "q", "items": [f"item {i}" for i in range(items)],
                                       "label_token_ids": list(range(1, labels + 1))})
    assert answer.status_code == 400, answer.text[:300]
    error = answer.json()["error"]
    assert error["code"] == "too_many_scores" and f"max_scores={LIMITS.max_scores}" in error["message"]
    assert "--max-scores" in error["message"]


def test_a_request_within_the_limits_is_answered(node: NodeProcess) -> None:
    answer = _post(node, "/v1/score", {"query": "q", "items": ["a", "b"], "label_token_ids": list(range(1, 1001))})
    assert answer.status_code == 200, answer.text[:300]
    assert [len(row) for row in answer.json()["scores"]] == [1000, 1000]


def test_classify_labels_null_takes_the_nodes_labels(node: NodeProcess) -> None:
    left_out = _post(node, "/v1/classify", {"input": ["is it so", "no way"]})
    null = _post(node, "/v1/classify", {"input": ["is it so", "no way"], "labels": None})
    assert null.status_code == 200, null.text
    assert [row["probs"] for row in null.json()["data"]] == [row["probs"] for row in left_out.json()["data"]]
    assert {row["label"] for row in null.json()["data"]} <= {"yes", "no"}


def test_classify_with_too_many_labels_is_a_400_naming_the_limit(node: NodeProcess) -> None:
    words = [f"w{i}" for i in range(LIMITS.max_labels + 1)]
    answer = _post(node, "/v1/classify", {"input": "text", "labels": words})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "too_many_labels"


def test_a_node_refuses_more_labels_than_its_limit_at_start(tmp_path: Path) -> None:
    node = NodeProcess("unused-model", "local:unused", tmp_path,
                       args=("--max-labels", "2", "--labels", "yes", "no", "maybe"))
    with pytest.raises(RuntimeError, match="--labels gives 3 words; the limit is --max-labels 2"):
        node.start(timeout=60)
