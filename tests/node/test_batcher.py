"""The batcher: concurrent requests merged into one call, deduplicated across requests, each answered in full."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from attnstore.index import ExactIndex
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore
from attnstore_client.cache import AttnCache
from attnstore_client.connection.local import LocalConnection
from attnstore_node.batcher import Batcher
from attnstore_node.budget import MAX_TOKENS, MIN_TOKENS
from attnstore_node.errors import ApiError
from attnstore_node.queue import TicketQueue
from attnstore_node.settings import BatcherSettings
from tests.support.caches import fill_namespace, plain_hidden, sentences, tiny_loaded
from tests.support.wait import wait_until

TEXTS = sentences(12, seed=3)
STORED = TEXTS[:4]


@pytest.fixture(scope="module")
def bert():
    return tiny_loaded("bert")


def _batcher(bert, settings: BatcherSettings) -> Batcher:
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, bert, STORED)
    batcher = Batcher(lambda: AttnCache(bert, LocalConnection("local:memory", service)), "tiny", settings)
    batcher.start()
    return batcher


def _expected(bert, texts: list[str]) -> np.ndarray:
    return torch.stack([h.mean(dim=0) for h in plain_hidden(bert, texts)]).numpy()


async def _ready(batcher: Batcher) -> None:
    def loaded() -> bool:
        assert batcher.failure is None, f"the model failed to load: {batcher.failure!r}"
        return batcher.info is not None

    await asyncio.to_thread(wait_until, loaded, 60, "the batcher's model loaded")


async def _queued(batcher: Batcher, requests: int) -> None:
    """Once ``requests`` requests wait in the batcher's queue (the event loop runs meanwhile: it queues them)."""
    await asyncio.to_thread(wait_until, lambda: batcher._queue.waiting >= requests, 30, f"{requests} requests queued")


def test_concurrent_requests_are_one_call_and_each_gets_its_own_rows_deduplicated_across_requests(bert) -> None:
    batcher = _batcher(bert, BatcherSettings(max_wait_ms=300, warmup=False, max_batch_tokens=512))
    requests = [TEXTS[0:5], TEXTS[3:9], [TEXTS[8], TEXTS[1]], [[5, 6, 7, 8]]]

    async def scenario():
        await _ready(batcher)
        return await asyncio.gather(*(batcher.embed(r, truncate=True, max_input_tokens=64) for r in requests))

    try:
        answers = asyncio.run(scenario())
    finally:
        batcher.stop()  # the call may still be ending when its last request is answered
    stats = batcher.cache.last_stats
    assert batcher.calls == 1
    for request, answer in zip(requests[:3], answers[:3], strict=True):
        assert answer.vectors.shape == (len(request), 64)
        np.testing.assert_allclose(answer.vectors, _expected(bert, request), atol=2e-3)  # fp16 exact hits
        assert answer.tokens == sum(len(text.split()) for text in request)
    assert answers[3].tokens == 4
    assert stats.rows == 14
    assert stats.deduplicated == 4  # TEXTS[3], TEXTS[4], TEXTS[8] and TEXTS[1] came in two requests each
    assert stats.forwarded_tokens == stats.forward_tokens  # packed: nothing padded
    assert stats.exact_hits == 4


def test_a_request_waits_no_longer_than_max_wait_when_alone(bert) -> None:
    batcher = _batcher(bert, BatcherSettings(max_wait_ms=50, warmup=False))

    async def scenario():
        await _ready(batcher)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await batcher.embed([TEXTS[9]], truncate=True, max_input_tokens=64)
        return loop.time() - started

    try:
        assert asyncio.run(scenario()) < 1.0
    finally:
        batcher.stop()


def test_a_cancelled_request_is_taken_out_of_the_queue_and_never_computed(bert) -> None:
    batcher = _batcher(bert, BatcherSettings(max_wait_ms=400, warmup=False))

    async def scenario():
        await _ready(batcher)
        gone = asyncio.ensure_future(batcher.embed(TEXTS[6:10], truncate=True, max_input_tokens=64))
        kept = asyncio.ensure_future(batcher.embed([TEXTS[10]], truncate=True, max_input_tokens=64))
        await _queued(batcher, 2)  # both wait for others (400 ms): gone is cancelled while queued
        gone.cancel()
        return await kept

    try:
        answer = asyncio.run(scenario())
    finally:
        batcher.stop()
    stats = batcher.cache.last_stats
    freed = batcher.metrics.registry.get_sample_value("attnstore_node_freed_rows_total")
    assert answer.vectors.shape == (1, 64)
    assert (batcher.calls, stats.rows, freed) == (1, 1, 4)


