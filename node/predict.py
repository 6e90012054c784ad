"""Requests and answers of a cross-encoder's routes: text-embeddings-inference's ``/predict`` and vLLM's ``/score``.

A cross-encoder (a ``*ForSequenceClassification`` model, or a sentence-transformers
``CrossEncoder`` folder: ``ModelInfo.classes`` names its labels) scores a text
or a pair of texts with its own classifier head on the base model's last hidden
states; the pairs are tokenized as ``CrossEncoder`` tokenizes them.

- ``POST /predict`` (TEI): ``inputs`` is a text, a pair ``[text, text]``, or a
  batch of them (``[[text], [text, text], ...]``); ``raw_scores`` (default false:
  a sigmoid for a model of one label, else a softmax over the labels; true: the
  logits); ``truncate`` (default false: an input past the limit is refused);
  ``parameters`` as ``huggingface_hub``'s ``text_classification`` sends them
  (``function_to_apply``: ``"none"`` is ``raw_scores``, the label count's own
  activation is the default; ``top_k``: the best this many labels). The answer,
  per input, every label with its score, best first: ``[{"score", "label"}]`` for
  one input, a list of those for a batch.
- ``POST /score`` (vLLM's, for a cross-encoder of one label): ``text_1`` (a text
  or texts) and ``text_2`` (a text or texts): one ``text_1`` against each
  ``text_2``, or pairs by position when both are lists of one length; ``model``
  (optional); ``truncate_prompt_tokens`` (accepted: a pair past the limit is cut,
  longest text first, as ``CrossEncoder`` cuts it). Scores through the model's
  own activation, as ``CrossEncoder.predict``'s. The answer: ``{"id", "object",
  "created", "model", "data": [{"index", "object": "score", "score"}], "usage"}``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnstore_node.errors import ApiError, bad_request
from attnstore_node.schema import ModelInfo, RequestLimits, _flag, _input, _object

_PREDICT_FIELDS = frozenset({"inputs", "raw_scores", "truncate", "truncation_direction", "parameters"})
# What huggingface_hub's ``InferenceClient.text_classification`` sends under ``parameters``.
_PARAMETERS = frozenset({"function_to_apply", "top_k"})
_SCORE_FIELDS = frozenset({"model", "text_1", "text_2", "truncate_prompt_tokens", "encoding_format", "user"})
PredictInput = str | tuple[str, str]  # TEI's: a text, or a pair of texts


@dataclass(frozen=True, slots=True)
class PredictRequest:
    inputs: tuple[PredictInput, ...]
    batch: bool  # a batch was given (the answer is a list per input)
    raw_scores: bool = False
    truncate: bool = False
    top_k: int | None = None  # the best this many labels per input (None: all)


def require_classifier(model: ModelInfo, route: str) -> None:
    """Refuse ``route`` on a model without a classifier head.

    Raises:
        ApiError: 400 ``unsupported_model``.
    """
    if not model.classes:
        raise bad_request(f"{model.name!r} has no classifier head: {route} needs a cross-encoder (a"
                          " *ForSequenceClassification model or a CrossEncoder folder)", "unsupported_model", "model")


def parse_predict(body: Any, limits: RequestLimits, model: ModelInfo) -> PredictRequest:
    """A ``/predict`` body, validated.

    Raises:
        ApiError: 400 for a malformed body, an input that is neither a text nor a pair of texts, too many inputs,
            or a model without a classifier head.
    """
    require_classifier(model, "/predict")
    fields = _object(body, _PREDICT_FIELDS)
    value = fields.get("inputs")
    if isinstance(value, str):
        inputs, batch = [[value]], False
    elif isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        if len(value) > 2:
            raise bad_request("'inputs' as a list of strings is one pair: two texts (a batch is a list of lists,"
                              f" [[text], [text, text], ...]); got {len(value)} strings", "invalid_input", "inputs")
        inputs, batch = [value], False
    elif isinstance(value, list) and value and all(isinstance(item, list) for item in value):
        inputs, batch = value, True
    else:
        raise bad_request("'inputs' must be a string, a pair [string, string] or a batch [[string], [string, string],"
                          f" ...], got {value!r:.60}", "invalid_input", "inputs")
    if len(inputs) > limits.max_inputs:
        raise bad_request(f"too many inputs: {len(inputs)}; the limit is {limits.max_inputs} per request",
                          "too_many_inputs", "inputs")
    raw, top_k = _parameters(fields.get("parameters"), model, _flag(fields, "raw_scores", False))
    return PredictRequest(tuple(_sequence(item, f"inputs[{index}]", model) for index, item in enumerate(inputs)),
                          batch, raw, _flag(fields, "truncate", False), top_k)


def _parameters(value: Any, model: ModelInfo, raw: bool) -> tuple[bool, int | None]:
    """``raw_scores`` and ``top_k`` after huggingface_hub's ``parameters`` (None: none given).

    Raises:
        ApiError: 400 naming a parameter it does not know or an activation other than the model's own or none.
    """
    if value is None:
        return raw, None
    fields = _object(value, _PARAMETERS)
    function = fields.get("function_to_apply")
    own = "sigmoid" if len(model.classes) == 1 else "softmax"
    if function not in (None, "none", own):
        raise bad_request(f"'parameters.function_to_apply' must be 'none' or {own!r} (this model's own), got"
                          f" {function!r:.40}", "invalid_parameter", "parameters")
    top_k = fields.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise bad_request(f"'parameters.top_k' must be an integer >= 1, got {top_k!r:.40}", "invalid_parameter",
                          "parameters")
    return raw or function == "none", top_k


def predict_response(scores: np.ndarray, request: PredictRequest, classes: tuple[str, ...]) -> Any:
    """TEI's answer: per input, every label with its score, best first."""
    answers = [[{"score": float(row[k]), "label": classes[k]} for k in np.argsort(-row, kind="stable")]
               [: request.top_k] for row in scores]
    return answers if request.batch else answers[0]


