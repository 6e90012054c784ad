"""A decoder node as a process (tiny random Llama) reranking: TEI's ``/rerank``, Cohere's and vLLM's ``/v1/rerank``
and ``/v2/rerank``, and TEI's ``POST /``, each document scored by Qwen3-Reranker's prompt as the plain transformers
forward scores it (P("yes") over "yes" and "no"), the query's prompt computed once per request; requests copied from
each server's documentation are accepted as written (the model's name aside); bad requests get their 4xx."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from attnstore_client.rerank import RerankTemplate
from tests.support.caches import WORDS
from tests.support.nodes import API_KEY, NodeProcess, decoder_store, save_tiny_llama

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOLERANCE = 1e-4
rng = np.random.default_rng(50)
QUERY = "what does the log line say about " + " ".join(rng.choice(WORDS, size=12))
DOCUMENTS = [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 20)))) for _ in range(24)]


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory):
    """The tiny Llama's folder, its tokenizer and its plain causal LM (the reference)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    loaded = save_tiny_llama(folder)
    reference = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    return folder, loaded, AutoTokenizer.from_pretrained(folder), reference


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, decoder):
    workdir = tmp_path_factory.mktemp("rerank-node")
    store = decoder_store(workdir / "store", decoder[1])
    process = NodeProcess(str(decoder[0]), store, workdir, keys=True,
                          args=("--no-warmup", "--max-wait-ms", "20", "--max-inputs", "64")).start()
    yield process
    assert process.stop() == 0, process.log()


