"""The batcher: concurrent requests merged into one ``AttnCache`` call, each answered as its own rows are done.

A request is tokenized and held to its limits before it is queued (``embed``,
through ``tokenization``): one refused is answered at once, and the queue holds
only requests ready to run, each with its own token rows. One thread takes them in
calls, one after another (an ``AttnCache`` runs one call at a time): a call
begins once its first request has waited ``max_wait_ms`` for others to join it,
or sooner once a forward's worth of tokens is waiting; while a call runs, the
next one forms. A call's rows are every request's rows in arrival order, so the
pipeline's deduplication of identical rows spans requests: a line sent by
several clients at once is served once. The call's sink routes each row, as its
tier or forward ends, to the request that sent it (and to every copy of it),
and a request is answered, on its event loop, the moment its last row is in:
one whose rows all hit the exact tiers does not wait for the call's forwards.

Forwards are packed (no padding) and cut under a token budget: ``max_batch_tokens``
when given, else chosen from the cost model's forward fit (``budget``), which the
node's warm-up seeds. A request whose client goes away before its call begins
is taken out of the queue: its rows are never computed; one whose call has begun
stays in it, so the requests its rows were shared with get them all.

A call that fails answers its open requests with a 500 and the thread serves the
next call. Should the thread itself end, every waiting request gets a 503 and so
does ``/health`` (``fault``): the node no longer serves.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
import torch

from attnstore_client.cache import AttnCache
from attnstore_client.call.rows import HiddenRows
from attnstore_client.call.sinks import Sink
from attnstore_client.call.sources import TokenRows
from attnstore_node.budget import batch_token_budget
from attnstore_node.engine import Embedded, Embedder
from attnstore_node.errors import ApiError
from attnstore_node.metrics import NodeMetrics
from attnstore_node.schema import Input, ModelInfo
from attnstore_node.settings import BatcherSettings
from attnstore_node.tokenization import RequestTokenizer, TokenizedRequest
from attnstore_node.warmup import warm_up

log = logging.getLogger(__name__)

# Pools right-padded last hidden states (B, P, hidden), their mask (B, P) and the prompt tokens to leave out.
PromptPool = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
# Weight of the latest call in the running mean row length the token budget is chosen for.
_LENGTH_WEIGHT = 0.2


class Ticket:
    """One request in the batcher: its token rows, then its vectors and its count of rows still open."""

    def __init__(self, request: TokenizedRequest, future: asyncio.Future[Embedded]) -> None:
        self.rows = request.rows
        self.prompts = request.prompts  # per row, the prompt tokens its pooling leaves out
        self.tokens = request.tokens
        self.future = future
        self.loop = future.get_loop()
        self.arrived = time.monotonic()
        self.cancelled = False
        self.vectors: np.ndarray | None = None  # (n, dim), allocated at its first row
        self._written = np.zeros(len(request.rows), dtype=bool)  # per row: its vector is in
        self.remaining = len(request.rows)

    def write(self, index: int, vector: np.ndarray) -> None:
        """Row ``index``'s vector is in; once every row's is, the request is answered (a row written twice
        counts once, so the answer never carries a row that was not written)."""
        if self.vectors is None:
            self.vectors = np.empty((len(self.rows), vector.shape[-1]), np.float32)
        self.vectors[index] = vector
        if self._written[index]:
            return
        self._written[index] = True
        self.remaining -= 1
        if self.remaining == 0:
            self._settle(Embedded(self.vectors, self.tokens), None)

    def reject(self, error: BaseException) -> None:
        """Answer the request with ``error``."""
        self.remaining = -1
        self._settle(None, error)

    def _settle(self, result: Embedded | None, error: BaseException | None) -> None:
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, result, error)
        except RuntimeError:
            pass  # its event loop is closed: nobody is waiting any more


def _settle(future: asyncio.Future[Embedded], result: Embedded | None, error: BaseException | None) -> None:
    if future.done():  # cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        assert result is not None
        future.set_result(result)


class _ArrivalRows(TokenRows):
    """A call's rows in arrival order: earlier requests' rows go through the tiers first."""

    def order(self) -> np.ndarray:
        return np.arange(len(self))


class _Routes(Sink):
    """Pools a call's served rows and writes each into the request (and the row) it belongs to.

    Args:
        owners: per position of the call, its request and its row there.
        prompts: per position, the prompt tokens its pooling leaves out.
        pool: the model's pooling.
    """

    def __init__(self, owners: Sequence[tuple[Ticket, int]], prompts: Sequence[int], pool: PromptPool) -> None:
        super().__init__(len(owners))
        self._owners = owners
        self._prompts = prompts
        self._pool = pool

    def _put(self, targets: Sequence[Sequence[int]], hidden: HiddenRows) -> None:
        tokens, mask = hidden.padded()  # (B, P, hidden), (B, P)
        prompts = [self._prompts[positions[0]] for positions in targets]
        pooled = np.empty((len(targets), 0), np.float32)
        for prompt in sorted(set(prompts)):
            rows = [r for r, length in enumerate(prompts) if length == prompt]
            picked = torch.tensor(rows, device=tokens.device)
            vectors = self._pool(tokens.index_select(0, picked), mask.index_select(0, picked), prompt)  # (b, dim)
            if pooled.shape[1] == 0:
                pooled = np.empty((len(targets), vectors.shape[1]), np.float32)
            pooled[rows] = vectors.float().cpu().numpy()
        for r, positions in enumerate(targets):
            for position in positions:
                ticket, index = self._owners[position]
                ticket.write(index, pooled[r])

    def _copy(self, source: int, target: int) -> None:
        ticket, index = self._owners[source]
        assert ticket.vectors is not None  # Sink.copy checked the source was received
        owner, row = self._owners[target]
        owner.write(row, ticket.vectors[index])


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
        self._cond = threading.Condition()
        self._queue: deque[Ticket] = deque()
        self._queued_rows = 0
        self._queued_tokens = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._info: ModelInfo | None = None
        self._tokenizer: RequestTokenizer | None = None
        self._failure: BaseException | None = None
        self._fault: BaseException | None = None
        self._mean_length = 32.0
        self.cache: AttnCache | None = None
        self.calls = 0  # calls run so far

    @property
    def info(self) -> ModelInfo | None:
        """See :meth:`Embedder.info`."""
        return self._info

    @property
    def failure(self) -> BaseException | None:
        """See :meth:`Embedder.failure`."""
        return self._failure

    @property
    def fault(self) -> BaseException | None:
        """See :meth:`Embedder.fault`: what ended the batcher's thread while the node served."""
        return self._fault

    def start(self) -> None:
        """See :meth:`Embedder.start`: the thread opens the cache, warms it up, then serves calls."""
        self._thread = threading.Thread(target=self._main, name="attnstore-node-batcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """See :meth:`Embedder.stop`: requests already queued are served first, then the cache is closed."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    async def embed(self, inputs: Sequence[Input], *, truncate: bool, max_input_tokens: int) -> Embedded:
        """See :meth:`Embedder.embed`: tokenized and held to its limits first, then queued."""
        tokenizer = self._tokenizer
        if tokenizer is None or self._unavailable():
            raise _unavailable()
        try:
            request = await tokenizer.submit(inputs, truncate=truncate, max_input_tokens=max_input_tokens)
        except RuntimeError:  # the tokenizer's thread was shut down: the node stops
            raise _unavailable() from None
        future: asyncio.Future[Embedded] = asyncio.get_running_loop().create_future()
        ticket = Ticket(request, future)
        with self._cond:
            if self._unavailable():
                raise _unavailable()
            self._queue.append(ticket)
            self._queued(ticket, +1)
            self._cond.notify()
        try:
            return await future
        except asyncio.CancelledError:
            self._cancel(ticket)
            raise

    def _unavailable(self) -> bool:
        return self._stopping or self._failure is not None or self._fault is not None

    # ---- the batcher's thread -------------------------------------------------

    def _main(self) -> None:
        try:
            cache = self.cache = self._open()
            if self.settings.warmup:
                warm_up(cache)
            vocab = int(cache.adapter.loaded.model.config.vocab_size)
            self._tokenizer = RequestTokenizer(cache)
            self._info = ModelInfo(self._name, int(cache.head.dimension), vocab, int(cache.head.max_length))
        except BaseException as exc:
            log.exception("event=load_failed model=%s", self._name)
            with self._cond:
                self._failure = exc
            self._reject_queued()
            return
        self.metrics.ready.set(1)
        try:
            while (batch := self._collect()) is not None:
                try:
                    self._run(cache, batch)
                except Exception:
                    log.exception("event=call_failed requests=%d", len(batch))
                    _reject_open(batch, ApiError(500, "the node failed to embed this request", "internal_error",
                                                 type="server_error"))
                except BaseException:
                    _reject_open(batch, _unavailable())
                    raise
        except BaseException as exc:
            log.critical("event=batcher_stopped error=%r: the node no longer serves; restart it", exc, exc_info=True)
            with self._cond:
                self._fault = exc  # logged, and reported by /health: the thread ends here
        finally:
            self.metrics.ready.set(0)
            self._reject_queued()
            if self._tokenizer is not None:
                self._tokenizer.close()
            cache.close()

    def _collect(self) -> list[Ticket] | None:
        """The next call's requests: waits for a first one, then up to ``max_wait_ms`` for more (less once a
        forward's worth of tokens waits); None once stopping with nothing queued."""
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if not self._queue:
                return None
            deadline = self._queue[0].arrived + self.settings.max_wait_ms / 1000.0
            budget = self._budget()
            while not self._stopping and self._queued_tokens < budget:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            batch: list[Ticket] = []
            rows = 0
            while self._queue and (not batch or rows + len(self._queue[0].rows) <= self.settings.max_call_rows):
                ticket = self._queue.popleft()
                self._queued(ticket, -1)
                batch.append(ticket)
                rows += len(ticket.rows)
            return batch

    def _run(self, cache: AttnCache, batch: list[Ticket]) -> None:
        started = time.monotonic()
        for ticket in batch:
            self.metrics.wait.observe(started - ticket.arrived)
        with self._cond:  # a request cancelled from here on stays in the call: its rows may be another's
            live = [ticket for ticket in batch if not ticket.cancelled]
        if not live:
            return
        owners = [(ticket, index) for ticket in live for index in range(len(ticket.rows))]
        rows = [row for ticket in live for row in ticket.rows]
        prompts = [prompt for ticket in live for prompt in ticket.prompts]
        budget = self._budget()
        self.metrics.max_batch_tokens.set(budget)
        try:
            stats = cache.run(_ArrivalRows(rows), _Routes(owners, prompts, cache.head.pool),
                              batch_size=self.settings.batch_size, max_batch_tokens=budget, show_progress_bar=False)
        except Exception:
            log.exception("event=call_failed requests=%d rows=%d", len(live), len(rows))
            _reject_open(live, ApiError(500, "the node failed to embed this request", "internal_error",
                                        type="server_error"))
            return
        self.calls += 1
        tokens = sum(len(row) for row in rows)
        self._mean_length += _LENGTH_WEIGHT * (tokens / len(rows) - self._mean_length)
        self.metrics.record_call(stats, len(live), tokens, time.monotonic() - started)
        # The call checked that every row was written (Sink.check); a request still open is a bug, answered loudly.
        _reject_open(live, ApiError(500, "the node did not compute every row of this request", "internal_error",
                                    type="server_error"))

    def _reject_queued(self) -> None:
        """Answer every queued request with a 503: the thread ends."""
        with self._cond:
            queued, self._queue = list(self._queue), deque()
            for ticket in queued:
                self._queued(ticket, -1)
        for ticket in queued:
            ticket.reject(_unavailable())

    # ---- bookkeeping ----------------------------------------------------------

    def _budget(self) -> int:
        if self.settings.max_batch_tokens is not None:
            return self.settings.max_batch_tokens
        cache = self.cache
        return batch_token_budget(None if cache is None else cache.cost_model.forward_cost(), self._mean_length)

    def _queued(self, ticket: Ticket, sign: int) -> None:
        """Count ``ticket`` into (+1) or out of (-1) the queue; the caller holds the lock."""
        self._queued_rows += sign * len(ticket.rows)
        self._queued_tokens += sign * ticket.tokens
        self.metrics.queue_requests.set(len(self._queue))
        self.metrics.queue_rows.set(self._queued_rows)

    def _cancel(self, ticket: Ticket) -> None:
        """The client went away: take its request out of the queue if its call has not begun."""
        self.metrics.cancelled.inc()
        with self._cond:
            ticket.cancelled = True
            if ticket in self._queue:
                self._queue.remove(ticket)
                self._queued(ticket, -1)
                self.metrics.freed_rows.inc(len(ticket.rows))


def _reject_open(tickets: Sequence[Ticket], error: ApiError) -> None:
    """Answer with ``error`` each of ``tickets`` still waiting for rows."""
    for ticket in tickets:
        if ticket.remaining > 0:
            ticket.reject(error)


def _unavailable() -> ApiError:
    return ApiError(503, "the node is not serving (loading, stopping or its batcher stopped); send the request to"
                    " another node", "unavailable", type="unavailable_error")
