"""A real ``attnstore node`` on sentence-transformers folders configured as users configure decoder and encoder
embedders (a tokenizer padding on the left, last-token or mean pooling): every row of a request of many rows equals
``SentenceTransformer.encode``'s, through ``/v1/embeddings`` and TEI's ``/embed``."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from attnstore_client.models import load_model
from tests.support.adapters import save_tiny_family
from tests.support.nodes import API_KEY, NodeProcess, tiny_store
from tests.support.vectors import row_cosines

TEXTS = ["A man is playing a guitar.", "hi", "The quick brown fox jumps over the lazy dog again and again.",
         "A cat sits.", "Stocks fell sharply today in early trading.", "ok then", "hi"]


@pytest.mark.parametrize(("family", "pooling"), [("qwen2", "lasttoken"), ("qwen2", "mean"), ("roberta", "mean"),
                                               ("xlm-roberta", "cls"), ("mpnet", "mean")])
def test_a_left_padding_pipeline_s_rows_equal_sentence_transformers_through_the_node(
    tmp_path, family: str, pooling: str
) -> None:
    folder = save_tiny_family(family, tmp_path / "model", padding_side="left", pooling=pooling)
    reference = SentenceTransformer(str(folder), device="cpu")
    assert reference.tokenizer.padding_side == "left"
    expected = reference.encode(TEXTS)
    node = NodeProcess(str(folder), tiny_store(tmp_path / "store", load_model(str(folder))), tmp_path, keys=True,
                       args=("--no-warmup",)).start()
    try:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        name = httpx.get(f"{node.url}/v1/models", headers=headers).raise_for_status().json()["data"][0]["id"]
        answer = httpx.post(f"{node.url}/v1/embeddings", json={"input": TEXTS, "model": name}, headers=headers,
                            timeout=60).raise_for_status().json()
        vectors = np.array([item["embedding"] for item in answer["data"]], np.float32)
        assert row_cosines(vectors, expected).min() >= 0.9999
        embed = httpx.post(f"{node.url}/embed", json={"inputs": TEXTS}, headers=headers, timeout=60)
        assert row_cosines(np.array(embed.raise_for_status().json(), np.float32), expected).min() >= 0.9999
    finally:
        assert node.stop() == 0, node.log()


def test_a_requests_prompt_name_puts_the_models_prompt_before_every_text_as_encode_does(tmp_path) -> None:
    # e5's shape: named prompts left out of the pooling; one of them the default.
    folder = save_tiny_family("bert", tmp_path / "model", pooling="mean")
    configured = SentenceTransformer(str(folder), device="cpu")
    configured.prompts = {"query": "query: ", "passage": "passage: "}
    configured.default_prompt_name = "passage"
    configured[1].include_prompt = False
    configured.save(str(folder))
    reference = SentenceTransformer(str(folder), device="cpu")
    assert reference[1].include_prompt is False and reference.default_prompt_name == "passage"
    node = NodeProcess(str(folder), tiny_store(tmp_path / "store", load_model(str(folder))), tmp_path, keys=True,
                       args=("--no-warmup",)).start()
    try:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        model = httpx.get(f"{node.url}/v1/models", headers=headers).raise_for_status().json()["data"][0]
        name = model["id"]
        assert {"query", "passage"} <= set(model["prompts"])  # the names a request may give
        for body, prompt_name in (({"inputs": TEXTS, "prompt_name": "query"}, "query"), ({"inputs": TEXTS}, None)):
            answer = httpx.post(f"{node.url}/embed", json=body, headers=headers, timeout=60).raise_for_status()
            expected = reference.encode(TEXTS, prompt_name=prompt_name)  # None: the default prompt, "passage: "
            assert np.abs(np.array(answer.json(), np.float32) - expected).max() <= 1e-4
        query = reference.encode(TEXTS, prompt_name="query")
        assert np.abs(query - reference.encode(TEXTS)).max() > 1e-3  # the prompts give other vectors
        answer = httpx.post(f"{node.url}/v1/embeddings", json={"input": TEXTS, "model": name, "prompt_name": "query"},
                            headers=headers, timeout=60).raise_for_status().json()
        vectors = np.array([item["embedding"] for item in answer["data"]], np.float32)
        assert np.abs(vectors - query).max() <= 1e-4
        refused = httpx.post(f"{node.url}/embed", json={"inputs": TEXTS, "prompt_name": "title"}, headers=headers)
        assert refused.status_code == 400 and "'passage', 'query'" in refused.text and "'title'" in refused.text
    finally:
        assert node.stop() == 0, node.log()
