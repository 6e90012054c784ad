"""The scoring routes' limits on labels and on items x labels (``RequestLimits``), and ``"labels": null``."""

from __future__ import annotations

import pytest

from attnstore_node.errors import ApiError
from attnstore_node.schema import ModelInfo, RequestLimits
from attnstore_node.scoring import parse_classify, parse_score

MODEL = ModelInfo("m", dimension=4, vocab_size=100, max_length=16, decoder=True)
LIMITS = RequestLimits(max_labels=3, max_scores=6)


def _refusal(call, *args) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call(*args)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize(("items", "labels", "code", "named"), [
    (1, 4, "too_many_labels", "max_labels=3"),
    (3, 3, "too_many_scores", "max_scores=6"),
])
def test_score_past_a_limit_is_a_400_naming_it(items: int, labels: int, code: str, named: str) -> None:
    body = {"query": "q", "items": [f"i{n}" for n in range(items)], "label_token_ids": list(range(1, labels + 1))}
    error = _refusal(parse_score, body, LIMITS, MODEL)
    assert error.code == code and named in str(error) and error.param == "label_token_ids"


def test_score_at_the_limits_is_accepted() -> None:
    body = {"query": [5], "items": [[6], [7]], "label_token_ids": [1, 2, 3]}
    assert len(parse_score(body, LIMITS, MODEL).prompts) == 2


def test_too_many_label_ids_are_refused_before_they_are_read() -> None:
    body = {"query": "q", "items": ["a"], "label_token_ids": ["not an id"] * 10}  # the count is the first check
    assert _refusal(parse_score, body, LIMITS, MODEL).code == "too_many_labels"


@pytest.mark.parametrize(("inputs", "labels", "code"), [
    (["a"], ["w", "x", "y", "z"], "too_many_labels"),
    (["a", "b", "c", "d"], ["w", "x"], "too_many_scores"),
])
def test_classify_past_a_limit_is_a_400_naming_it(inputs: list[str], labels: list[str], code: str) -> None:
    error = _refusal(parse_classify, {"input": inputs, "labels": labels}, LIMITS, MODEL, None)
    assert error.code == code and error.param == "labels"


def test_classify_with_null_labels_takes_the_nodes_labels() -> None:
    parsed = parse_classify({"input": ["a"], "labels": None}, LIMITS, MODEL, ("yes", "no"))
    assert parsed.labels == ("yes", "no")
    assert _refusal(parse_classify, {"input": ["a"], "labels": None}, LIMITS, MODEL, None).code == "missing_labels"


def test_configured_labels_past_the_limit_are_refused_too() -> None:
    assert _refusal(parse_classify, {"input": ["a"]}, LIMITS, MODEL, ("a", "b", "c", "d")).code == "too_many_labels"
