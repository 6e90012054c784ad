"""Requests and answers of the node's two embedding routes, and the limits every request is held to.

- ``POST /v1/embeddings``: OpenAI's schema. ``input`` is a string, a list of
  strings, a list of token ids or a list of lists of token ids; ``model`` names the
  served model; ``encoding_format`` is ``float`` (the default) or ``base64`` (little-endian
  float32, what the ``openai`` package asks for unless told otherwise);
  ``dimensions`` keeps the first that many dimensions (sentence-transformers'
  ``truncate_dim``); ``usage`` counts the tokens of every input. Our extension:
  ``prompt_name``, as on ``/embed``.
- ``POST /embed``: text-embeddings-inference's. ``inputs`` as above, ``normalize``
  (default true), ``truncate`` (default false: an input longer than the model's
  limit is refused rather than cut), ``dimensions``, ``prompt_name`` (one of the
  model's sentence-transformers prompts, put before every text as
  ``SentenceTransformer.encode(prompt_name=...)`` does; absent: the model's default
  prompt, if its config names one); the answer is a list of vectors.

Texts are tokenized as ``SentenceTransformer.encode`` tokenizes them (its
truncation included, for ``/v1/embeddings``); token ids are the model's input as
given, special tokens included. Validation happens here, before a request
reaches the batcher, so nothing is computed for a request that is refused.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from attnstore_node.errors import ApiError, bad_request

Input = str | tuple[int, ...]
EncodingFormat = Literal["float", "base64"]
# How a cross-encoder row's logits become its scores: TEI's /predict (sigmoid for one label, else a softmax), or
# the model's own activation, as CrossEncoder.predict applies it (rerank, vLLM's /score).
Activation = Literal["tei", "model"]
_OPENAI_FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "user", "prompt_name"})
_TEI_FIELDS = frozenset({"inputs", "normalize", "truncate", "dimensions", "prompt_name"})
_EMBED_ALL_FIELDS = frozenset({"inputs", "truncate", "prompt_name"})


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request may ask for; a request past a limit is refused with a 4xx, nothing computed."""

    max_inputs: int = 2048  # inputs per request: OpenAI's own limit
    max_input_tokens: int = 8192  # tokens per input (OpenAI's); the model's own limit applies first
    max_body_bytes: int = 8 * 2**20  # a request body of 2,048 inputs of 1,000 characters, with room
    # Seconds a client has to send a request's headers, and then its body: a full body at about 1 Mbit/s, while
    # a client that trickles bytes (or sends none) holds a connection no longer than this.
    read_timeout: float = 60.0
    # Labels per scoring request (/v1/score's label_token_ids, /v1/classify's labels, the node's --labels): every
    # label is a column of the LM head's output for every row, and a number in the answer.
    max_labels: int = 1024
    # Items x labels per scoring request: the answer's numbers (65,536 is about 1.3 MB of JSON), whatever the mix.
    max_scores: int = 65536

    def __post_init__(self) -> None:
        limits = (self.max_inputs, self.max_input_tokens, self.max_body_bytes, self.max_labels, self.max_scores)
        if min(limits) < 1 or not self.read_timeout > 0:
            raise ValueError(f"RequestLimits: every limit must be >= 1 and read_timeout > 0, got {self}")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the routes need to know of the served model."""

    name: str  # the name requests give as ``model``
    dimension: int  # of its embeddings
    vocab_size: int  # token ids are in [0, vocab_size)
    max_length: int  # tokens per row it takes (texts are truncated there, like SentenceTransformer.encode)
    decoder: bool = False  # it has a language-model head: it scores (``/v1/score``, ``/v1/classify``)
    chunks: bool = False  # its cache runs the chunk tier (``--chunks``): scoring requests may give ``segments``
    tiers: tuple[str, ...] = ()  # the tiers its cache has (``AttnCache.tiers``), shown by ``/v1/models``
    absent_tiers: tuple[tuple[str, str], ...] = ()  # and the ones it lacks, each with why
    prompts: tuple[str, ...] = ()  # the names of its sentence-transformers prompts (a request's ``prompt_name``)
    classes: tuple[str, ...] = ()  # a cross-encoder's labels, in logit order (one: a reranker); () for any other


@dataclass(frozen=True, slots=True)
class EmbedRequest:
    """One validated request: its inputs and how to shape the answer."""

    inputs: tuple[Input, ...]
    encoding_format: EncodingFormat = "float"
    dimensions: int | None = None  # keep the first this many dimensions
    normalize: bool = False  # scale every vector to unit length
    truncate: bool = True  # cut an input past the token limit (else refuse the request)
    prompt_name: str | None = None  # the model's prompt put before every text (None: its default, if any)


def parse_openai(body: Any, limits: RequestLimits, model: ModelInfo) -> EmbedRequest:
    """A ``/v1/embeddings`` body, validated.

    Raises:
        ApiError: 400 for a malformed body, an empty or invalid input, too many inputs, a token id out of the
            vocabulary or bad options; 404 for a model this node does not serve.
    """
    fields = _object(body, _OPENAI_FIELDS)
    name = fields.get("model")
    if not isinstance(name, str):
        raise bad_request("'model' is required: the name of the served model", "missing_model", "model")
    if name != model.name:
        raise ApiError(404, f"The model {name!r} does not exist; this node serves {model.name!r}",
                       "model_not_found", param="model")
    if "input" not in fields:
        raise bad_request("'input' is required: a string, a list of strings or of token id lists", "missing_input",
                          "input")
    encoding = fields.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise bad_request(f"'encoding_format' must be 'float' or 'base64', got {encoding!r}",
                          "invalid_encoding_format", "encoding_format")
    return EmbedRequest(
        inputs=_inputs(fields["input"], "input", limits, model), encoding_format=encoding,
        dimensions=_dimensions(fields.get("dimensions"), model), prompt_name=_prompt_name(fields, model),
    )


def parse_tei(body: Any, limits: RequestLimits, model: ModelInfo) -> EmbedRequest:
    """A ``/embed`` body (text-embeddings-inference's), validated.

    Raises:
        ApiError: 400, as for :func:`parse_openai`.
    """
    fields = _object(body, _TEI_FIELDS)
    if "inputs" not in fields:
        raise bad_request("'inputs' is required: a string, a list of strings or of token id lists", "missing_input",
                          "inputs")
    return EmbedRequest(
        inputs=_inputs(fields["inputs"], "inputs", limits, model),
        dimensions=_dimensions(fields.get("dimensions"), model),
        normalize=_flag(fields, "normalize", True), truncate=_flag(fields, "truncate", False),
        prompt_name=_prompt_name(fields, model),
    )


def parse_embed_all(body: Any, limits: RequestLimits, model: ModelInfo) -> EmbedRequest:
    """An ``/embed_all`` body (TEI's: ``inputs``, ``truncate``, ``prompt_name``), validated.

    Raises:
        ApiError: 400, as for :func:`parse_tei`.
    """
    fields = _object(body, _EMBED_ALL_FIELDS)
    if "inputs" not in fields:
        raise bad_request("'inputs' is required: a string, a list of strings or of token id lists", "missing_input",
                          "inputs")
    return EmbedRequest(inputs=_inputs(fields["inputs"], "inputs", limits, model),
                        truncate=_flag(fields, "truncate", False), prompt_name=_prompt_name(fields, model))


def shaped(vectors: np.ndarray, request: EmbedRequest) -> np.ndarray:
    """``(n, dim)`` float32 vectors as the request asked: first ``dimensions`` kept, then normalised if asked."""
    if request.dimensions is not None:
        vectors = vectors[:, : request.dimensions]
    if request.normalize:
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = vectors / np.maximum(norms, 1e-12)
    return np.ascontiguousarray(vectors, dtype=np.float32)


def openai_response(vectors: np.ndarray, request: EmbedRequest, tokens: int, model: str) -> dict[str, Any]:
    """The ``/v1/embeddings`` answer: one ``embedding`` object per input, in input order, and the usage."""
    data = []
    for index, vector in enumerate(shaped(vectors, request)):
        embedding: str | list[float]
        if request.encoding_format == "base64":
            embedding = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        else:
            embedding = vector.tolist()
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def tei_response(vectors: np.ndarray, request: EmbedRequest) -> list[list[float]]:
    """The ``/embed`` answer: one vector per input, in input order."""
    vectors = shaped(vectors, request)
    return [row.tolist() for row in vectors]


def _object(body: Any, allowed: frozenset[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, got {type(body).__name__}", "invalid_body")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(f"unrecognized request argument(s) {unknown}; accepted: {sorted(allowed)}",
                          "unknown_parameter", unknown[0])
    return body


def _flag(fields: dict[str, Any], name: str, default: bool) -> bool:
    value = fields.get(name, default)
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, got {value!r}", "invalid_parameter", name)
    return value


def _prompt_name(fields: dict[str, Any], model: ModelInfo) -> str | None:
    value = fields.get("prompt_name")
    if value is None:
        return None
    if not isinstance(value, str) or value not in model.prompts:
        known = ", ".join(repr(name) for name in model.prompts) or "none"
        raise bad_request(f"'prompt_name' must name one of the model's prompts ({known}), got {value!r}",
                          "invalid_prompt_name", "prompt_name")
    return value


def _dimensions(value: Any, model: ModelInfo) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= model.dimension:
        raise bad_request(f"'dimensions' must be an integer from 1 to {model.dimension}, got {value!r}",
                          "invalid_dimensions", "dimensions")
    return value


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _inputs(value: Any, param: str, limits: RequestLimits, model: ModelInfo) -> tuple[Input, ...]:
    """The inputs of a string, a list of strings, a list of token ids or a list of token id lists."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(_is_id(v) for v in value):
        items = [value]  # one row of token ids
    elif isinstance(value, list):
        items = value
    else:
        raise bad_request(f"'{param}' must be a string or a list, got {type(value).__name__}", "invalid_input",
                          param)
    if not items:
        raise bad_request(f"'{param}' is empty: give at least one input", "empty_input", param)
    if len(items) > limits.max_inputs:
        raise bad_request(f"too many inputs: {len(items)}; the limit is {limits.max_inputs} per request",
                          "too_many_inputs", param)
    return tuple(_input(item, f"{param}[{index}]", model) for index, item in enumerate(items))


def _input(item: Any, param: str, model: ModelInfo) -> Input:
    if isinstance(item, str):
        if not item:
            raise bad_request(f"{param} is an empty string; every input needs text", "empty_input", param)
        try:
            item.encode("utf-8")
        except UnicodeEncodeError as exc:  # JSON's "\\ud800": a lone surrogate, which no tokenizer takes
            raise bad_request(f"{param} is not valid Unicode text: a lone surrogate {item[exc.start]!r} at character"
                              f" {exc.start}", "invalid_input", param) from None
        return item
    if not isinstance(item, list) or not all(_is_id(v) for v in item):
        raise bad_request(f"{param} must be a string or a list of token ids (integers)", "invalid_input", param)
    if not item:
        raise bad_request(f"{param} has no token ids; every input needs at least one", "empty_input", param)
    bad = next((v for v in item if not 0 <= v < model.vocab_size), None)
    if bad is not None:
        raise bad_request(f"{param} holds token id {bad}, outside the vocabulary [0, {model.vocab_size})",
                          "invalid_token_id", param)
    return tuple(item)