def test_an_input_past_the_token_limit_is_refused_unless_truncation_is_asked(bert) -> None:
    batcher = _batcher(bert, BatcherSettings(max_wait_ms=1, warmup=False))

    async def scenario():
        await _ready(batcher)
        with pytest.raises(ApiError) as refused:
            await batcher.embed([TEXTS[0]], truncate=False, max_input_tokens=2)
        cut = await batcher.embed([TEXTS[0]], truncate=True, max_input_tokens=2)
        return refused.value, cut

    try:
        refused, cut = asyncio.run(scenario())
    finally:
        batcher.stop()
    assert (refused.status, refused.code) == (400, "context_length_exceeded")
    assert cut.tokens == 2
    np.testing.assert_allclose(cut.vectors, _expected(bert, [" ".join(TEXTS[0].split()[:2])]), atol=1e-4)


def test_requests_after_stop_are_refused_with_503(bert) -> None:
    batcher = _batcher(bert, BatcherSettings(warmup=False))
    stopper = threading.Thread(target=batcher.stop)

    async def scenario():
        await _ready(batcher)
        stopper.start()
        stopper.join()
        with pytest.raises(ApiError) as refused:
            await batcher.embed([TEXTS[0]], truncate=True, max_input_tokens=64)
        return refused.value

    assert asyncio.run(scenario()).status == 503


def test_a_model_that_cannot_load_is_reported_as_the_failure(bert) -> None:
    def broken() -> AttnCache:
        raise OSError("no such model")

    batcher = Batcher(broken, "tiny", BatcherSettings(warmup=False))
    batcher.start()
    batcher.stop()
    assert isinstance(batcher.failure, OSError)
    assert batcher.info is None


def test_the_warm_up_fits_the_forward_cost_before_the_first_request(bert) -> None:
    batcher = _batcher(bert, BatcherSettings(max_wait_ms=1))

    async def scenario():
        await _ready(batcher)
        return await batcher.embed([TEXTS[11]], truncate=True, max_input_tokens=64)

    try:
        asyncio.run(scenario())
    finally:
        batcher.stop()
    cost = batcher.cache.cost_model.forward_cost()
    assert cost is not None
    budget = batcher.metrics.registry.get_sample_value("attnstore_node_max_batch_tokens")
    assert budget is not None and MIN_TOKENS <= budget <= MAX_TOKENS  # chosen from the fit (the fallback without)


class _DyingCache(AttnCache):
    """A cache whose call ends the thread it runs on (what an escaped error did to the batcher)."""

    def run(self, *args, **kwargs):
        raise SystemExit("the batcher's thread ends")


def test_a_batcher_whose_thread_ends_answers_503_and_reports_its_fault(bert) -> None:
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, bert, STORED)
    batcher = Batcher(lambda: _DyingCache(bert, LocalConnection("local:memory", service)), "tiny",
                      BatcherSettings(max_wait_ms=1, warmup=False))
    batcher.start()

    async def scenario():
        await _ready(batcher)
        with pytest.raises(ApiError) as first:
            await batcher.embed([TEXTS[0]], truncate=True, max_input_tokens=64)
        with pytest.raises(ApiError) as later:
            await batcher.embed([TEXTS[1]], truncate=True, max_input_tokens=64)
        return first.value, later.value

    try:
        first, later = asyncio.run(scenario())
    finally:
        batcher.stop()
    assert (first.status, later.status) == (503, 503)
    assert isinstance(batcher.fault, SystemExit)
    assert batcher.metrics.registry.get_sample_value("attnstore_node_ready") == 0


