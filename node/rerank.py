"""Requests and answers of the node's rerank routes: text-embeddings-inference's, and the Cohere/Jina shape that
vLLM and Infinity copy.

- ``POST /rerank`` with ``texts`` (TEI): ``query``, ``texts``, ``raw_scores``
  (default false), ``return_text`` (default false), ``truncate`` (default false:
  a pair past the limit is refused; a decoder's prompt is refused either way, see
  below). The answer: a list of ``{index, score}`` (with ``text`` when asked),
  best first.
- ``POST /v1/rerank``, ``POST /v2/rerank`` and ``POST /rerank`` with
  ``documents`` (Cohere, Jina, vLLM): ``query``, ``documents`` (strings, or
  objects with a ``text``), ``top_n`` (default all), ``return_documents`` (default
  true, as vLLM and Jina; false on ``/v2/rerank``, as Cohere's v2), ``model``
  (optional; when given, the served model's name). The answer: ``{id, model,
  results: [{index, relevance_score, document?: {text}}], usage, meta}``, best
  first, ``top_n`` of them.

Our extension to both: ``instruction``, the reranker's instruction for this
query (a decoder's template's default otherwise).

Two kinds of model rerank. A cross-encoder of one label (``ModelInfo.classes``)
scores each (query, document) pair as ``CrossEncoder.rank`` does: its logit
through the model's activation (``raw_scores``: the logit), the pair tokenized as
``CrossEncoder`` tokenizes it. A decoder reranks each document by
``RerankTemplate``'s prompt (Qwen3-Reranker's by default) scored as
``/v1/score`` scores: the probability of "yes" over "yes" and "no"
(``raw_scores``: the log-odds, log P(yes) - log P(no)); its prompt keeps its
instruction and its answer turn whole, so a prompt past the limit is refused
(400 ``context_length_exceeded``) rather than cut. ``instruction`` is a decoder's
only.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from attnstore_client.rerank import RerankTemplate
from attnstore_node.errors import ApiError, bad_request
from attnstore_node.schema import ModelInfo, RequestLimits, _flag, _input, _object

_TEI_FIELDS = frozenset({"query", "texts", "raw_scores", "return_text", "truncate", "truncation_direction",
                         "instruction"})
_DOCUMENT_FIELDS = frozenset({"query", "documents", "top_n", "return_documents", "model", "instruction",
                              "max_chunks_per_doc", "rank_fields", "max_tokens_per_doc", "truncate_prompt_tokens"})
Shape = Literal["tei", "documents"]


@dataclass(frozen=True, slots=True)
class RerankRequest:
    """One validated rerank request."""

    shape: Shape  # TEI's answer (a list) or the Cohere/Jina one (an object with ``results``)
    query: str
    documents: tuple[str, ...]
    instruction: str | None = None  # None: the template's
    raw_scores: bool = False  # TEI: scores before the last activation
    return_text: bool = False  # the documents' texts in the answer
    top_n: int | None = None  # the best this many (None: all)
    truncate: bool = False  # TEI: a cross-encoder's pair past the limit is cut (else refused)


def parse_rerank(body: Any, limits: RequestLimits, model: ModelInfo, *, route: str) -> RerankRequest:
    """A rerank body of either shape, told apart by ``texts`` (TEI) or ``documents`` (Cohere/Jina); ``route``
    decides ``return_documents``'s default (false on ``/v2/rerank``, as Cohere's v2).

    Raises:
        ApiError: 400 for a malformed body, a missing or empty query or documents, a document that is not text,
            too many documents, a bad ``top_n``; 404 for another model; 400 when the model does not rerank.
    """
    if not model.decoder and len(model.classes) != 1:
        has = f"a classifier of {len(model.classes)} labels (use /predict)" if model.classes else "an embedding model"
        raise bad_request(f"{model.name!r} does not rerank: reranking needs a cross-encoder of one label or a decoder"
                          f" (a model with a language-model head); this one is {has}", "unsupported_model", "model")
    if isinstance(body, dict) and "texts" in body:
        fields = _object(body, _TEI_FIELDS)
        return RerankRequest("tei", _query(fields), _documents(fields.get("texts"), "texts", limits, model),
                             _instruction(fields, model), raw_scores=_flag(fields, "raw_scores", False),
                             return_text=_flag(fields, "return_text", False), truncate=_flag(fields, "truncate", False))
    fields = _object(body, _DOCUMENT_FIELDS)
    name = fields.get("model")
    if name is not None and name != model.name:
        raise ApiError(404, f"The model {name!r} does not exist; this node serves {model.name!r}", "model_not_found",
                       param="model")
    if "documents" not in fields:
        raise bad_request("'documents' (or TEI's 'texts') is required: the texts to rank against 'query'",
                          "missing_input", "documents")
    documents = _documents(fields["documents"], "documents", limits, model)
    top_n = fields.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise bad_request(f"'top_n' must be an integer >= 1, got {top_n!r}", "invalid_top_n", "top_n")
    # Cohere and vLLM cut a pair past the limit (max_tokens_per_doc, truncate_prompt_tokens), as CrossEncoder does.
    return RerankRequest("documents", _query(fields), documents, _instruction(fields, model),
                         return_text=_flag(fields, "return_documents", route != "/v2/rerank"), top_n=top_n,
                         truncate=True)


def prompts_of(request: RerankRequest, template: RerankTemplate) -> list[str]:
    """Each document's prompt, in the request's order."""
    return [template.prompt(request.query, document, request.instruction) for document in request.documents]


def decoder_scores(probabilities: np.ndarray, raw: bool) -> list[float]:
    """A decoder's document scores from its answer-word probabilities ``(n, 2)`` ("no", "yes"): P(yes), or
    (``raw``) the log-odds the two-way softmax turns into it."""
    yes, no = probabilities[:, 1].astype(np.float64), probabilities[:, 0].astype(np.float64)
    return [_log(p) - _log(q) for p, q in zip(yes, no, strict=True)] if raw else yes.tolist()


def rerank_response(scores: list[float], request: RerankRequest, tokens: int, model: str) -> Any:
    """The answer of ``request`` from each document's score, best first."""
    order = sorted(range(len(scores)), key=lambda index: -scores[index])
    if request.top_n is not None:
        order = order[: request.top_n]
    if request.shape == "tei":
        return [{"index": index, "score": scores[index],
                 **({"text": request.documents[index]} if request.return_text else {})} for index in order]
    results = [{"index": index, "relevance_score": scores[index],
                **({"document": {"text": request.documents[index]}} if request.return_text else {})}
               for index in order]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": tokens}}}


