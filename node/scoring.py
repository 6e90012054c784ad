"""Requests and answers of the node's decoder routes: ``/v1/score`` (SGLang's schema) and ``/v1/classify`` (vLLM's).

- ``POST /v1/score``: ``query`` (a string or token ids), ``items`` (a string, a list
  of strings or a list of token id lists, as the query is), ``label_token_ids``,
  ``apply_softmax`` (default false: each label token's probability over the whole
  vocabulary; true: a softmax over the label tokens' logits), ``item_first``
  (default false: the prompt is query then item; true: item then query), ``model``
  (optional, as SGLang's). Texts are joined as strings (``f"{query}{item}"``) and
  tokenized with the tokenizer's special tokens, token ids are joined as lists: as
  SGLang's ``score_request`` does. The answer: ``{"scores": [[p per label] per item],
  "model", "usage", "object": "scoring"}``.
- ``POST /v1/classify``: ``input`` (a text, a list of texts or of token id lists),
  ``labels`` (words, each one token of the model's tokenizer, e.g. ``["positive",
  "negative"]``; default: the node's configured labels), ``model``. The answer is
  vLLM's ``ClassificationResponse``: per input ``{index, label, probs, num_classes}``,
  ``probs`` a softmax over the labels' next-token logits, ``label`` the most probable.
  ``"labels": null`` is the same as leaving it out.

Work per request is bounded (``RequestLimits``): at most ``max_labels`` labels, and at
most ``max_scores`` numbers in the answer (items or inputs x labels); a request past
either is refused with a 400 naming the limit before anything is queued.

Our extension to both, for a node started with ``--chunks``: ``segments``, the prompt
given in segments (instruction, exemplars, question), whose boundaries the chunk
tier fuses stored chunks at (an approximation of the full forward). On
``/v1/score`` a list of strings that joined is the text ``query``, each item its
own last segment (the question; ``item_first`` false); on ``/v1/classify`` one
entry per input, null (that input whole) or a list of at least two strings that
joined is the input. A request with ``segments`` on a node without ``--chunks`` is
refused (400 ``unsupported_segments``): it asks for the chunk tier's answer, which
that node cannot give, and its segments would be tokenized one by one, not as the
whole text.

Both need a decoder (a model with a language-model head); the request is checked
here, label words and lengths when it is tokenized (``tokenization``), before it is
queued.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnstore_node.errors import ApiError, bad_request
from attnstore_node.schema import Input, ModelInfo, RequestLimits, _flag, _input, _inputs, _is_id, _object

_SCORE_FIELDS = frozenset({"query", "items", "label_token_ids", "apply_softmax", "item_first", "model", "segments"})
_CLASSIFY_FIELDS = frozenset({"input", "labels", "model", "user", "segments"})
# Characters of a bad value shown in an error (a request may hold megabytes): enough to find it.
_SHOWN = 60


class SegmentedPrompt(str):
    """A prompt given in segments (``segments``): the text is the segments joined; ``segments`` keeps where they
    meet, for the node's tokenizer (each segment tokenized on its own, as ``sources.segment_tokens``) and the chunk
    tier. A ``str`` so that it travels wherever a text prompt does (``Embedder.score`` takes texts and token ids);
    ``str`` takes no ``__slots__``."""

    segments: tuple[str, ...]

    def __new__(cls, segments: Sequence[str]) -> SegmentedPrompt:
        prompt = super().__new__(cls, "".join(segments))
        prompt.segments = tuple(segments)
        return prompt


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    """One validated scoring request: its prompts (texts or token ids) and the labels to score after each."""

    prompts: tuple[Input, ...]  # per item, the whole prompt (query and item joined)
    labels: tuple[int, ...] | tuple[str, ...]  # label token ids (``/v1/score``) or label words (``/v1/classify``)
    softmax: bool  # over the labels' logits (else over the whole vocabulary)


def parse_score(body: Any, limits: RequestLimits, model: ModelInfo) -> ScoreRequest:
    """A ``/v1/score`` body, validated.

    Raises:
        ApiError: 400 for a malformed body, a missing or empty query or items, items of another kind than the
            query, too many items, more labels than ``limits.max_labels`` or items x labels over
            ``limits.max_scores`` (naming the limit), a label id outside the vocabulary, bad ``segments`` (or any,
            without the chunk tier); 404 for another model; 400 on an encoder.
    """
    fields = _object(body, _SCORE_FIELDS)
    _check_model(fields, model, required=False)
    segments = _segments_field(fields, model)
    labels = fields.get("label_token_ids")
    if isinstance(labels, list) and len(labels) > limits.max_labels:  # checked first: the list may be huge
        raise _too_many_labels(len(labels), limits, "label_token_ids")
    if not isinstance(labels, list) or not labels or not all(_is_id(v) for v in labels):
        raise bad_request(f"'label_token_ids' is required: a non-empty list of token ids, got {_brief(labels)}",
                          "invalid_label_token_ids", "label_token_ids")
    bad = next((v for v in labels if not 0 <= v < model.vocab_size), None)
    if bad is not None:
        raise bad_request(f"Token ID {bad} is out of vocabulary (vocab size: {model.vocab_size})",
                          "invalid_label_token_ids", "label_token_ids")
    softmax, item_first = _flag(fields, "apply_softmax", False), _flag(fields, "item_first", False)
    query, items = fields.get("query"), fields.get("items")
    if query is None or items is None:
        raise bad_request("'query' and 'items' are required: a string and strings, or token ids and token id lists",
                          "missing_input", "query" if query is None else "items")
    if isinstance(query, str):
        texts = [items] if isinstance(items, str) else items
        if not isinstance(texts, list) or not all(isinstance(item, str) for item in texts):
            raise bad_request("with a text 'query', 'items' must be a string or a list of strings",
                              "invalid_input", "items")
        _count(texts, limits)
        if segments is not None:  # the query's segments, then each item as the question
            if item_first:
                raise bad_request("'segments' need 'item_first' false: each item is the prompt's last segment, its"
                                  " question, after the query's segments", "invalid_segments", "segments")
            head = _segments(segments, "segments", query, "'query'")
            prompts: list[Input] = [SegmentedPrompt((*head, item)) for item in texts]
        else:
            prompts = [item + query if item_first else query + item for item in texts]
        for index, (prompt, item) in enumerate(zip(prompts, texts, strict=True)):
            if not item:
                raise bad_request(f"items[{index}] is an empty string; every item needs text", "empty_input",
                                  "items")
            _input(prompt, f"items[{index}]", model)
    elif isinstance(query, list) and all(_is_id(v) for v in query):
        if segments is not None:
            raise bad_request("'segments' go with a text 'query' (segments are texts); this query is token ids",
                              "invalid_segments", "segments")
        if not isinstance(items, list) or not all(isinstance(item, list) for item in items):
            raise bad_request("with a token id 'query', 'items' must be a list of token id lists", "invalid_input",
                              "items")
        _count(items, limits)
        query_ids = _ids(query, "query", model) if query else ()
        rows = [_ids(item, f"items[{index}]", model) for index, item in enumerate(items)]
        prompts = [row + query_ids if item_first else query_ids + row for row in rows]
    else:
        raise bad_request(f"'query' must be a string or a list of token ids, got {type(query).__name__}",
                          "invalid_input", "query")
    _check_scores(len(prompts), len(labels), limits, "label_token_ids")
    return ScoreRequest(tuple(prompts), tuple(labels), softmax)


def parse_classify(body: Any, limits: RequestLimits, model: ModelInfo, labels: tuple[str, ...] | None) -> ScoreRequest:
    """A ``/v1/classify`` body, validated; ``labels`` are the node's configured ones (None: none), taken when the
    body's ``labels`` is left out or null.

    Raises:
        ApiError: 400 for a malformed body, an empty input, no labels (neither given nor configured), fewer than
            two labels, more than ``limits.max_labels`` or inputs x labels over ``limits.max_scores`` (naming the
            limit), bad ``segments`` (or any, without the chunk tier); 404 for another model.
    """
    fields = _object(body, _CLASSIFY_FIELDS)
    _check_model(fields, model, required=False)
    segments = _segments_field(fields, model)
    if "input" not in fields:
        raise bad_request("'input' is required: a text, a list of texts or of token id lists", "missing_input",
                          "input")
    words = fields.get("labels")
    if words is None:  # left out or null: the node's own
        words = labels
    if words is None:
        raise bad_request("'labels' is required (words of one token each, e.g. [\"positive\", \"negative\"]): this"
                          " node has no configured labels", "missing_labels", "labels")
    if isinstance(words, list | tuple) and len(words) > limits.max_labels:
        raise _too_many_labels(len(words), limits, "labels")
    if not isinstance(words, list | tuple) or len(words) < 2 or not all(isinstance(w, str) and w for w in words):
        raise bad_request(f"'labels' must be at least two non-empty words, got {_brief(words)}", "invalid_labels",
                          "labels")
    if len(set(words)) != len(words):
        raise bad_request(f"'labels' holds a word twice: {_brief(words)}", "invalid_labels", "labels")
    inputs = _inputs(fields["input"], "input", limits, model)
    if segments is not None:
        inputs = _segmented_inputs(segments, inputs)
    _check_scores(len(inputs), len(words), limits, "labels")
    return ScoreRequest(inputs, tuple(words), True)


def _too_many_labels(count: int, limits: RequestLimits, field: str) -> ApiError:
    """The 400 of a request with more labels than ``max_labels``."""
    return bad_request(f"too many labels: {count} in '{field}'; the limit is max_labels={limits.max_labels} per"
                       " request (the node's --max-labels)", "too_many_labels", field)


def _check_scores(rows: int, labels: int, limits: RequestLimits, field: str) -> None:
    """Refuse a request whose answer holds more than ``max_scores`` numbers (rows x labels).

    Raises:
        ApiError: 400 naming the limit.
    """
    if rows * labels > limits.max_scores:
        raise bad_request(f"too many scores: {rows} inputs x {labels} labels = {rows * labels}; the limit is"
                          f" max_scores={limits.max_scores} per request (the node's --max-scores): send fewer"
                          " inputs or labels per request", "too_many_scores", field)


def score_response(probabilities: np.ndarray, tokens: int, model: str) -> dict[str, Any]:
    """The ``/v1/score`` answer: per item, the probability of each label token in the order given."""
    return {"scores": probabilities.astype(float).tolist(), "model": model, "object": "scoring",
            "usage": _usage(tokens)}


def classify_response(probabilities: np.ndarray, labels: tuple[str, ...], tokens: int, model: str) -> dict[str, Any]:
    """The ``/v1/classify`` answer (vLLM's ``ClassificationResponse``): per input its label and probabilities."""
    data = [{"index": index, "label": labels[int(np.argmax(row))], "probs": row.astype(float).tolist(),
             "num_classes": len(labels)} for index, row in enumerate(probabilities)]
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": _usage(tokens)}


def _segments_field(fields: dict[str, Any], model: ModelInfo) -> Any:
    """The request's ``segments`` (None: not given).

    Raises:
        ApiError: 400 ``unsupported_segments`` when given to a node without the chunk tier.
    """
    value = fields.get("segments")
    if value is not None and not model.chunks:
        raise bad_request("'segments' ask for the chunk tier, which this node does not run (it serves prompts"
                          " whole): send them to a node started with --chunks, or send the prompt without them",
                          "unsupported_segments", "segments")
    return value


def _segments(value: Any, param: str, text: str, named: str) -> tuple[str, ...]:
    """``value`` checked as the segments of ``text`` (``named`` in messages): non-empty strings joined equal to it.

    Raises:
        ApiError: 400 ``invalid_segments`` naming the bad value.
    """
    if not isinstance(value, list) or not value:
        raise bad_request(f"{param} must be a non-empty list of strings (the prompt's segments), got {_brief(value)}",
                          "invalid_segments", "segments")
    for index, segment in enumerate(value):
        if not isinstance(segment, str) or not segment:
            raise bad_request(f"{param}[{index}] must be a non-empty string, got {_brief(segment)}", "invalid_segments",
                              "segments")
    joined = "".join(value)
    if joined != text:
        at = next((k for k, (a, b) in enumerate(zip(joined, text, strict=False)) if a != b),
                  min(len(joined), len(text)))
        shown = _SHOWN // 2
        raise bad_request(f"{param} joined must equal {named}; they differ at character {at}: the segments have"
                          f" {joined[at:at + shown]!r}, {named} {text[at:at + shown]!r}", "invalid_segments",
                          "segments")
    return tuple(value)


def _segmented_inputs(value: Any, inputs: tuple[Input, ...]) -> tuple[Input, ...]:
    """``/v1/classify``'s inputs with their ``segments``: one entry per input, null (that input whole) or at least
    two segments (instruction, question) joined equal to that text input.

    Raises:
        ApiError: 400 ``invalid_segments`` naming the bad entry.
    """
    if not isinstance(value, list) or len(value) != len(inputs):
        raise bad_request(f"'segments' must be a list of one entry per input ({len(inputs)}: null, or that input's"
                          f" segments), got {_brief(value)}", "invalid_segments", "segments")
    out: list[Input] = []
    for index, (entry, item) in enumerate(zip(value, inputs, strict=True)):
        if entry is None:
            out.append(item)
            continue
        param = f"segments[{index}]"
        if not isinstance(item, str):
            raise bad_request(f"{param} goes with a text input; input[{index}] is token ids", "invalid_segments",
                              "segments")
        if isinstance(entry, list) and len(entry) == 1:
            raise bad_request(f"{param} must hold at least two segments (an instruction first, the question last),"
                              f" got {_brief(entry)}", "invalid_segments", "segments")
        out.append(SegmentedPrompt(_segments(entry, param, item, f"input[{index}]")))
    return tuple(out)


def _brief(value: Any) -> str:
    """``repr(value)``, cut to ``_SHOWN`` characters."""
    shown = repr(value)
    return shown if len(shown) <= _SHOWN else shown[: _SHOWN - 3] + "..."


def _ids(item: Any, param: str, model: ModelInfo) -> tuple[int, ...]:
    """``_input`` of a list the caller checked holds token ids: those ids."""
    ids = _input(item, param, model)
    assert not isinstance(ids, str)  # a list of ints is read as token ids
    return ids


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def _count(items: list[Any], limits: RequestLimits) -> None:
    if not items:
        raise bad_request("'items' is empty: give at least one item", "empty_input", "items")
    if len(items) > limits.max_inputs:
        raise bad_request(f"too many items: {len(items)}; the limit is {limits.max_inputs} per request",
                          "too_many_inputs", "items")


def _check_model(fields: dict[str, Any], model: ModelInfo, *, required: bool) -> None:
    """``model`` names the served model (optional where the schema has a default); the model is a decoder.

    Raises:
        ApiError: 404 for another model; 400 when the served model has no language-model head.
    """
    name = fields.get("model")
    if name is None and required:
        raise bad_request("'model' is required: the name of the served model", "missing_model", "model")
    if name is not None and name != model.name:
        raise ApiError(404, f"The model {name!r} does not exist; this node serves {model.name!r}",
                       "model_not_found", param="model")
    if not model.decoder:
        raise bad_request(f"{model.name!r} is an encoder (no language-model head): scoring and classification need"
                          " a decoder; this node serves /v1/embeddings", "unsupported_model", "model")
