"""A cross-encoder's route parsers and answers (``node/predict.py``), without a node: TEI's ``/predict`` inputs
(a text, a pair, a batch) and huggingface_hub's ``parameters``, vLLM's ``/score`` pairing; labels best first."""

from __future__ import annotations

import numpy as np
import pytest

from attnstore_node.errors import ApiError
from attnstore_node.predict import pair_score_response, parse_pair_score, parse_predict, predict_response
from attnstore_node.schema import ModelInfo, RequestLimits

CLASSIFIER = ModelInfo("m", 8, 100, 64, classes=("neg", "neu", "pos"))
RERANKER = ModelInfo("m", 8, 100, 64, classes=("LABEL_0",))
LIMITS = RequestLimits(max_inputs=3)


@pytest.mark.parametrize(("inputs", "parsed", "batch"), [
    ("a text", ("a text",), False),
    (["a", "b"], (("a", "b"),), False),
    ([["a"], ["b", "c"]], ("a", ("b", "c")), True),
])
def test_a_text_a_pair_and_a_batch_are_told_apart(inputs, parsed, batch) -> None:
    request = parse_predict({"inputs": inputs}, LIMITS, CLASSIFIER)
    assert (request.inputs, request.batch) == (parsed, batch)


def test_huggingface_hubs_parameters_set_raw_scores_and_top_k() -> None:
    request = parse_predict({"inputs": "a", "parameters": {"function_to_apply": "none", "top_k": 1}}, LIMITS,
                            CLASSIFIER)
    assert (request.raw_scores, request.top_k) == (True, 1)
    assert not parse_predict({"inputs": "a", "parameters": {"function_to_apply": "softmax"}}, LIMITS,
                             CLASSIFIER).raw_scores


@pytest.mark.parametrize(("body", "model", "code"), [
    ({"inputs": ["a", "b", "c"]}, CLASSIFIER, "invalid_input"),
    ({"inputs": [["a", "b", "c"]]}, CLASSIFIER, "invalid_input"),
    ({"inputs": [["a"]] * 4}, CLASSIFIER, "too_many_inputs"),
    ({"inputs": "a", "parameters": {"function_to_apply": "sigmoid"}}, CLASSIFIER, "invalid_parameter"),
    ({"inputs": "a", "parameters": {"top_k": 0}}, CLASSIFIER, "invalid_parameter"),
    ({"inputs": "a"}, ModelInfo("m", 8, 100, 64), "unsupported_model"),
])
def test_a_bad_predict_body_is_refused_naming_the_fault(body, model, code) -> None:
    with pytest.raises(ApiError) as refused:
        parse_predict(body, LIMITS, model)
    assert (refused.value.status, refused.value.code) == (400, code)


def test_predict_answers_every_label_best_first_one_list_per_input_of_a_batch() -> None:
    scores = np.array([[0.2, 0.1, 0.7], [0.5, 0.3, 0.2]], np.float32)
    batch = parse_predict({"inputs": [["a"], ["b"]]}, LIMITS, CLASSIFIER)
    answer = predict_response(scores, batch, CLASSIFIER.classes)
    assert [[item["label"] for item in row] for row in answer] == [["pos", "neg", "neu"], ["neg", "neu", "pos"]]
    single = parse_predict({"inputs": "a", "parameters": {"top_k": 2}}, LIMITS, CLASSIFIER)
    assert [item["label"] for item in predict_response(scores[:1], single, CLASSIFIER.classes)] == ["pos", "neg"]


def test_score_pairs_one_text_with_each_or_lists_by_position() -> None:
    assert parse_pair_score({"text_1": "q", "text_2": ["a", "b"]}, LIMITS, RERANKER).pairs == (("q", "a"), ("q", "b"))
    assert parse_pair_score({"text_1": ["x", "y"], "text_2": ["a", "b"]}, LIMITS, RERANKER).pairs == (
        ("x", "a"), ("y", "b"))
    for body, model in (({"text_1": ["x", "y"], "text_2": ["a", "b", "c"]}, RERANKER),
                        ({"text_1": "q", "text_2": ["a"]}, CLASSIFIER),
                        ({"text_1": "q", "text_2": ["a"] * 4}, RERANKER)):
        with pytest.raises(ApiError):
            parse_pair_score(body, LIMITS, model)
    answer = pair_score_response(np.array([[0.25], [0.5]], np.float32), 9, "m")
    assert [(item["index"], item["score"]) for item in answer["data"]] == [(0, 0.25), (1, 0.5)]
