"""The node's HTTP routes (an ASGI app on Starlette): embeddings in OpenAI's and TEI's schemas, decoder scoring in
SGLang's and vLLM's, reranking in TEI's and Cohere's, TEI's tokenizer routes, health, metrics.

- ``POST /v1/embeddings`` (OpenAI), ``POST /embed`` (text-embeddings-inference),
  ``POST /v1/score`` (SGLang), ``POST /v1/classify`` (vLLM; ``scoring``),
  ``POST /rerank`` (TEI's, or vLLM's and Jina's with ``documents``),
  ``POST /v1/rerank`` and ``POST /v2/rerank`` (Cohere's; ``rerank``),
  ``POST /predict`` (TEI's) and ``POST /score`` (vLLM's pairs) for a
  cross-encoder (``predict``), ``POST /`` and ``POST /invocations`` (TEI's and
  SageMaker's: what the model does, as TEI routes them: ``/embed`` for an
  embedding model, ``/rerank`` for a reranker, ``/predict`` for a classifier),
  ``POST /embed_all`` (TEI's: every token's embedding), ``POST /tokenize``, ``POST /decode``, ``GET /info`` (TEI's;
  ``tokens``), ``GET /v1/models``: need an API key when the node has a key file
  (``Authorization: Bearer KEY``);
- ``GET /health`` (and ``GET /``, as TEI's): 200 once the model is loaded, 503
  while it loads or the node drains; the store does not count (an unreachable
  store only means every row is computed);
- ``GET /metrics``: Prometheus text (``metrics``).

Every refusal is an OpenAI-style JSON error (``errors``) with its 4xx status,
unknown paths (404) and wrong methods (405) included, counted in
``requests_total``; nothing is computed for it. A request body is read up to the
byte limit and no further, and within ``read_timeout`` seconds (else 408; the
server bounds the headers the same way). A client that disconnects while its body
is read is counted as 499, without a traceback; while a request waits for its
vectors the app watches its connection: a client that disconnects has its
request cancelled, which takes its rows out of the batcher's queue if its call
has not begun.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from attnstore_client.rerank import RerankTemplate
from attnstore_node.auth import KeyCheck
from attnstore_node.engine import Embedded, Embedder
from attnstore_node.errors import ApiError, bad_request
from attnstore_node.metrics import CONTENT_TYPE, OTHER_ROUTE, NodeMetrics
from attnstore_node.predict import pair_score_response, parse_pair_score, parse_predict, predict_response
from attnstore_node.rerank import decoder_scores, parse_rerank, prompts_of, rerank_response
from attnstore_node.schema import (
    EmbedRequest,
    ModelInfo,
    RequestLimits,
    openai_response,
    parse_embed_all,
    parse_openai,
    parse_tei,
    tei_response,
)
from attnstore_node.scoring import classify_response, parse_classify, parse_score, score_response
from attnstore_node.tokens import info_response, parse_decode, parse_tokenize

log = logging.getLogger(__name__)

# HTTP status nginx logs for a client that closed its connection before the answer: what the metrics count it as.
CLIENT_CLOSED = 499
REQUEST_TIMEOUT = 408


class NodeState:
    """What the routes share: the embedder, the keys, the limits, the metrics, and whether the node drains."""

    def __init__(self, embedder: Embedder, keys: KeyCheck, limits: RequestLimits, metrics: NodeMetrics,
                 labels: tuple[str, ...] | None = None, reranker: RerankTemplate = RerankTemplate()) -> None:
        self.embedder = embedder
        self.labels = labels  # ``/v1/classify``'s labels when a request names none
        self.reranker = reranker  # a decoder's rerank prompt
        self.keys = keys
        self.limits = limits
        self.metrics = metrics
        self.draining = False


def create_app(embedder: Embedder, *, keys: KeyCheck | None = None, limits: RequestLimits = RequestLimits(),
               metrics: NodeMetrics | None = None, labels: tuple[str, ...] | None = None,
               reranker: RerankTemplate = RerankTemplate()) -> Starlette:
    """The node's ASGI app around ``embedder``, which it starts and stops with its lifespan.

    Args:
        embedder: what computes the vectors (the batcher, or a benchmark's baseline).
        keys: the API keys (None: none needed).
        limits: what one request may ask for.
        metrics: the node's metrics (the batcher's, so that ``/metrics`` shows both).
        labels: ``/v1/classify``'s labels when a request gives none (words of one token each; None: requests
            must give them).
        reranker: a decoder's rerank prompt and answer words (Qwen3-Reranker's by default).
    """
    state = NodeState(embedder, keys or KeyCheck(None), limits, metrics or NodeMetrics(),
                      None if labels is None else tuple(labels), reranker)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        embedder.start()
        try:
            yield
        finally:
            state.draining = True
            await asyncio.to_thread(embedder.stop)

    routes = [
        Route("/v1/embeddings", _served_route(state, "/v1/embeddings",
                                              _embedding_work(state, parse_openai, _openai_answer)), methods=["POST"]),
        Route("/embed", _served_route(state, "/embed", _embedding_work(state, parse_tei, _tei_answer)),
              methods=["POST"]),
        Route("/v1/score", _served_route(state, "/v1/score", _scoring_work(state, classify=False)), methods=["POST"]),
        Route("/v1/classify", _served_route(state, "/v1/classify", _scoring_work(state, classify=True)),
              methods=["POST"]),
        *(Route(path, _served_route(state, path, _rerank_work(state, path)), methods=["POST"])
          for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
        *(Route(path, _served_route(state, path, _root_work(state, path)), methods=["POST"])
          for path in ("/", "/invocations")),
        Route("/embed_all", _served_route(state, "/embed_all", _embed_all_work(state)), methods=["POST"]),
        Route("/predict", _served_route(state, "/predict", _predict_work(state)), methods=["POST"]),
        Route("/score", _served_route(state, "/score", _pair_score_work(state)), methods=["POST"]),
        Route("/tokenize", _served_route(state, "/tokenize", _tokenize_work(state)), methods=["POST"]),
        Route("/decode", _served_route(state, "/decode", _decode_work(state)), methods=["POST"]),
        Route("/info", _info_route(state), methods=["GET"]),
        Route("/v1/models", _models_route(state), methods=["GET"]),
        Route("/health", _health_route(state), methods=["GET"]),
        Route("/", _health_route(state), methods=["GET"]),
        Route("/metrics", _metrics_route(state), methods=["GET"]),
    ]
    paths = {route.path for route in routes}

    async def http_error(request: Request, exc: Exception) -> Response:
        """Starlette's own 404 (no such path) and 405 (a method the route does not take), as JSON and counted."""
        assert isinstance(exc, HTTPException)
        route = request.url.path if request.url.path in paths else OTHER_ROUTE
        state.metrics.requests.labels(route, str(exc.status_code)).inc()
        if exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow")
            error = ApiError(405, f"{request.method} is not allowed on {route}; allowed: {allowed}",
                             "method_not_allowed")
        else:
            error = ApiError(exc.status_code, f"no route {request.url.path!r}; the routes are {sorted(paths)}",
                             "not_found" if exc.status_code == 404 else "http_error")
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.node = state
    return app


