"""Requests in OpenAI's and TEI's schemas: every accepted input form, and each refusal with its status and code."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from attnstore_node.errors import ApiError
from attnstore_node.schema import (
    EmbedRequest,
    ModelInfo,
    RequestLimits,
    openai_response,
    parse_openai,
    parse_tei,
    tei_response,
)

MODEL = ModelInfo("m", dimension=4, vocab_size=100, max_length=16)
LIMITS = RequestLimits(max_inputs=3)


@pytest.mark.parametrize(("given", "inputs"), [
    ("a b", ("a b",)),
    (["a", "b c"], ("a", "b c")),
    ([5, 6, 7], ((5, 6, 7),)),
    ([[5, 6], [7]], ((5, 6), (7,))),
])
def test_openai_input_is_a_string_a_list_of_strings_a_token_list_or_a_list_of_token_lists(given, inputs) -> None:
    assert parse_openai({"model": "m", "input": given}, LIMITS, MODEL).inputs == inputs


@pytest.mark.parametrize(("body", "status", "code"), [
    ({"model": "m", "input": []}, 400, "empty_input"),
    ({"model": "m", "input": ""}, 400, "empty_input"),
    ({"model": "m", "input": [[]]}, 400, "empty_input"),
    ({"model": "m", "input": ["a", "b", "c", "d"]}, 400, "too_many_inputs"),
    ({"model": "m", "input": [[5, 100]]}, 400, "invalid_token_id"),
    ({"model": "m", "input": [-1, 5]}, 400, "invalid_token_id"),
    ({"model": "m", "input": ["a", [5]], "encoding_format": "hex"}, 400, "invalid_encoding_format"),
    ({"model": "m", "input": [True]}, 400, "invalid_input"),
    ({"model": "m", "input": "a", "dimensions": 5}, 400, "invalid_dimensions"),
    ({"model": "m", "input": "a", "temperature": 1}, 400, "unknown_parameter"),
    ({"input": "a"}, 400, "missing_model"),
    ({"model": "other", "input": "a"}, 404, "model_not_found"),
    (["a"], 400, "invalid_body"),
])
def test_bad_openai_requests_are_refused_with_their_status_and_code(body, status: int, code: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse_openai(body, LIMITS, MODEL)
    assert (refused.value.status, refused.value.code) == (status, code)
    error = refused.value.body()["error"]
    assert set(error) == {"message", "type", "code", "param"} and error["message"]


def test_base64_is_little_endian_float32_of_the_same_vectors_and_dimensions_keep_the_first() -> None:
    vectors = np.arange(8, dtype=np.float32).reshape(2, 4) / 7
    answer = openai_response(vectors, EmbedRequest(("a", "b"), "base64", dimensions=3), tokens=9, model="m")
    decoded = [np.frombuffer(base64.b64decode(item["embedding"]), "<f4") for item in answer["data"]]
    np.testing.assert_array_equal(np.stack(decoded), vectors[:, :3])
    assert answer["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
    assert [item["index"] for item in answer["data"]] == [0, 1]


def test_tei_normalises_by_default_and_refuses_rather_than_truncates() -> None:
    request = parse_tei({"inputs": ["a", "b"]}, LIMITS, MODEL)
    assert (request.normalize, request.truncate) == (True, False)
    vectors = tei_response(np.array([[3.0, 4.0, 0, 0], [0, 0, 0, 2.0]], np.float32), request)
    np.testing.assert_allclose(vectors, [[0.6, 0.8, 0, 0], [0, 0, 0, 1.0]])
    with pytest.raises(ApiError, match="'normalize' must be true or false"):
        parse_tei({"inputs": "a", "normalize": "yes"}, LIMITS, MODEL)


@pytest.mark.parametrize("parse", [parse_tei, parse_openai])
def test_a_prompt_name_must_name_one_of_the_models_prompts(parse) -> None:
    model = ModelInfo("m", dimension=4, vocab_size=100, max_length=16, prompts=("passage", "query"))
    body = {"inputs": ["a"]} if parse is parse_tei else {"input": ["a"], "model": "m"}
    assert parse(body, LIMITS, model).prompt_name is None
    assert parse({**body, "prompt_name": "query"}, LIMITS, model).prompt_name == "query"
    for bad in ("document", 3, ""):
        with pytest.raises(ApiError, match=r"must name one of the model's prompts \('passage', 'query'\)"):
            parse({**body, "prompt_name": bad}, LIMITS, model)
    with pytest.raises(ApiError, match=r"prompts \(none\), got 'query'"):
        parse({**body, "prompt_name": "query"}, LIMITS, MODEL)
