"""TEI's tokenizer routes' parsers and ``/info`` (``node/tokens.py``), without a node."""

from __future__ import annotations

import pytest

from attnstore_node.errors import ApiError
from attnstore_node.schema import ModelInfo, RequestLimits
from attnstore_node.tokens import info_response, parse_decode, parse_tokenize

MODEL = ModelInfo("m", 8, 100, 64, prompts=("query",), tiers=("exact",))
LIMITS = RequestLimits(max_inputs=2)


def test_tokenize_takes_a_text_or_texts_and_a_known_prompt() -> None:
    assert parse_tokenize({"inputs": "a"}, LIMITS, MODEL).texts == ("a",)
    request = parse_tokenize({"inputs": ["a", "b"], "add_special_tokens": False, "prompt_name": "query"}, LIMITS,
                             MODEL)
    assert (request.texts, request.add_special_tokens, request.prompt_name) == (("a", "b"), False, "query")


def test_decode_takes_ids_or_rows_of_them() -> None:
    assert parse_decode({"ids": [1, 2]}, LIMITS, MODEL).rows == ((1, 2),)
    assert parse_decode({"ids": [[1], [2, 3]], "skip_special_tokens": False}, LIMITS, MODEL).rows == ((1,), (2, 3))


@pytest.mark.parametrize(("parse", "body", "code"), [
    (parse_tokenize, {"inputs": []}, "invalid_input"),
    (parse_tokenize, {"inputs": ["a", "b", "c"]}, "too_many_inputs"),
    (parse_tokenize, {"inputs": "a", "prompt_name": "document"}, "invalid_prompt_name"),
    (parse_decode, {"ids": [[100]]}, "invalid_token_id"),
    (parse_decode, {"ids": [[1], [2], [3]]}, "too_many_inputs"),
    (parse_decode, {"ids": "1 2"}, "invalid_input"),
])
def test_a_bad_body_is_refused_naming_the_fault(parse, body, code) -> None:
    with pytest.raises(ApiError) as refused:
        parse(body, LIMITS, MODEL)
    assert (refused.value.status, refused.value.code) == (400, code)


@pytest.mark.parametrize(("root", "model_type"), [
    ("embed", {"embedding": {"pooling": "sentence-transformers"}}),
    ("rerank", {"reranker": {"id2label": {"0": "yes"}, "label2id": {"yes": 0}}}),
])
def test_info_names_the_models_type_by_its_root_route_and_the_limits(root, model_type) -> None:
    info = info_response(MODEL, LIMITS, root)
    assert info["model_type"] == model_type
    assert (info["model_id"], info["max_input_length"], info["max_client_batch_size"], info["tiers"]) == (
        "m", 64, 2, ["exact"])
