"""An embedding node as a process (all-MiniLM-L6-v2) answering text-embeddings-inference's other routes: ``POST /``
and ``/invocations`` embed as ``/embed`` does, ``GET /`` is its health, ``/info`` describes the model and limits,
``/tokenize`` and ``/decode`` show the model's tokenizer; TEI's documented requests are accepted as written."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.support.nodes import API_KEY, NodeProcess, tiny_store

pytestmark = pytest.mark.real_model

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEXTS = ["What is Deep Learning?", "Failed password for invalid user admin from 10.0.0.1 port 22 ssh2"]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, minilm_model):
    workdir = tmp_path_factory.mktemp("node-tei")
    process = NodeProcess("minilm", tiny_store(workdir / "store", minilm_model), workdir, keys=True,
                          args=("--no-warmup", "--max-inputs", "8", "--max-wait-ms", "5")).start()
    yield process
    assert process.stop() == 0, process.log()


def post(node: NodeProcess, route: str, body: object) -> httpx.Response:
    return httpx.post(f"{node.url}{route}", json=body, headers=AUTH, timeout=60)


@pytest.mark.parametrize("route", ["/", "/invocations"])
def test_post_to_the_root_embeds_as_embed_does_on_an_embedding_model(node, minilm_model, route) -> None:
    answer = post(node, route, {"inputs": TEXTS})  # TEI's documented request
    assert answer.status_code == 200, answer.text
    vectors = np.array(answer.json(), np.float32)
    expected = minilm_model.sentence_transformer.encode(TEXTS, normalize_embeddings=True)
    # Cosines: a text seen before may be an exact hit, kept in fp16.
    assert np.sum(vectors * expected, axis=1).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)  # /embed's normalize default


def test_get_on_the_root_is_the_health_check(node) -> None:
    assert httpx.get(f"{node.url}/", timeout=10).json()["status"] == "ok"


def test_info_names_the_model_its_kind_and_the_limits(node, minilm_model) -> None:
    info = httpx.get(f"{node.url}/info", headers=AUTH, timeout=10).json()
    assert info["model_id"] == "minilm" and "embedding" in info["model_type"]
    assert info["max_input_length"] == minilm_model.sentence_transformer.max_seq_length
    assert info["max_client_batch_size"] == 8 and "exact" in info["tiers"]
    assert httpx.get(f"{node.url}/info", timeout=10).status_code == 401


def test_tokenize_gives_the_tokenizers_ids_with_their_spans_in_the_text(node, minilm_model) -> None:
    answer = post(node, "/tokenize", {"inputs": "test"})  # TEI's documented request
    assert answer.status_code == 200, answer.text
    tokenizer = minilm_model.tokenizer
    [row] = answer.json()
    assert [token["id"] for token in row] == tokenizer("test")["input_ids"]
    assert row[0] == {"id": tokenizer.cls_token_id, "text": "[CLS]", "special": True, "start": None, "stop": None}
    assert row[1] == {"id": tokenizer.convert_tokens_to_ids("test"), "text": "test", "special": False, "start": 0,
                      "stop": 4}
    rows = post(node, "/tokenize", {"inputs": TEXTS, "add_special_tokens": False}).json()
    for text, tokens in zip(TEXTS, rows, strict=True):
        assert [token["id"] for token in tokens] == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert all(text[token["start"]:token["stop"]] == token["text"] for token in tokens)


def test_decode_turns_ids_back_into_text(node, minilm_model) -> None:
    ids = minilm_model.tokenizer(TEXTS)["input_ids"]
    answer = post(node, "/decode", {"ids": ids})
    assert answer.status_code == 200, answer.text
    assert answer.json() == minilm_model.tokenizer.batch_decode(ids, skip_special_tokens=True)
    assert answer.json()[0] == TEXTS[0].lower()  # MiniLM's tokenizer lower-cases
    assert post(node, "/decode", {"ids": ids[0], "skip_special_tokens": False}).json()[0].startswith("[CLS]")


def test_embed_all_gives_every_tokens_embedding_as_sentence_transformers_does(node, minilm_model) -> None:
    texts = [f"{text} (every token)" for text in TEXTS]  # computed rows: an exact hit's states are fp16
    answer = post(node, "/embed_all", {"inputs": texts})
    assert answer.status_code == 200, answer.text
    expected = minilm_model.sentence_transformer.encode(texts, output_value="token_embeddings")
    rows = answer.json()
    assert [len(row) for row in rows] == [len(states) for states in expected]
    for row, states in zip(rows, expected, strict=True):
        np.testing.assert_allclose(np.array(row, np.float32), states.numpy(), atol=1e-4)
    too_long = post(node, "/embed_all", {"inputs": "word " * 600})
    assert (too_long.status_code, too_long.json()["error"]["code"]) == (400, "context_length_exceeded")


@pytest.mark.parametrize(("route", "body", "code"), [
    ("/tokenize", {"inputs": []}, "invalid_input"),
    ("/tokenize", {"inputs": "a", "prompt_name": "no_such_prompt"}, "invalid_prompt_name"),
    ("/decode", {"ids": [[-1]]}, "invalid_token_id"),
    ("/decode", {"ids": "abc"}, "invalid_input"),
    ("/rerank", {"query": "q", "texts": ["a"]}, "unsupported_model"),
    ("/v1/rerank", {"query": "q", "documents": ["a"]}, "unsupported_model"),
])
def test_a_bad_request_gets_a_400_naming_the_fault(node, route, body, code) -> None:
    answer = post(node, route, body)
    assert (answer.status_code, answer.json()["error"]["code"]) == (400, code), answer.text
