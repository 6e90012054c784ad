"""A real ``attnstore node`` process on a loopback port, called with the official ``openai`` client and httpx.

all-MiniLM-L6-v2 over an empty exact-tier namespace: every row is computed, by
packed forwards, and must give ``SentenceTransformer.encode``'s vectors.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from tests.support.nodes import API_KEY, NodeProcess, tiny_store
from tests.support.vectors import row_cosines

pytestmark = pytest.mark.real_model

TEXTS = [
    "Failed password for invalid user admin from 10.0.0.1 port 22 ssh2",
    "Receiving block blk_-1608999687919862906 src: /10.250.19.102:54106",
    "A man is playing a guitar.",
    "ok",
    "Failed password for invalid user admin from 10.0.0.1 port 22 ssh2",
]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, minilm_model):
    workdir = tmp_path_factory.mktemp("node-openai")
    store = tiny_store(workdir / "store", minilm_model)
    process = NodeProcess("minilm", store, workdir, keys=True,
                          args=("--no-warmup", "--max-inputs", "8", "--max-wait-ms", "20")).start()
    yield process
    assert process.stop() == 0, process.log()


@pytest.fixture(scope="module")
def client(node: NodeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key=API_KEY, max_retries=0)


def test_embeddings_equal_sentence_transformers_and_usage_counts_tokens(client, minilm_model) -> None:
    pipeline = minilm_model.sentence_transformer
    answer = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    vectors = np.array([item.embedding for item in answer.data], np.float32)
    expected = pipeline.encode(TEXTS)
    assert row_cosines(vectors, expected).min() >= 0.9999
    tokens = sum(len(row) for row in pipeline.tokenizer(TEXTS)["input_ids"])
    assert (answer.usage.prompt_tokens, answer.usage.total_tokens) == (tokens, tokens)
    assert [item.index for item in answer.data] == list(range(len(TEXTS)))


def test_base64_decodes_to_the_same_floats_and_the_client_default_is_base64(client) -> None:
    # Offered twice, whatever other tests sent before: the node's exact tier keeps a row from its second offer
    # on, so every answer below comes from it (rows computed in differently packed forwards differ by ~1e-5).
    for _ in range(2):
        client.embeddings.create(model="minilm", input=TEXTS[:3])
    floats = client.embeddings.create(model="minilm", input=TEXTS[:3], encoding_format="float")
    raw = client.embeddings.create(model="minilm", input=TEXTS[:3], encoding_format="base64")
    decoded = np.stack([np.frombuffer(base64.b64decode(item.embedding), "<f4") for item in raw.data])
    np.testing.assert_array_equal(decoded, np.array([item.embedding for item in floats.data], np.float32))
    default = client.embeddings.create(model="minilm", input=TEXTS[:3])  # the package asks for base64, decodes it
    np.testing.assert_array_equal(np.array([item.embedding for item in default.data], np.float32), decoded)


def test_token_ids_and_dimensions(client, minilm_model) -> None:
    ids = minilm_model.sentence_transformer.tokenizer(TEXTS[:2])["input_ids"]
    by_ids = client.embeddings.create(model="minilm", input=ids, encoding_format="float", dimensions=8)
    by_text = client.embeddings.create(model="minilm", input=TEXTS[:2], encoding_format="float")
    assert [len(item.embedding) for item in by_ids.data] == [8, 8]
    np.testing.assert_allclose([item.embedding for item in by_ids.data],
                               [item.embedding[:8] for item in by_text.data], atol=1e-6)
    assert by_ids.usage.prompt_tokens == sum(len(row) for row in ids)


@pytest.mark.parametrize(("options", "error", "code"), [
    ({"input": []}, openai.BadRequestError, "empty_input"),
    ({"input": ["a line"] * 9}, openai.BadRequestError, "too_many_inputs"),
    ({"input": [[101, 99999, 102]]}, openai.BadRequestError, "invalid_token_id"),
    ({"input": "a line", "api_key": "wrong-key-0123456789"}, openai.AuthenticationError, "invalid_api_key"),
    ({"input": "a line", "model": "gpt-4"}, openai.NotFoundError, "model_not_found"),
])
def test_bad_requests_get_their_4xx_and_an_openai_error_body(node, options: dict, error: type, code: str) -> None:
    key = options.pop("api_key", API_KEY)
    model = options.pop("model", "minilm")
    bad = openai.OpenAI(base_url=f"{node.url}/v1", api_key=key, max_retries=0)
    before = node.metric("attnstore_node_inputs_total")
    with pytest.raises(error) as refused:
        bad.embeddings.create(model=model, **options)
    body = refused.value.response.json()
    assert body["error"]["code"] == code and body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    assert node.metric("attnstore_node_inputs_total") == before  # nothing served for it


def test_tei_embed_over_httpx_normalises_and_refuses_overlong_inputs(node, minilm_model) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    answer = httpx.post(f"{node.url}/embed", json={"inputs": TEXTS[:2]}, headers=headers, timeout=60)
    vectors = np.array(answer.json(), np.float32)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert row_cosines(vectors, minilm_model.sentence_transformer.encode(TEXTS[:2])).min() >= 0.9999
    long = " ".join(["word"] * 400)
    refused = httpx.post(f"{node.url}/embed", json={"inputs": long}, headers=headers, timeout=60)
    assert (refused.status_code, refused.json()["error"]["code"]) == (400, "context_length_exceeded")
    cut = httpx.post(f"{node.url}/embed", json={"inputs": long, "truncate": True}, headers=headers, timeout=60)
    assert cut.status_code == 200


def test_the_forwards_compute_no_more_than_their_real_tokens_and_health_needs_no_key(node) -> None:
    assert httpx.get(f"{node.url}/health", timeout=10).json()["status"] == "ok"
    real = node.metric("attnstore_node_forward_tokens_total")
    assert real > 0
    assert node.metric("attnstore_node_forwarded_tokens_total") <= 1.05 * real