def test_a_ticket_answers_only_once_every_row_is_written_and_a_row_written_twice_counts_once() -> None:
    from attnstore_node.batcher import Ticket
    from attnstore_node.tokenization import TokenizedRequest

    async def scenario() -> bool:
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        ticket = Ticket(TokenizedRequest(rows=((5, 6), (7,)), prompts=(0, 0), tokens=3), future)
        ticket.write(0, np.ones(4, np.float32))
        ticket.write(0, np.ones(4, np.float32))  # the same row again: row 1 is still open
        await asyncio.sleep(0)  # the loop runs what the writes scheduled first: an answer, were one due
        answered_early = future.done()
        ticket.write(1, np.zeros(4, np.float32))
        embedded = await asyncio.wait_for(future, 5)
        np.testing.assert_array_equal(embedded.vectors, [[1, 1, 1, 1], [0, 0, 0, 0]])
        return answered_early

    assert asyncio.run(scenario()) is False


def test_what_a_call_freed_goes_back_to_the_system_once_no_request_waits(
    bert, monkeypatch: pytest.MonkeyPatch
) -> None:
    trims: list[int] = []  # requests waiting at each trim
    takes: list[int] = []  # one per time the batcher's thread came back to the queue for a call's tickets

    class CountingTrimmer:
        def trim(self) -> bool:
            trims.append(batcher_queue_waiting())
            return True

    take = TicketQueue.take

    def counted_take(queue: TicketQueue, *args, **kwargs):
        takes.append(1)
        return take(queue, *args, **kwargs)

    monkeypatch.setattr("attnstore_node.batcher.HeapTrimmer", CountingTrimmer)
    monkeypatch.setattr(TicketQueue, "take", counted_take)
    batcher = _batcher(bert, BatcherSettings(max_wait_ms=20, warmup=False))

    def batcher_queue_waiting() -> int:
        return batcher._queue.waiting

    async def scenario():
        await _ready(batcher)
        for call, text in enumerate(TEXTS[:3], start=1):
            await batcher.embed([text], truncate=True, max_input_tokens=64)
            # A request's rows reach it before its call has ended (the trim comes last): the next request is
            # sent once the thread is back at the queue, so each call ends with nothing waiting. Sent at once,
            # it was queued before the call's end on a busy machine and that call rightly kept its heap.
            await asyncio.to_thread(wait_until, lambda call=call: len(takes) > call, 30,
                                    f"the batcher's thread back at the queue after call {call}", poll=0.001)

    try:
        asyncio.run(scenario())
    finally:
        batcher.stop()
    assert batcher.calls == 3 and trims == [0, 0, 0]


def test_a_request_that_would_queue_more_than_max_queued_rows_gets_429_and_the_others_their_rows(bert) -> None:
    batcher = _batcher(bert, BatcherSettings(max_wait_ms=400, warmup=False, max_queued_rows=5))

    async def scenario():
        await _ready(batcher)
        first = asyncio.ensure_future(batcher.embed(TEXTS[0:4], truncate=True, max_input_tokens=64))
        await _queued(batcher, 1)  # it waits 400 ms for others
        with pytest.raises(ApiError) as refused:
            await batcher.embed(TEXTS[4:6], truncate=True, max_input_tokens=64)  # 4 + 2 > 5
        fits = await batcher.embed([TEXTS[6]], truncate=True, max_input_tokens=64)  # 4 + 1
        return refused.value, await first, fits

    try:
        refused, first, fits = asyncio.run(scenario())
    finally:
        batcher.stop()
    assert (refused.status, refused.code) == (429, "overloaded")
    assert "4 rows are waiting and this request has 2" in str(refused) and "--max-queued-rows" in str(refused)
    np.testing.assert_allclose(first.vectors, _expected(bert, TEXTS[0:4]), atol=2e-3)
    np.testing.assert_allclose(fits.vectors, _expected(bert, [TEXTS[6]]), atol=2e-3)


def test_a_request_larger_than_max_queued_rows_is_taken_when_nothing_waits(bert) -> None:
    batcher = _batcher(bert, BatcherSettings(max_wait_ms=20, warmup=False, max_queued_rows=2))

    async def scenario():
        await _ready(batcher)
        return await batcher.embed(TEXTS[0:4], truncate=True, max_input_tokens=64)

    try:
        answer = asyncio.run(scenario())
    finally:
        batcher.stop()
    assert answer.vectors.shape == (4, 64)
