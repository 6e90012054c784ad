"""The rerank routes' parser and answer (``node/rerank.py``), without a node: both shapes told apart, their
defaults by route, the documents' forms, the refusals; scores ordered best first, ``top_n`` and texts as asked."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnstore_client.rerank import RerankTemplate
from attnstore_node.errors import ApiError
from attnstore_node.rerank import decoder_scores, parse_rerank, prompts_of, rerank_response
from attnstore_node.schema import ModelInfo, RequestLimits

DECODER = ModelInfo("m", 8, 100, 64, decoder=True)
CROSS = ModelInfo("m", 8, 100, 64, classes=("LABEL_0",))
LIMITS = RequestLimits(max_inputs=4)


def test_texts_make_teis_shape_and_documents_the_cohere_one_with_returned_documents_by_route() -> None:
    tei = parse_rerank({"query": "q", "texts": ["a", "b"], "truncate": True}, LIMITS, CROSS, route="/rerank")
    assert (tei.shape, tei.documents, tei.return_text, tei.truncate) == ("tei", ("a", "b"), False, True)
    v1 = parse_rerank({"query": "q", "documents": ["a", {"text": "b"}]}, LIMITS, DECODER, route="/v1/rerank")
    assert (v1.shape, v1.documents, v1.return_text) == ("documents", ("a", "b"), True)
    assert not parse_rerank({"query": "q", "documents": ["a"]}, LIMITS, DECODER, route="/v2/rerank").return_text


@pytest.mark.parametrize(("body", "model", "code"), [
    ({"query": "q", "texts": ["a"]}, ModelInfo("m", 8, 100, 64), "unsupported_model"),
    ({"query": "q", "texts": ["a"]}, ModelInfo("m", 8, 100, 64, classes=("a", "b")), "unsupported_model"),
    ({"query": "q", "texts": ["a"], "instruction": "x"}, CROSS, "invalid_input"),
    ({"query": "q", "texts": ["a"] * 5}, DECODER, "too_many_inputs"),
    ({"query": "q", "documents": [""]}, DECODER, "invalid_input"),
    ({"query": "q", "documents": ["a"], "top_n": True}, DECODER, "invalid_top_n"),
    ({"query": 3, "texts": ["a"]}, DECODER, "invalid_input"),
    ({"texts": ["a"], "query": "q", "instruction": 7}, DECODER, "invalid_input"),
    ([], DECODER, "invalid_body"),
])
def test_a_bad_body_is_refused_naming_the_fault(body, model, code) -> None:
    with pytest.raises(ApiError) as refused:
        parse_rerank(body, LIMITS, model, route="/rerank")
    assert (refused.value.status, refused.value.code) == (400, code)


def test_another_model_is_a_404() -> None:
    with pytest.raises(ApiError) as refused:
        parse_rerank({"model": "other", "query": "q", "documents": ["a"]}, LIMITS, DECODER, route="/v1/rerank")
    assert (refused.value.status, refused.value.code) == (404, "model_not_found")


def test_answers_are_best_first_cut_to_top_n_with_texts_when_asked() -> None:
    request = parse_rerank({"query": "q", "documents": ["a", "b", "c"], "top_n": 2}, LIMITS, DECODER,
                           route="/v1/rerank")
    answer = rerank_response([0.1, 0.9, 0.5], request, 12, "m")
    assert [(r["index"], r["relevance_score"], r["document"]["text"]) for r in answer["results"]] == [
        (1, 0.9, "b"), (2, 0.5, "c")]
    assert answer["usage"]["total_tokens"] == 12
    tei = parse_rerank({"query": "q", "texts": ["a", "b"]}, LIMITS, DECODER, route="/rerank")
    assert rerank_response([0.2, 0.3], tei, 3, "m") == [{"index": 1, "score": 0.3}, {"index": 0, "score": 0.2}]


def test_a_decoders_score_is_p_yes_or_its_log_odds() -> None:
    probabilities = np.array([[0.25, 0.75], [1.0, 0.0]], np.float32)  # ("no", "yes")
    assert decoder_scores(probabilities, raw=False) == [0.75, 0.0]
    raw = decoder_scores(probabilities, raw=True)
    assert raw[0] == pytest.approx(math.log(3)) and raw[1] == -math.inf


def test_every_prompt_of_a_query_shares_all_before_its_document() -> None:
    request = parse_rerank({"query": "why", "texts": ["one", "two"], "instruction": "judge"}, LIMITS, DECODER,
                           route="/rerank")
    first, second = prompts_of(request, RerankTemplate())
    shared = first[: first.index("one")]
    assert second.startswith(shared) and "judge" in shared and "why" in shared
    assert first.endswith(RerankTemplate().tail)
