"""The client libraries users point at a node (issue 50, item 4), each used as its documentation says for a
self-hosted server, against a real ``attnstore node`` process with an API key.

all-MiniLM-L6-v2 over an empty exact-tier namespace; every answer must give ``SentenceTransformer.encode``'s
vectors (cosine >= 0.9999 per row), and where the same stored numbers travel two routes, equal ones:

- ``openai``: ``OpenAI(...).embeddings.create`` and ``AsyncOpenAI`` with many requests at once (``/v1/embeddings``);
- ``langchain-openai``: ``OpenAIEmbeddings`` (``/v1/embeddings``, through the ``openai`` package);
- ``llama-index-embeddings-text-embeddings-inference``: ``TextEmbeddingsInference`` (``/embed``);
- ``huggingface_hub``: ``InferenceClient.feature_extraction`` on ``/embed`` and on the node's root URL (``/``).

Each client sends the key as ``Authorization: Bearer KEY``. cohere's ``ClientV2.embed`` is not here: it speaks
Cohere's own ``/v2/embed`` schema, which the node does not serve.
"""

from __future__ import annotations

import asyncio

import httpx
import huggingface_hub.constants
import numpy as np
import openai
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import HfHubHTTPError
from langchain_openai import OpenAIEmbeddings
from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference

from tests.support.nodes import API_KEY, NodeProcess, tiny_store
from tests.support.vectors import row_cosines

pytestmark = pytest.mark.real_model

TEXTS = [
    "Failed password for invalid user admin from 10.0.0.1 port 22 ssh2",
    "Receiving block blk_-1608999687919862906 src: /10.250.19.102:54106",
    "A man is playing a guitar.",
    "ok",
    "The quick brown fox jumps over the lazy dog again and again.",
    "Failed password for invalid user admin from 10.0.0.1 port 22 ssh2",
]
# More texts than llama-index's default batch (10 per request): its batch call makes several requests.
MANY = [f"session {i} opened for user u{i % 7} by (uid={1000 + i})" for i in range(23)]
CONCURRENT = 45
WRONG_KEY = "wrong-key-0123456789abcdef"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, minilm_model):
    workdir = tmp_path_factory.mktemp("node-clients")
    store = tiny_store(workdir / "store", minilm_model)
    process = NodeProcess("minilm", store, workdir, keys=True, args=("--no-warmup", "--max-wait-ms", "20")).start()
    yield process
    assert process.stop() == 0, process.log()


@pytest.fixture(scope="module")
def encode(minilm_model):
    """The reference: the model's own ``SentenceTransformer.encode``, as float32 rows."""
    return lambda texts: np.asarray(minilm_model.sentence_transformer.encode(list(texts)), np.float32)