@dataclass(frozen=True, slots=True)
class PairScoreRequest:
    pairs: tuple[tuple[str, str], ...]


def parse_pair_score(body: Any, limits: RequestLimits, model: ModelInfo) -> PairScoreRequest:
    """A vLLM ``/score`` body, validated.

    Raises:
        ApiError: 400 for a malformed body, texts missing or not texts, lists of different lengths, too many
            pairs, a model that is not a cross-encoder of one label; 404 for another model.
    """
    require_classifier(model, "/score")
    if len(model.classes) != 1:
        raise bad_request(f"/score needs a cross-encoder of one label; {model.name!r} has {len(model.classes)}"
                          " (use /predict)", "unsupported_model", "model")
    fields = _object(body, _SCORE_FIELDS)
    name = fields.get("model")
    if name is not None and name != model.name:
        raise ApiError(404, f"The model {name!r} does not exist; this node serves {model.name!r}", "model_not_found",
                       param="model")
    first, second = (_texts(fields.get(param), param, model) for param in ("text_1", "text_2"))
    if len(first) == 1:
        pairs = [(first[0], text) for text in second]
    elif len(first) == len(second):
        pairs = list(zip(first, second, strict=True))
    else:
        raise bad_request(f"'text_1' has {len(first)} texts and 'text_2' {len(second)}: give one text_1, or as many"
                          " as text_2 (paired by position)", "invalid_input", "text_2")
    if len(pairs) > limits.max_inputs:
        raise bad_request(f"too many pairs: {len(pairs)}; the limit is {limits.max_inputs} per request",
                          "too_many_inputs", "text_2")
    return PairScoreRequest(tuple(pairs))


def pair_score_response(scores: np.ndarray, tokens: int, model: str) -> dict[str, Any]:
    """vLLM's ``ScoreResponse``: per pair its score, in the request's order."""
    data = [{"index": index, "object": "score", "score": float(score)} for index, score in enumerate(scores[:, 0])]
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _sequence(item: Any, param: str, model: ModelInfo) -> PredictInput:
    if not isinstance(item, list) or not 1 <= len(item) <= 2 or not all(isinstance(text, str) for text in item):
        raise bad_request(f"{param} must be [text] or [text, text], got {item!r:.60}", "invalid_input", "inputs")
    texts = [str(_input(text, f"{param}[{k}]", model)) for k, text in enumerate(item)]
    return texts[0] if len(texts) == 1 else (texts[0], texts[1])


def _texts(value: Any, param: str, model: ModelInfo) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(text, str) for text in texts):
        raise bad_request(f"'{param}' is required: a string or a non-empty list of strings, got {value!r:.60}",
                          "invalid_input", param)
    return [str(_input(text, f"{param}[{k}]", model)) for k, text in enumerate(texts)]
