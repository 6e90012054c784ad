"""A cross-encoder node as a process (tiny random BERT sequence classifiers): TEI's ``/rerank`` and ``/predict``,
Cohere's ``/v1/rerank``, vLLM's ``/score`` and TEI's ``POST /`` by the model's kind answer what sentence-transformers'
``CrossEncoder`` of the same folder gives (its ``rank`` and ``predict``, TEI's activations on ``/predict``) within
1e-4; the documented requests are accepted as written; bad requests get their 4xx."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from sentence_transformers import CrossEncoder

from attnstore_client.models import load_model
from tests.support.adapters import save_tiny_cross_encoder
from tests.support.nodes import API_KEY, NodeProcess, tiny_store

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOLERANCE = 1e-4
QUERY = "What is Deep Learning?"
TEXTS = ["Deep Learning is not...", "Deep learning is...", "disk full on node 7", "Paris is the capital of France."]


def _node(tmp_path_factory: pytest.TempPathFactory, labels: int):
    workdir = tmp_path_factory.mktemp(f"cross-encoder-{labels}")
    folder = save_tiny_cross_encoder(workdir / "model", "bert", labels)
    process = NodeProcess(str(folder), tiny_store(workdir / "store", load_model(str(folder))), workdir, keys=True,
                          args=("--no-warmup", "--max-wait-ms", "5", "--max-inputs", "16")).start()
    return process, CrossEncoder(str(folder), device="cpu"), folder


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory):
    """A node on a cross-encoder of one label, with the ``CrossEncoder`` of its folder."""
    process, reference, folder = _node(tmp_path_factory, 1)
    yield process, reference, folder
    assert process.stop() == 0, process.log()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory):
    """A node on a cross-encoder of three labels, with the ``CrossEncoder`` of its folder."""
    process, reference, folder = _node(tmp_path_factory, 3)
    yield process, reference, folder
    assert process.stop() == 0, process.log()


def post(node: NodeProcess, route: str, body: object) -> httpx.Response:
    return httpx.post(f"{node.url}{route}", json=body, headers=AUTH, timeout=60)


@pytest.mark.parametrize("route", ["/rerank", "/"])
def test_tei_rerank_ranks_as_cross_encoder_rank(reranker, route) -> None:
    node, reference, _ = reranker
    answer = post(node, route, {"query": QUERY, "texts": TEXTS, "return_text": True})  # TEI's documented request
    assert answer.status_code == 200, answer.text
    expected = reference.rank(QUERY, TEXTS, return_documents=True)
    assert [rank["index"] for rank in answer.json()] == [item["corpus_id"] for item in expected]
    for rank, item in zip(answer.json(), expected, strict=True):
        assert abs(rank["score"] - float(item["score"])) < TOLERANCE and rank["text"] == item["text"]


def test_raw_scores_are_the_logits(reranker) -> None:
    node, reference, _ = reranker
    answer = post(node, "/rerank", {"query": QUERY, "texts": TEXTS, "raw_scores": True})
    logits = reference.predict([(QUERY, text) for text in TEXTS], activation_fn=torch.nn.Identity())
    for rank in answer.json():
        assert abs(rank["score"] - float(logits[rank["index"]])) < TOLERANCE


def test_cohere_shaped_rerank_gives_top_n_with_documents(reranker) -> None:
    node, reference, folder = reranker
    documents = ["The capital of Brazil is Brasilia.", "The capital of France is Paris.",
                 "Horses and cows are both animals"]
    body = {"model": str(folder), "query": "What is the capital of France?", "documents": documents, "top_n": 2}
    answer = post(node, "/v1/rerank", body)
    assert answer.status_code == 200, answer.text
    expected = reference.rank(body["query"], documents, top_k=2)
    results = answer.json()["results"]
    assert [result["index"] for result in results] == [item["corpus_id"] for item in expected]
    for result, item in zip(results, expected, strict=True):
        assert abs(result["relevance_score"] - float(item["score"])) < TOLERANCE
    assert results[0]["document"] == {"text": documents[results[0]["index"]]}


def test_vllm_score_pairs_one_text_with_each_and_lists_by_position(reranker) -> None:
    node, reference, folder = reranker
    one = post(node, "/score", {"model": str(folder), "text_1": QUERY, "text_2": TEXTS})
    assert one.status_code == 200, one.text
    expected = reference.predict([(QUERY, text) for text in TEXTS])
    assert [item["index"] for item in one.json()["data"]] == list(range(len(TEXTS)))
    np.testing.assert_allclose([item["score"] for item in one.json()["data"]], expected, atol=TOLERANCE)
    paired = post(node, "/score", {"text_1": TEXTS[:2], "text_2": TEXTS[2:]}).json()["data"]
    np.testing.assert_allclose([item["score"] for item in paired], reference.predict(list(zip(TEXTS[:2], TEXTS[2:],
                                                                                             strict=True))),
                               atol=TOLERANCE)


def test_predict_gives_every_label_by_tei_activations_best_first(classifier) -> None:
    node, reference, _ = classifier
    pair = post(node, "/predict", {"inputs": [QUERY, TEXTS[1]]})  # one pair: one list of labels
    assert pair.status_code == 200, pair.text
    logits = reference.predict([(QUERY, TEXTS[1])], activation_fn=torch.nn.Identity())
    probabilities = torch.softmax(torch.tensor(logits), dim=-1).numpy()[0]
    labels = reference.model.config.id2label
    assert [item["label"] for item in pair.json()] == [labels[k] for k in np.argsort(-probabilities)]
    for item in pair.json():
        k = next(k for k, name in labels.items() if name == item["label"])
        assert abs(item["score"] - probabilities[k]) < TOLERANCE
    batch = post(node, "/predict", {"inputs": [[TEXTS[0]], [QUERY, TEXTS[1]]], "raw_scores": True})
    assert batch.status_code == 200, batch.text
    assert len(batch.json()) == 2 and all(len(row) == 3 for row in batch.json())
    raw = {item["label"]: item["score"] for item in batch.json()[1]}
    assert all(abs(raw[labels[k]] - float(logits[0][k])) < TOLERANCE for k in range(3))
    root = post(node, "/", {"inputs": "a single text"})  # a classifier's POST / is /predict
    assert root.status_code == 200 and len(root.json()) == 3
    info = httpx.get(f"{node.url}/info", headers=AUTH, timeout=10).json()
    assert info["model_type"] == {"classifier": {"id2label": {str(k): v for k, v in labels.items()},
                                                 "label2id": {v: k for k, v in labels.items()}}}


@pytest.mark.parametrize(("route", "body", "code"), [
    ("/predict", {"inputs": ["a", "b", "c"]}, "invalid_input"),
    ("/predict", {"inputs": [["a", "b", "c"]]}, "invalid_input"),
    ("/predict", {"inputs": 3}, "invalid_input"),
    ("/predict", {"inputs": [["a"]] * 17}, "too_many_inputs"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "invalid_input"),
    ("/score", {"text_1": "a"}, "invalid_input"),
    ("/rerank", {"query": QUERY, "texts": ["word " * 600]}, "context_length_exceeded"),
    ("/rerank", {"query": QUERY, "texts": ["a"], "instruction": "judge"}, "invalid_input"),
    ("/v1/score", {"query": QUERY, "items": ["a"], "label_token_ids": [1]}, "unsupported_model"),
])
def test_a_bad_request_gets_a_400_naming_the_fault(reranker, route, body, code) -> None:
    node, _, _ = reranker
    answer = post(node, route, body)
    assert (answer.status_code, answer.json()["error"]["code"]) == (400, code), answer.text


def test_a_long_pair_is_cut_as_cross_encoder_cuts_it_when_truncate_is_asked(reranker) -> None:
    node, reference, _ = reranker
    long = "document " * 400
    answer = post(node, "/rerank", {"query": QUERY, "texts": [long], "truncate": True})
    assert answer.status_code == 200, answer.text
    assert abs(answer.json()[0]["score"] - float(reference.predict([(QUERY, long)])[0])) < TOLERANCE


def test_a_classifier_of_several_labels_neither_reranks_nor_scores_pairs(classifier) -> None:
    node, _, _ = classifier
    answer = post(node, "/rerank", {"query": QUERY, "texts": TEXTS})
    assert (answer.status_code, answer.json()["error"]["code"]) == (400, "unsupported_model")
    assert "use /predict" in answer.json()["error"]["message"]
    assert post(node, "/score", {"text_1": QUERY, "text_2": TEXTS}).status_code == 400


def test_huggingface_hubs_text_classification_reads_predict(classifier, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    node, reference, _ = classifier
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the suite's offline mode: loopback
    client = huggingface_hub.InferenceClient(model=f"{node.url}/predict", token=API_KEY)
    # TEI answers one input with a flat list of labels, of which the client keeps the first: the best.
    best = client.text_classification("I like you.")
    expected = post(node, "/predict", {"inputs": "I like you."}).json()
    assert (best.label, round(best.score, 6)) == (expected[0]["label"], round(expected[0]["score"], 6))
    raw = client.text_classification("I like you.", top_k=1, function_to_apply="none")
    logits = post(node, "/predict", {"inputs": "I like you.", "raw_scores": True}).json()
    assert (raw.label, round(raw.score, 6)) == (logits[0]["label"], round(logits[0]["score"], 6))