def post(node: NodeProcess, route: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{node.url}{route}", json=body, headers=AUTH if headers is None else headers, timeout=120)


def reference_scores(decoder, query: str, documents: list[str], instruction: str | None = None) -> np.ndarray:
    """Qwen3-Reranker's scores by the plain forward: per document P("yes") of the softmax over ("no", "yes")."""
    _, _, tokenizer, model = decoder
    template = RerankTemplate()
    no, yes = (tokenizer(word, add_special_tokens=False)["input_ids"][0] for word in template.labels)
    out = []
    with torch.inference_mode():
        for document in documents:
            ids = tokenizer(template.prompt(query, document, instruction), add_special_tokens=True)["input_ids"]
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            out.append(torch.softmax(logits[[no, yes]], -1)[1].item())
    return np.array(out)


def test_tei_rerank_scores_every_text_as_the_plain_forward_best_first(node, decoder) -> None:
    answer = post(node, "/rerank", {"query": QUERY, "texts": DOCUMENTS, "return_text": True})
    assert answer.status_code == 200, answer.text
    ranks = answer.json()
    expected = reference_scores(decoder, QUERY, DOCUMENTS)
    assert sorted(rank["index"] for rank in ranks) == list(range(len(DOCUMENTS)))
    assert [rank["score"] for rank in ranks] == sorted((rank["score"] for rank in ranks), reverse=True)
    for rank in ranks:
        assert abs(rank["score"] - expected[rank["index"]]) < TOLERANCE
        assert rank["text"] == DOCUMENTS[rank["index"]]


def test_raw_scores_are_the_log_odds_of_yes(node, decoder) -> None:
    answer = post(node, "/rerank", {"query": QUERY, "texts": DOCUMENTS[:4], "raw_scores": True})
    assert answer.status_code == 200, answer.text
    expected = reference_scores(decoder, QUERY, DOCUMENTS[:4])
    for rank in answer.json():
        p = expected[rank["index"]]
        assert abs(rank["score"] - np.log(p / (1 - p))) < 1e-3
        assert "text" not in rank


def test_the_query_of_a_request_is_computed_once_for_all_its_documents(node) -> None:
    before = (node.metric("attnstore_node_forward_tokens_total"), node.metric("attnstore_node_distinct_tokens_total"))
    with node.counting():
        answer = post(node, "/rerank", {"query": QUERY + " once", "texts": DOCUMENTS})
        assert answer.status_code == 200, answer.text
    forwarded = node.metric("attnstore_node_forward_tokens_total") - before[0]
    distinct = node.metric("attnstore_node_distinct_tokens_total") - before[1]
    assert 0 < forwarded <= 1.05 * distinct, (forwarded, distinct)


@pytest.mark.parametrize("route", ["/v1/rerank", "/v2/rerank", "/rerank"])
def test_the_documented_cohere_and_vllm_request_is_answered_with_results_best_first(node, decoder, route) -> None:
    # vLLM's and Cohere's documented example, the model named as this node serves it.
    documents = ["The capital of Brazil is Brasilia.", "The capital of France is Paris.",
                 "Horses and cows are both animals"]
    body = {"model": str(decoder[0]), "query": "What is the capital of France?", "documents": documents, "top_n": 2}
    answer = post(node, route, body)
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    expected = reference_scores(decoder, body["query"], documents)
    assert [result["index"] for result in results] == list(np.argsort(-expected)[:2])
    for result in results:
        assert abs(result["relevance_score"] - expected[result["index"]]) < TOLERANCE
        if route == "/v2/rerank":  # Cohere's v2 returns no documents
            assert "document" not in result
        else:
            assert result["document"] == {"text": documents[result["index"]]}
    assert answer.json()["usage"]["total_tokens"] > 0


def test_documents_given_as_objects_and_an_instruction_are_taken(node, decoder) -> None:
    instruction = "Given a log line, say whether it reports a failure"
    answer = post(node, "/v1/rerank", {"query": QUERY, "documents": [{"text": text} for text in DOCUMENTS[:3]],
                                       "instruction": instruction, "return_documents": False})
    assert answer.status_code == 200, answer.text
    expected = reference_scores(decoder, QUERY, DOCUMENTS[:3], instruction)
    for result in answer.json()["results"]:
        assert abs(result["relevance_score"] - expected[result["index"]]) < TOLERANCE
        assert "document" not in result


def test_post_to_the_root_reranks_on_a_decoder_node_as_tei_routes_a_reranker(node, decoder) -> None:
    answer = post(node, "/", {"query": QUERY, "texts": DOCUMENTS[:3]})
    assert answer.status_code == 200, answer.text
    expected = reference_scores(decoder, QUERY, DOCUMENTS[:3])
    assert all(abs(rank["score"] - expected[rank["index"]]) < TOLERANCE for rank in answer.json())
    info = httpx.get(f"{node.url}/info", headers=AUTH, timeout=10).json()
    assert "reranker" in info["model_type"] and info["model_id"] == str(decoder[0])


@pytest.mark.parametrize(("body", "status", "code"), [
    ({"query": QUERY, "texts": []}, 400, "invalid_input"),
    ({"query": "", "texts": ["a"]}, 400, "invalid_input"),
    ({"query": QUERY, "texts": ["a", 3]}, 400, "invalid_input"),
    ({"query": QUERY, "documents": [{"title": "no text"}]}, 400, "invalid_input"),
    ({"query": QUERY, "documents": ["a"], "top_n": 0}, 400, "invalid_top_n"),
    ({"query": QUERY, "documents": ["a"], "model": "rerank-v3.5"}, 404, "model_not_found"),
    ({"query": QUERY}, 400, "missing_input"),
    ({"query": QUERY, "texts": ["a"], "colour": "red"}, 400, "unknown_parameter"),
    ({"query": QUERY, "texts": ["word " * 600]}, 400, "context_length_exceeded"),
    ({"query": QUERY, "texts": ["a"] * 65}, 400, "too_many_inputs"),
])
def test_a_bad_rerank_request_gets_its_4xx_naming_the_fault(node, body, status, code) -> None:
    answer = post(node, "/rerank", body)
    assert (answer.status_code, answer.json()["error"]["code"]) == (status, code), answer.text


def test_coheres_own_client_reranks_through_v2_rerank(node, decoder) -> None:
    import cohere

    client = cohere.ClientV2(api_key=API_KEY, base_url=node.url)
    answer = client.rerank(model=str(decoder[0]), query=QUERY, documents=DOCUMENTS[:6], top_n=3)
    expected = reference_scores(decoder, QUERY, DOCUMENTS[:6])
    assert [result.index for result in answer.results] == list(np.argsort(-expected)[:3])
    assert all(abs(result.relevance_score - expected[result.index]) < TOLERANCE for result in answer.results)
    with pytest.raises(cohere.core.api_error.ApiError) as refused:
        cohere.ClientV2(api_key="wrong", base_url=node.url).rerank(model=str(decoder[0]), query=QUERY,
                                                                  documents=["a"])
    assert refused.value.status_code == 401


def test_reranking_needs_the_api_key(node) -> None:
    answer = post(node, "/v1/rerank", {"query": QUERY, "documents": ["a"]}, headers={})
    assert answer.status_code == 401
