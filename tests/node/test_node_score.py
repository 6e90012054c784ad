"""A decoder node as a process (tiny random Llama, embedded store with prefix blocks): ``/v1/score`` and
``/v1/classify`` equal the plain transformers forward's label probabilities, for computed rows, rows sharing a
prefix within a call and rows whose prefix is stored; SGLang's documented request is accepted; bad requests get
their 4xx before anything is queued."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from tests.support.caches import WORDS
from tests.support.nodes import API_KEY, NodeProcess, decoder_store, save_tiny_llama

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOLERANCE = 1e-4
rng = np.random.default_rng(37)
# Long enough for a prefix that pays (the prefix tier's 64 tokens), whatever the tokenizer makes of the words.
QUERY = "Here are questions with their answers . " + " ".join(rng.choice(WORDS, size=90)) + " . The answer is"
STORED_QUERY = "Stored exemplars follow . " + " ".join(rng.choice(WORDS, size=90)) + " . The answer is"
# Items that share nothing but the query (a prefix shared by some items only is computed per row: one level).
ITEMS = [f" item{i} " + " ".join(rng.choice(WORDS, size=int(rng.integers(2, 8)))) for i in range(64)]


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory):
    """The tiny Llama's folder, its tokenizer and its plain causal LM (the reference)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    loaded = save_tiny_llama(folder)
    reference = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    return folder, loaded, AutoTokenizer.from_pretrained(folder), reference


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, decoder):
    folder, loaded, tokenizer, _ = decoder
    workdir = tmp_path_factory.mktemp("decoder-node")
    stored = tokenizer(STORED_QUERY, add_special_tokens=True)["input_ids"][:-1]  # [CLS] and the query, no [SEP]
    store = decoder_store(workdir / "store", loaded, [stored])
    process = NodeProcess(str(folder), store, workdir, keys=True, args=("--no-warmup", "--max-wait-ms", "20")).start()
    yield process
    process.kill()


def reference_scores(decoder, rows: list[list[int]], labels: list[int], softmax: bool) -> np.ndarray:
    """The plain forward's next-token probabilities of ``labels`` after each row (fp32)."""
    *_, model = decoder
    out = []
    with torch.inference_mode():
        for row in rows:
            logits = model(input_ids=torch.tensor([row])).logits[0, -1].float()  # (vocab,)
            out.append(torch.softmax(logits[labels], -1) if softmax else torch.softmax(logits, -1)[labels])
    return torch.stack(out).numpy()


def text_rows(decoder, prompts: list[str]) -> list[list[int]]:
    return [decoder[2](prompt, add_special_tokens=True)["input_ids"] for prompt in prompts]


def post(node: NodeProcess, route: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{node.url}{route}", json=body, headers=kwargs.pop("headers", AUTH), timeout=120, **kwargs)


@pytest.mark.parametrize("softmax", [False, True])
def test_scores_of_64_items_equal_the_plain_forward_and_compute_the_query_once(node, decoder, softmax) -> None:
    labels = [1037, 1038, 2003]
    before = (node.metric("attnstore_node_forward_tokens_total"), node.metric("attnstore_node_distinct_tokens_total"))
    with node.counting():
        answer = post(node, "/v1/score", {"model": str(decoder[0]), "query": QUERY + str(softmax), "items": ITEMS,
                                          "label_token_ids": labels, "apply_softmax": softmax})
        assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "scoring" and body["model"] == str(decoder[0])
    rows = text_rows(decoder, [QUERY + str(softmax) + item for item in ITEMS])
    expected = reference_scores(decoder, rows, labels, softmax)
    assert np.abs(np.array(body["scores"]) - expected).max() < TOLERANCE
    assert body["usage"]["prompt_tokens"] == sum(map(len, rows))
    forwarded = node.metric("attnstore_node_forward_tokens_total") - before[0]
    distinct = node.metric("attnstore_node_distinct_tokens_total") - before[1]
    assert 0 < forwarded <= 1.05 * distinct, (forwarded, distinct)


def test_rows_whose_prefix_is_stored_are_served_from_it_and_equal_the_plain_forward(node, decoder) -> None:
    labels = [1037, 1038]
    before = node.metric('attnstore_node_rows_total{tier="prefix"}')
    with node.counting():
        answer = post(node, "/v1/score", {"query": STORED_QUERY, "items": ITEMS[:3], "label_token_ids": labels})
        assert answer.status_code == 200, answer.text
    expected = reference_scores(decoder, text_rows(decoder, [STORED_QUERY + item for item in ITEMS[:3]]), labels, False)
    assert np.abs(np.array(answer.json()["scores"]) - expected).max() < TOLERANCE
    assert node.metric('attnstore_node_rows_total{tier="prefix"}') - before == 3


def test_token_id_queries_and_item_first_join_as_sglang_does(node, decoder) -> None:
    query, items, labels = [2023, 2003, 1037], [[3899, 2000], [4937]], [1037, 1996]
    for item_first in (False, True):
        answer = post(node, "/v1/score", {"query": query, "items": items, "label_token_ids": labels,
                                          "item_first": item_first, "apply_softmax": True})
        assert answer.status_code == 200, answer.text
        rows = [item + query if item_first else query + item for item in items]
        expected = reference_scores(decoder, rows, labels, True)
        assert np.abs(np.array(answer.json()["scores"]) - expected).max() < TOLERANCE


def test_sglangs_documented_request_is_accepted_as_it_is(node, decoder) -> None:
    # SGLang's docs (sampling/score API): its model name aside, which this node does not serve.
    example = {"query": "The capital of France is", "items": ["Paris", "London", "Berlin"],
               "label_token_ids": [9454, 2753], "apply_softmax": True}
    for body in (example, {**example, "model": str(decoder[0])}):
        answer = post(node, "/v1/score", body)
        assert answer.status_code == 200, answer.text
        scores = np.array(answer.json()["scores"])
        assert scores.shape == (3, 2) and np.allclose(scores.sum(axis=1), 1.0, atol=1e-5)
    assert post(node, "/v1/score", {**example, "model": "qwen/qwen2.5-0.5b-instruct"}).status_code == 404


def test_classify_answers_vllms_shape_with_the_labels_probabilities(node, decoder) -> None:
    texts = [QUERY + " positive or negative ?", "a short one"]
    answer = post(node, "/v1/classify", {"model": str(decoder[0]), "input": texts, "labels": ["positive", "negative"]})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "list" and body["id"].startswith("classify-") and body["usage"]["completion_tokens"] == 0
    ids = [decoder[2](w, add_special_tokens=False)["input_ids"][0] for w in ("positive", "negative")]
    expected = reference_scores(decoder, text_rows(decoder, texts), ids, True)
    for index, row in enumerate(body["data"]):
        assert row["index"] == index and row["num_classes"] == 2
        assert np.abs(np.array(row["probs"]) - expected[index]).max() < TOLERANCE
        assert row["label"] == ("positive", "negative")[int(np.argmax(expected[index]))]


def test_embeddings_on_a_decoder_still_answer_last_token_states(node, decoder) -> None:
    answer = post(node, "/v1/embeddings", {"model": str(decoder[0]), "input": ["a short one", "another one"]})
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["data"][0]["embedding"]) == 64


