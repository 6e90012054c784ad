"""The batcher: concurrent requests merged into one ``AttnCache`` call, each answered as its own rows are done.

The node's three parts, as text-embeddings-inference's router has them: a request
is tokenized and held to its limits before it is queued (``tokenization``), so one
refused is answered at once; the queue (``queue``) holds tickets ready to run with
their token counts; the batching loop here takes a call's tickets under a token
budget (``budget``), runs the call and hands each row back to its ticket as it is
served (``call``). One thread runs the calls, one after another (an ``AttnCache``
runs one call at a time): a call begins once its first request has waited
``max_wait_ms`` for others to join it, or sooner once a forward's worth of tokens
is waiting; while a call runs, the next one forms. The same thread loads the
model first (``model``).

Forwards are packed (no padding) and cut under the token budget:
``max_batch_tokens`` when given, else chosen from the cost model's forward fit,
which the node's warm-up seeds.

A call that fails answers its open requests with a 500 and the thread serves the
next call. Should the thread itself end, every waiting request gets a 503 and so
does ``/health`` (``fault``): the node no longer serves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from attnstore_client.cache import AttnCache
from attnstore_client.heap import HeapTrimmer
from attnstore_node.budget import TokenBudget
from attnstore_node.call import call_ends, distinct_tokens
from attnstore_node.engine import Embedded, Embedder
from attnstore_node.errors import ApiError
from attnstore_node.metrics import NodeMetrics
from attnstore_node.model import ServedModel, load_model
from attnstore_node.queue import QueueFullError, TicketQueue
from attnstore_node.schema import Activation, Input, ModelInfo
from attnstore_node.settings import BatcherSettings
from attnstore_node.ticket import Ticket, reject_open
from attnstore_node.tokenization import RequestTokenizer, TokenizedRequest
from attnstore_node.tokens import Token
from attnstore_node.warmup import IDLE_SECONDS, WarmUp

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class Batcher(Embedder):
    """Merges concurrent requests into ``AttnCache`` calls on one thread of its own.

    Args:
        open_cache: opens the ``AttnCache`` (on the batcher's thread, so a slow load never blocks the server).
        name: the model name requests give.
        settings: how requests are merged.
        metrics: where the queue and the calls are counted.
    """

    def __init__(
        self, open_cache: Callable[[], AttnCache], name: str, settings: BatcherSettings = BatcherSettings(),
        metrics: NodeMetrics | None = None,
    ) -> None:
        self._open = open_cache
        self._name = name
        self.settings = settings
        self.metrics = metrics if metrics is not None else NodeMetrics()
        self._queue = TicketQueue(self.metrics, settings.max_queued_rows)
        self._budget = TokenBudget(settings.max_batch_tokens)
        self._heap = HeapTrimmer()
        self._thread: threading.Thread | None = None
        self._model: ServedModel | None = None
        self._failure: BaseException | None = None
        self._fault: BaseException | None = None
        self.calls = 0  # calls run so far

    @property
    def info(self) -> ModelInfo | None:
        """See :meth:`Embedder.info`."""
        return None if self._model is None else self._model.info

    @property
    def cache(self) -> AttnCache | None:
        """The served model's cache once loaded (its ``last_stats`` and cost model), else None."""
        return None if self._model is None else self._model.cache

    @property
    def failure(self) -> BaseException | None:
        """See :meth:`Embedder.failure`."""
        return self._failure

    @property
    def fault(self) -> BaseException | None:
        """See :meth:`Embedder.fault`: what ended the batcher's thread while the node served."""
        return self._fault

    def start(self) -> None:
        """See :meth:`Embedder.start`: the thread loads the model (``model``), then serves calls."""
        self._thread = threading.Thread(target=self._main, name="attnstore-node-batcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """See :meth:`Embedder.stop`: requests already queued are served first, then the cache is closed."""
        self._queue.stop()
        if self._thread is not None:
            self._thread.join()

    async def embed(self, inputs: Sequence[Input], *, truncate: bool, max_input_tokens: int,
                    prompt_name: str | None = None) -> Embedded:
        """See :meth:`Embedder.embed`: tokenized and held to its limits first, then queued."""
        request = await self._tokenized(lambda tokenizer: tokenizer.submit(
            inputs, truncate=truncate, max_input_tokens=max_input_tokens, prompt_name=prompt_name))
        return await self._queued(request)

    async def score(self, prompts: Sequence[Input], labels: Sequence[int] | Sequence[str], *, softmax: bool,
                    max_input_tokens: int) -> Embedded:
        """See :meth:`Embedder.score`: tokenized and held to its limits first, then queued with the embeddings."""
        request = await self._tokenized(lambda tokenizer: tokenizer.submit_scoring(
            prompts, labels, softmax=softmax, max_input_tokens=max_input_tokens))
        return await self._queued(request)

    async def embed_all(self, inputs: Sequence[Input], *, truncate: bool, max_input_tokens: int,
                        prompt_name: str | None = None) -> Embedded:
        """See :meth:`Embedder.embed_all`: tokenized as :meth:`embed`'s, then queued with the others."""
        request = await self._tokenized(lambda tokenizer: tokenizer.submit(
            inputs, truncate=truncate, max_input_tokens=max_input_tokens, prompt_name=prompt_name))
        return await self._queued(dataclasses.replace(request, all_tokens=True))

    async def classify(self, inputs: Sequence[Input | tuple[str, str]], *, activation: Activation | None,
                       truncate: bool, max_input_tokens: int) -> Embedded:
        """See :meth:`Embedder.classify`: tokenized and held to its limits first, then queued with the others."""
        request = await self._tokenized(lambda tokenizer: tokenizer.submit_classify(
            inputs, activation, truncate=truncate, max_input_tokens=max_input_tokens))
        return await self._queued(request)

    async def tokenize(self, texts: Sequence[str], *, add_special_tokens: bool,
                       prompt_name: str | None = None) -> list[list[Token]]:
        """See :meth:`Embedder.tokenize`: on the request tokenizer's thread, never queued."""
        return await self._tokenized(lambda tokenizer: tokenizer.submit_tokens(
            texts, add_special_tokens=add_special_tokens, prompt_name=prompt_name))

    async def decode(self, rows: Sequence[Sequence[int]], *, skip_special_tokens: bool) -> list[str]:
        """See :meth:`Embedder.decode`: on the request tokenizer's thread, never queued."""
        return await self._tokenized(lambda tokenizer: tokenizer.submit_decode(
            rows, skip_special_tokens=skip_special_tokens))

    async def _tokenized(self, submit: Callable[[RequestTokenizer], Awaitable[_T]]) -> _T:
        """``submit``'s work on the served model's request tokenizer, while the node serves.

        Raises:
            ApiError: 503 while the model loads, once the node stops (its tokenizer's thread shut down) or after
                its batcher stopped; what ``submit`` raises otherwise.
        """
        model = self._serving()
        try:
            return await submit(model.tokenizer)
        except RuntimeError:  # the tokenizer's thread was shut down: the node stops
            raise _unavailable() from None

    def _serving(self) -> ServedModel:
        """The served model while the node serves.

        Raises:
            ApiError: 503 while it loads, stops or after it stopped.
        """
        model = self._model
        if model is None or self._unavailable():
            raise _unavailable()
        return model

    async def _queued(self, request: TokenizedRequest) -> Embedded:
        """``request`` queued, and its answer once its call served every row."""
        future: asyncio.Future[Embedded] = asyncio.get_running_loop().create_future()
        ticket = Ticket(request, future)
        try:
            queued = not self._unavailable() and self._queue.put(ticket)
        except QueueFullError as exc:
            raise ApiError(429, f"the node is overloaded: {exc}", "overloaded", type="server_error") from None
        if not queued:
            raise _unavailable()
        try:
            return await future
        except asyncio.CancelledError:
            self._queue.cancel(ticket)
            raise

    def _unavailable(self) -> bool:
        return self._queue.stopping or self._failure is not None or self._fault is not None

    # ---- the batcher's thread -------------------------------------------------

    def _main(self) -> None:
        try:
            model = self._model = load_model(self._open, self._name, warmup=self.settings.warmup)
        except BaseException as exc:
            log.exception("event=load_failed model=%s", self._name)
            self._failure = exc
            self._reject_queued()
            return
        self.metrics.ready.set(1)
        try:
            self._serve(model)
        except BaseException as exc:
            log.critical("event=batcher_stopped error=%r: the node no longer serves; restart it", exc, exc_info=True)
            self._fault = exc  # logged, and reported by /health: the thread ends here
        finally:
            self.metrics.ready.set(0)
            self._reject_queued()
            model.close()

    def _serve(self, model: ServedModel) -> None:
        """The batching loop: take a call's tickets under the token budget, run the call; until stopped. While
        the queue has been empty for ``IDLE_SECONDS`` it times the warm-up forwards left, one at a time."""
        cache, warmup = model.cache, model.warmup
        max_wait, max_rows = self.settings.max_wait_ms / 1000.0, self.settings.max_call_rows
        while True:
            budget = self._budget.tokens(cache.cost_model.forward_cost())
            warming = warmup is not None and not warmup.done
            batch = self._queue.take(budget, max_wait, max_rows, idle=IDLE_SECONDS if warming else None)
            if batch is None:
                return
            if not batch:
                warmup = self._warm_up_step(warmup)
                continue
            try:
                self._run(cache, batch, budget)
            except Exception:
                log.exception("event=call_failed requests=%d", len(batch))
                reject_open(batch, ApiError(500, "the node failed to answer this request", "internal_error",
                                            type="server_error"))
            except BaseException:
                reject_open(batch, _unavailable())
                raise
            if not self._queue.waiting:
                self._heap.trim()  # what the calls freed, back to the system while nothing waits (``heap``)

    @staticmethod
    def _warm_up_step(warmup: WarmUp | None) -> WarmUp | None:
        """One more warm-up forward; the warm-up given up (None) if it fails: the node serves on without it."""
        if warmup is None:
            return None
        try:
            warmup.step()
        except Exception:
            log.exception("event=warm_up_failed forwards=%d: serving on with the forwards timed so far",
                          warmup.forwards)
            return None
        return warmup

    def _run(self, cache: AttnCache, batch: list[Ticket], budget: int) -> None:
        """One call of ``batch``'s tickets, forwards of ``budget`` tokens at most; its rows go to their tickets as
        they are served."""
        started = time.monotonic()
        for ticket in batch:
            self.metrics.wait.observe(started - ticket.arrived)
        live = self._queue.begin(batch)
        if not live:
            return
        loaded = cache.adapter.loaded
        rows, sink = call_ends(live, cache.head.pool, loaded.lm_head, loaded.classifier)
        self.metrics.max_batch_tokens.set(budget)
        try:
            stats = cache.run(rows, sink, batch_size=self.settings.batch_size, max_batch_tokens=budget,
                              show_progress_bar=False)
        except Exception:
            log.exception("event=call_failed requests=%d rows=%d", len(live), len(rows))
            reject_open(live, ApiError(500, "the node failed to answer this request", "internal_error",
                                       type="server_error"))
            return
        self.calls += 1
        tokens = sum(ticket.tokens for ticket in live)
        self._budget.record(len(rows), tokens)
        self.metrics.distinct_tokens.inc(distinct_tokens([row for ticket in live for row in ticket.rows]))
        self.metrics.record_call(stats, len(live), tokens, time.monotonic() - started)  # last: counts the requests
        # The call checked that every row was written (Sink.check); a request still open is a bug, answered loudly.
        reject_open(live, ApiError(500, "the node did not compute every row of this request", "internal_error",
                                   type="server_error"))

    def _reject_queued(self) -> None:
        """Answer every queued request with a 503 and take no more: the thread ends."""
        for ticket in self._queue.close():
            ticket.reject(_unavailable())


def _unavailable() -> ApiError:
    return ApiError(503, "the node is not serving (loading, stopping or its batcher stopped); send the request to"
                    " another node", "unavailable", type="unavailable_error")