Parse = Callable[[Any, RequestLimits, ModelInfo], EmbedRequest]
Answer = Callable[[Embedded, EmbedRequest, ModelInfo], Any]


def _openai_answer(embedded: Embedded, request: EmbedRequest, model: ModelInfo) -> Any:
    return openai_response(embedded.vectors, request, embedded.tokens, model.name)


def _tei_answer(embedded: Embedded, request: EmbedRequest, model: ModelInfo) -> Any:
    return tei_response(embedded.vectors, request)


def _error(error: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    if error.status == REQUEST_TIMEOUT:  # the rest of a body that came too slowly is not read: close
        headers = {"Connection": "close"}
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _ready_model(state: NodeState) -> ModelInfo:
    """The served model, once loaded. A node that drains still serves the requests its open connections bring
    (it accepts no new connection); only ``/health`` tells balancers to stop sending.

    Raises:
        ApiError: 503 while the model loads.
    """
    info = state.embedder.info
    if info is None:
        raise ApiError(503, "the node is loading its model; try again shortly", "unavailable",
                       type="unavailable_error")
    if state.embedder.fault is not None:
        raise ApiError(503, f"the node's batcher stopped ({state.embedder.fault!r}); restart the node",
                       "batcher_stopped", type="unavailable_error")
    return info


# A route's work once the key, the model and the body are in: its answer and its count of inputs, or None when
# the client went away meanwhile.
Work = Callable[[Request, Any, ModelInfo], Awaitable[tuple[Any, int] | None]]


def _embedding_work(state: NodeState, parse: Parse, answer: Answer) -> Work:
    async def work(request: Request, body: Any, model: ModelInfo) -> tuple[Any, int] | None:
        parsed = parse(body, state.limits, model)
        embedded = await _until_disconnect(request, state.embedder.embed(
            parsed.inputs, truncate=parsed.truncate, max_input_tokens=state.limits.max_input_tokens,
            prompt_name=parsed.prompt_name))
        if embedded is None:
            return None
        return answer(embedded, parsed, model), len(parsed.inputs)

    return work


def _scoring_work(state: NodeState, *, classify: bool) -> Work:
    async def work(request: Request, body: Any, model: ModelInfo) -> tuple[Any, int] | None:
        if classify:
            parsed = parse_classify(body, state.limits, model, state.labels)
        else:
            parsed = parse_score(body, state.limits, model)
        scored = await _until_disconnect(request, state.embedder.score(
            parsed.prompts, parsed.labels, softmax=parsed.softmax, max_input_tokens=state.limits.max_input_tokens))
        if scored is None:
            return None
        if classify:
            words = tuple(str(label) for label in parsed.labels)
            return classify_response(scored.vectors, words, scored.tokens, model.name), len(parsed.prompts)
        return score_response(scored.vectors, scored.tokens, model.name), len(parsed.prompts)

    return work


def _rerank_work(state: NodeState, route: str) -> Work:
    async def work(request: Request, body: Any, model: ModelInfo) -> tuple[Any, int] | None:
        parsed = parse_rerank(body, state.limits, model, route=route)
        limit = state.limits.max_input_tokens
        if model.classes:  # a cross-encoder: each (query, document) pair through its head
            pairs = [(parsed.query, document) for document in parsed.documents]
            scored = await _until_disconnect(request, state.embedder.classify(
                pairs, activation=None if parsed.raw_scores else "model", truncate=parsed.truncate,
                max_input_tokens=limit))
            if scored is None:
                return None
            scores = scored.vectors[:, 0].astype(float).tolist()
        else:  # a decoder: each document's prompt, scored by its answer words
            template = state.reranker
            scored = await _until_disconnect(request, state.embedder.score(
                prompts_of(parsed, template), template.labels, softmax=True, max_input_tokens=limit))
            if scored is None:
                return None
            scores = decoder_scores(scored.vectors, parsed.raw_scores)
        return rerank_response(scores, parsed, scored.tokens, model.name), len(parsed.documents)

    return work


def _predict_work(state: NodeState) -> Work:
    async def work(request: Request, body: Any, model: ModelInfo) -> tuple[Any, int] | None:
        parsed = parse_predict(body, state.limits, model)
        scored = await _until_disconnect(request, state.embedder.classify(
            parsed.inputs, activation=None if parsed.raw_scores else "tei", truncate=parsed.truncate,
            max_input_tokens=state.limits.max_input_tokens))
        if scored is None:
            return None
        return predict_response(scored.vectors, parsed, model.classes), len(parsed.inputs)

    return work


def _pair_score_work(state: NodeState) -> Work:
    async def work(request: Request, body: Any, model: ModelInfo) -> tuple[Any, int] | None:
        parsed = parse_pair_score(body, state.limits, model)
        scored = await _until_disconnect(request, state.embedder.classify(
            parsed.pairs, activation="model", truncate=True, max_input_tokens=state.limits.max_input_tokens))
        if scored is None:
            return None
        return pair_score_response(scored.vectors, scored.tokens, model.name), len(parsed.pairs)

    return work


def root_route(model: ModelInfo) -> str:
    """What the model's ``POST /`` does, as TEI routes it: ``"rerank"`` for a reranker (a cross-encoder of one
    label, or a decoder), ``"predict"`` for a classifier (a cross-encoder of several labels), ``"embed"`` for an
    embedding model."""
    if model.classes:
        return "rerank" if len(model.classes) == 1 else "predict"
    return "rerank" if model.decoder else "embed"


def _root_work(state: NodeState, route: str) -> Work:
    """TEI's ``POST /`` (and SageMaker's ``/invocations``): the model's own route's work."""
    works = {"embed": _embedding_work(state, parse_tei, _tei_answer), "rerank": _rerank_work(state, route),
             "predict": _predict_work(state)}

    async def work(request: Request, body: Any, model: ModelInfo) -> tuple[Any, int] | None:
        return await works[root_route(model)](request, body, model)

    return work


def _embed_all_work(state: NodeState) -> Work:
    async def work(request: Request, body: Any, model: ModelInfo) -> tuple[Any, int] | None:
        parsed = parse_embed_all(body, state.limits, model)
        embedded = await _until_disconnect(request, state.embedder.embed_all(
            parsed.inputs, truncate=parsed.truncate, max_input_tokens=state.limits.max_input_tokens,
            prompt_name=parsed.prompt_name))
        if embedded is None:
            return None
        return [row.tolist() for row in embedded.rows], len(parsed.inputs)

    return work


def _tokenize_work(state: NodeState) -> Work:
    async def work(request: Request, body: Any, model: ModelInfo) -> tuple[Any, int] | None:
        parsed = parse_tokenize(body, state.limits, model)
        rows = await state.embedder.tokenize(parsed.texts, add_special_tokens=parsed.add_special_tokens,
                                             prompt_name=parsed.prompt_name)
        return [[token.as_json() for token in row] for row in rows], len(parsed.texts)

    return work


def _decode_work(state: NodeState) -> Work:
    async def work(request: Request, body: Any, model: ModelInfo) -> tuple[Any, int] | None:
        parsed = parse_decode(body, state.limits, model)
        texts = await state.embedder.decode(parsed.rows, skip_special_tokens=parsed.skip_special_tokens)
        return texts, len(parsed.rows)

    return work


def _served_route(state: NodeState, route: str, work: Work) -> Callable[[Request], Awaitable[Response]]:
    """A route that computes: key checked, model ready, body read, then ``work``; every outcome counted."""

    async def endpoint(request: Request) -> Response:
        started = time.perf_counter()
        status = 500
        try:
            state.keys.check(request.headers.get("authorization"))
            model = _ready_model(state)
            body = await _json_body(request, state.limits.max_body_bytes, state.limits.read_timeout)
            done = await work(request, body, model)
            if done is None:
                status = CLIENT_CLOSED
                return Response(status_code=CLIENT_CLOSED)
            answer, inputs = done
            state.metrics.inputs.inc(inputs)
            status = 200
            return JSONResponse(answer)
        except ApiError as error:
            status = error.status
            return _error(error)
        except ClientDisconnect:
            status = CLIENT_CLOSED
            log.info("event=client_disconnected route=%s while=reading_body", route)
            return Response(status_code=CLIENT_CLOSED)
        except Exception:
            log.exception("event=request_failed route=%s", route)
            return _error(ApiError(500, "the node failed to answer", "internal_error", type="server_error"))
        finally:
            state.metrics.requests.labels(route, str(status)).inc()
            state.metrics.latency.labels(route).observe(time.perf_counter() - started)

    return endpoint


async def _json_body(request: Request, limit: int, timeout: float) -> Any:
    """The request's JSON body, read up to ``limit`` bytes within ``timeout`` seconds.

    Raises:
        ApiError: 413 past the limit, 415 when not JSON, 400 when the JSON does not parse (or nests too deep),
            408 when the body is not in within ``timeout``.
        ClientDisconnect: the client went away before the body was in.
    """
    content_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise ApiError(415, f"the body must be application/json, got {content_type!r}", "unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body has {declared} bytes; the limit is {limit}", "body_too_large")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for piece in request.stream():
                body += piece
                if len(body) > limit:
                    raise ApiError(413, f"the body is over the limit of {limit} bytes", "body_too_large")
    except TimeoutError:
        raise ApiError(REQUEST_TIMEOUT, f"the body did not arrive within {timeout:g} s ({len(body)} bytes came)",
                       "request_timeout") from None
    try:
        return json.loads(body)
    except ValueError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", "invalid_json") from None
    except RecursionError:
        raise bad_request("the body is not valid JSON here: it nests arrays or objects too deep",
                          "invalid_json") from None


async def _until_disconnect(request: Request, work: Awaitable[Embedded]) -> Embedded | None:
    """``work``'s result, or None (``work`` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the body was read: the next ASGI message can only say so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _models_route(state: NodeState) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            state.keys.check(request.headers.get("authorization"))
            model = _ready_model(state)
        except ApiError as error:
            return _error(error)
        return JSONResponse({"object": "list", "data": [
            {"id": model.name, "object": "model", "created": 0, "owned_by": "attnstore", "tiers": list(model.tiers),
             "absent_tiers": dict(model.absent_tiers), "prompts": list(model.prompts)}]})

    return endpoint


def _info_route(state: NodeState) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            state.keys.check(request.headers.get("authorization"))
            model = _ready_model(state)
        except ApiError as error:
            return _error(error)
        return JSONResponse(info_response(model, state.limits, root_route(model)))

    return endpoint


def _health_route(state: NodeState) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            model = _ready_model(state)
            if state.draining:
                raise ApiError(503, "the node drains before it stops", "draining", type="unavailable_error")
        except ApiError as error:
            return _error(error)
        return JSONResponse({"status": "ok", "model": model.name})

    return endpoint


def _metrics_route(state: NodeState) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return endpoint