def two_token_word(decoder) -> str:
    word = next(w for w in ("xylophonists", "unbelievableness", "antidisestablishment")
                if len(decoder[2](w, add_special_tokens=False)["input_ids"]) > 1)
    return word


@pytest.mark.parametrize(("route", "body", "status", "message"), [
    ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [999999]}, 400,
     "Token ID 999999 is out of vocabulary"),
    ("/v1/score", {"query": "q", "items": [], "label_token_ids": [5]}, 400, "'items' is empty"),
    ("/v1/score", {"query": "q", "items": ["a", ""], "label_token_ids": [5]}, 400, "items[1] is an empty string"),
    ("/v1/score", {"query": [5, 6], "items": ["a"], "label_token_ids": [5]}, 400, "token id lists"),
    ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": []}, 400, "label_token_ids"),
    ("/v1/score", {"query": "word " * 3000, "items": ["a"], "label_token_ids": [5]}, 400, "the limit is"),
    ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [5], "temperature": 1}, 400, "temperature"),
    ("/v1/score", {"model": "other", "query": "q", "items": ["a"], "label_token_ids": [5]}, 404, "'other'"),
    ("/v1/classify", {"input": "q", "labels": ["positive"]}, 400, "at least two"),
    ("/v1/classify", {"input": "q"}, 400, "no configured labels"),
    ("/v1/classify", {"input": "", "labels": ["positive", "negative"]}, 400, "empty string"),
])
def test_bad_requests_get_their_4xx_naming_the_bad_value(node, route, body, status, message) -> None:
    answer = post(node, route, body)
    assert answer.status_code == status, answer.text
    assert message in answer.json()["error"]["message"]


def test_a_label_word_of_two_tokens_is_refused_naming_it(node, decoder) -> None:
    word = two_token_word(decoder)
    answer = post(node, "/v1/classify", {"input": "some text", "labels": ["positive", word]})
    assert answer.status_code == 400 and word in answer.json()["error"]["message"]
    assert answer.json()["error"]["code"] == "invalid_labels"


def test_score_needs_the_api_key(node) -> None:
    answer = post(node, "/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [5]}, headers={})
    assert answer.status_code == 401


def test_an_encoder_node_refuses_scoring(tmp_path: Path, model) -> None:
    from tests.support.nodes import tiny_store

    folder, loaded = model
    node = NodeProcess(str(folder), tiny_store(tmp_path / "store", loaded), tmp_path, args=("--no-warmup",)).start()
    try:
        answer = httpx.post(f"{node.url}/v1/score", json={"query": "q", "items": ["a"], "label_token_ids": [5]},
                            timeout=30)
        assert answer.status_code == 400 and "encoder" in answer.json()["error"]["message"]
    finally:
        node.kill()
