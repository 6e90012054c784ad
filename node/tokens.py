"""Requests and answers of text-embeddings-inference's tokenizer routes, and the model's facts TEI's ``/info`` gives.

- ``POST /tokenize``: ``inputs`` (a string or a list of strings),
  ``add_special_tokens`` (default true), ``prompt_name`` (one of the model's
  prompts, put before the text). The answer: per input its tokens, each
  ``{id, text, special, start, stop}``: ``start``/``stop`` the token's character
  span in the text (the prompt's included, as TEI's), ``text`` that span, a special
  token's own string and no span.
- ``POST /decode``: ``ids`` (token ids, or a list of lists of them),
  ``skip_special_tokens`` (default true). The answer: a list of strings.
- ``GET /info``: the model (``model_id``, ``model_type`` by what its ``POST /``
  does, ``max_input_length``) and the node's limits, in TEI's ``Info`` fields,
  with the node's tiers beside them.

The model's tokenizer runs on the node's tokenizer thread (``tokenization``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attnstore_node.errors import bad_request
from attnstore_node.schema import ModelInfo, RequestLimits, _flag, _input, _is_id, _object, _prompt_name

_TOKENIZE_FIELDS = frozenset({"inputs", "add_special_tokens", "prompt_name"})
_DECODE_FIELDS = frozenset({"ids", "skip_special_tokens"})
VERSION = "attnstore"  # TEI's ``version``: the server's


@dataclass(frozen=True, slots=True)
class Token:
    """One token of ``/tokenize``'s answer."""

    id: int
    text: str  # its span of the text, or a special token's own string
    special: bool
    start: int | None  # its span in the text (None for a special token)
    stop: int | None

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "text": self.text, "special": self.special, "start": self.start, "stop": self.stop}


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    texts: tuple[str, ...]
    add_special_tokens: bool = True
    prompt_name: str | None = None


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    rows: tuple[tuple[int, ...], ...]
    skip_special_tokens: bool = True


def parse_tokenize(body: Any, limits: RequestLimits, model: ModelInfo) -> TokenizeRequest:
    """A ``/tokenize`` body, validated.

    Raises:
        ApiError: 400 for a malformed body, inputs that are not texts, too many, an unknown ``prompt_name``.
    """
    fields = _object(body, _TOKENIZE_FIELDS)
    value = fields.get("inputs")
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(text, str) for text in texts):
        raise bad_request(f"'inputs' must be a string or a non-empty list of strings, got {value!r:.60}",
                          "invalid_input", "inputs")
    if len(texts) > limits.max_inputs:
        raise bad_request(f"too many inputs: {len(texts)}; the limit is {limits.max_inputs} per request",
                          "too_many_inputs", "inputs")
    checked = tuple(str(_input(text, f"inputs[{index}]", model)) for index, text in enumerate(texts))
    return TokenizeRequest(checked, _flag(fields, "add_special_tokens", True), _prompt_name(fields, model))


def parse_decode(body: Any, limits: RequestLimits, model: ModelInfo) -> DecodeRequest:
    """A ``/decode`` body, validated.

    Raises:
        ApiError: 400 for a malformed body, ids that are not token ids of the vocabulary, too many rows.
    """
    fields = _object(body, _DECODE_FIELDS)
    value = fields.get("ids")
    rows = [value] if isinstance(value, list) and value and all(_is_id(v) for v in value) else value
    if not isinstance(rows, list) or not rows or not all(isinstance(row, list) for row in rows):
        raise bad_request(f"'ids' must be a list of token ids or a list of such lists, got {value!r:.60}",
                          "invalid_input", "ids")
    if len(rows) > limits.max_inputs:
        raise bad_request(f"too many inputs: {len(rows)}; the limit is {limits.max_inputs} per request",
                          "too_many_inputs", "ids")
    checked = tuple(_input(row, f"ids[{index}]", model) for index, row in enumerate(rows))
    return DecodeRequest(tuple(row for row in checked if not isinstance(row, str)),
                         _flag(fields, "skip_special_tokens", True))


def info_response(model: ModelInfo, limits: RequestLimits, root: str) -> dict[str, Any]:
    """TEI's ``Info`` of the served model, ``root`` being the route its ``POST /`` takes (``app.root_route``), with
    the node's tiers."""
    classes = model.classes or ("yes",)  # a decoder reranker's one score: P("yes")
    labels = {"id2label": {str(k): name for k, name in enumerate(classes)},
              "label2id": {name: k for k, name in enumerate(classes)}}
    model_types: dict[str, dict[str, Any]] = {"embed": {"embedding": {"pooling": "sentence-transformers"}},
                                              "rerank": {"reranker": labels}, "predict": {"classifier": labels}}
    model_type = model_types[root]
    return {"model_id": model.name, "model_sha": None, "model_dtype": "float32", "model_type": model_type,
            "max_concurrent_requests": None, "max_input_length": min(model.max_length, limits.max_input_tokens),
            "max_batch_tokens": None, "max_batch_requests": None, "max_client_batch_size": limits.max_inputs,
            "auto_truncate": False, "tokenization_workers": 1, "version": VERSION, "sha": None,
            "docker_label": None, "tiers": list(model.tiers), "absent_tiers": dict(model.absent_tiers)}