def _log(p: float) -> float:
    return math.log(p) if p > 0 else -math.inf


def _query(fields: dict[str, Any]) -> str:
    query = fields.get("query")
    if not isinstance(query, str) or not query:
        raise bad_request(f"'query' is required: a non-empty string, got {query!r:.60}", "invalid_input", "query")
    return query


def _instruction(fields: dict[str, Any], model: ModelInfo) -> str | None:
    value = fields.get("instruction")
    if value is not None and not isinstance(value, str):
        raise bad_request(f"'instruction' must be a string, got {type(value).__name__}", "invalid_input",
                          "instruction")
    if value is not None and not model.decoder:
        raise bad_request("'instruction' is a decoder reranker's; a cross-encoder scores the query and the document"
                          " alone", "invalid_input", "instruction")
    return value


def _documents(value: Any, param: str, limits: RequestLimits, model: ModelInfo) -> tuple[str, ...]:
    """The documents as texts: strings, or (Cohere, Jina) objects with a ``text``.

    Raises:
        ApiError: 400 for an empty list, too many, or a document that is not a non-empty text.
    """
    if not isinstance(value, list) or not value:
        raise bad_request(f"'{param}' must be a non-empty list of strings", "invalid_input", param)
    if len(value) > limits.max_inputs:
        raise bad_request(f"too many {param}: {len(value)}; the limit is {limits.max_inputs} per request",
                          "too_many_inputs", param)
    texts: list[str] = []
    for index, item in enumerate(value):
        text = item.get("text") if isinstance(item, dict) else item
        if not isinstance(text, str) or not text:
            raise bad_request(f"{param}[{index}] must be a non-empty string (or an object with a 'text'), got"
                              f" {item!r:.60}", "invalid_input", param)
        texts.append(str(_input(text, f"{param}[{index}]", model)))
    return tuple(texts)