@pytest.fixture
def hub_online(monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub refuses every request in offline mode (``HF_HUB_OFFLINE=1``, which the suite sets), a
    node's loopback URL included: its ``InferenceClient`` needs it off. Read once, at import: patched there."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def _assert_reference(vectors, expected: np.ndarray) -> None:
    vectors = np.asarray(vectors, np.float32)
    assert vectors.shape == expected.shape
    assert row_cosines(vectors, expected).min() >= 0.9999


def _keep(node: NodeProcess, texts: list[str]) -> None:
    """Offer ``texts`` twice: the exact tier keeps a row from its second offer on, so every later answer for them
    is the stored row, whichever route or client asks."""
    with node.counting(2):
        for _ in range(2):
            httpx.post(f"{node.url}/embed", json={"inputs": texts}, headers=HEADERS, timeout=60).raise_for_status()


def test_openai_client_embeddings_equal_sentence_transformers(node: NodeProcess, encode) -> None:
    client = openai.OpenAI(base_url=f"{node.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    answer = client.embeddings.create(model="minilm", input=TEXTS)  # base64 on the wire, decoded by the package
    assert [item.index for item in answer.data] == list(range(len(TEXTS)))
    _assert_reference([item.embedding for item in answer.data], encode(TEXTS))
    one = client.embeddings.create(model="minilm", input=TEXTS[2], encoding_format="float")
    _assert_reference([one.data[0].embedding], encode(TEXTS[2:3]))


def test_async_openai_client_gets_each_of_many_concurrent_requests_its_own_rows(node: NodeProcess, encode) -> None:
    texts = [f"{TEXTS[i % len(TEXTS)]} (request {i})" for i in range(CONCURRENT)]

    async def embed_all() -> list[openai.types.CreateEmbeddingResponse]:
        async with openai.AsyncOpenAI(base_url=f"{node.url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
            # Every request carries its own text and a shared one: rows answered to the wrong request would show.
            return await asyncio.gather(
                *(client.embeddings.create(model="minilm", input=[text, TEXTS[3]]) for text in texts)
            )

    answers = asyncio.run(embed_all())
    expected = encode([*texts, TEXTS[3]])
    _assert_reference([answer.data[0].embedding for answer in answers], expected[:-1])
    _assert_reference([answer.data[1].embedding for answer in answers], np.repeat(expected[-1:], CONCURRENT, 0))


def test_langchain_openai_embeddings_documents_query_and_async(node: NodeProcess, encode) -> None:
    embeddings = OpenAIEmbeddings(
        model="minilm", base_url=f"{node.url}/v1", api_key=API_KEY, check_embedding_ctx_length=False, max_retries=0
    )
    expected = encode(TEXTS)
    _assert_reference(embeddings.embed_documents(TEXTS), expected)
    _assert_reference([embeddings.embed_query(TEXTS[2])], expected[2:3])

    async def both() -> tuple[list[list[float]], list[float]]:  # one loop: the client's connections belong to it
        return await embeddings.aembed_documents(TEXTS), await embeddings.aembed_query(TEXTS[4])

    documents, query = asyncio.run(both())
    _assert_reference(documents, expected)
    _assert_reference([query], expected[4:5])


def test_llama_index_tei_embeddings_batches_queries_and_async_on_embed(node: NodeProcess, encode) -> None:
    tei = TextEmbeddingsInference(model_name="minilm", base_url=node.url, auth_token=API_KEY)
    expected = encode(MANY)
    with node.counting(3):  # 23 texts in batches of 10: three requests
        _assert_reference(tei.get_text_embedding_batch(MANY), expected)
    _assert_reference([tei.get_query_embedding(MANY[5])], expected[5:6])

    async def both() -> tuple[list[list[float]], list[float]]:
        return await tei.aget_text_embedding_batch(MANY), await tei.aget_query_embedding(MANY[7])

    batch, query = asyncio.run(both())
    _assert_reference(batch, expected)
    _assert_reference([query], expected[7:8])
    # /embed normalises: unit vectors, as TEI gives them.
    np.testing.assert_allclose(np.linalg.norm(tei.get_text_embedding_batch(TEXTS), axis=1), 1.0, atol=1e-5)


@pytest.mark.usefixtures("hub_online")
def test_huggingface_inference_client_feature_extraction_on_embed(node: NodeProcess, encode) -> None:
    client = InferenceClient(model=f"{node.url}/embed", token=API_KEY)
    _assert_reference(client.feature_extraction(TEXTS), encode(TEXTS))
    _assert_reference(client.feature_extraction(TEXTS[0]), encode(TEXTS[:1]))  # one text: one row
    cut = client.feature_extraction(TEXTS[:2], dimensions=8, normalize=False)
    assert cut.shape == (2, 8)


@pytest.mark.usefixtures("hub_online")
def test_huggingface_inference_client_on_the_root_url_answers_as_embed(node: NodeProcess, encode) -> None:
    _keep(node, TEXTS)
    root = InferenceClient(model=node.url, token=API_KEY).feature_extraction(TEXTS)
    _assert_reference(root, encode(TEXTS))
    # The same stored rows through /embed, llama-index's route: the very same numbers.
    embed = InferenceClient(model=f"{node.url}/embed", token=API_KEY).feature_extraction(TEXTS)
    np.testing.assert_array_equal(root, embed)
    tei = TextEmbeddingsInference(model_name="minilm", base_url=node.url, auth_token=API_KEY)
    np.testing.assert_array_equal(np.asarray(tei.get_text_embedding_batch(TEXTS), np.float32), embed)


@pytest.mark.usefixtures("hub_online")
def test_every_client_sends_the_key_as_a_bearer_token_and_a_wrong_key_is_refused(node: NodeProcess) -> None:
    refused = 'attnstore_node_requests_total{route="%s",status="401"}'
    before = {route: node.metric(refused % route) for route in ("/v1/embeddings", "/embed")}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{node.url}/v1", api_key=WRONG_KEY, max_retries=0).embeddings.create(
            model="minilm", input=TEXTS[:1]
        )
    with pytest.raises(openai.AuthenticationError):
        OpenAIEmbeddings(
            model="minilm", base_url=f"{node.url}/v1", api_key=WRONG_KEY, check_embedding_ctx_length=False,
            max_retries=0,
        ).embed_query(TEXTS[0])
    with pytest.raises(HfHubHTTPError) as hub:
        InferenceClient(model=f"{node.url}/embed", token=WRONG_KEY).feature_extraction(TEXTS[0])
    assert hub.value.response.status_code == 401
    # llama-index reads the body whatever the status: the node's error object, not a vector.
    with pytest.raises(KeyError):
        TextEmbeddingsInference(model_name="minilm", base_url=node.url, auth_token=WRONG_KEY).get_query_embedding(
            TEXTS[0]
        )
    assert node.metric(refused % "/v1/embeddings") == before["/v1/embeddings"] + 2
    assert node.metric(refused % "/embed") == before["/embed"] + 2
