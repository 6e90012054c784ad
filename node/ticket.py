"""A ticket: one request from the moment it is queued until it is answered, on its own event loop.

A ticket holds the request's token rows (tokenized and held to its limits before
it is queued, ``tokenization``) and, as its call serves them, their vectors: the
pooled embeddings, or for a scoring request its label probabilities. The
batcher's thread writes the vectors; the request is answered on its event loop
the moment its last row is in, or refused with an error at any time before.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import numpy as np

from attnstore_node.engine import Embedded
from attnstore_node.errors import ApiError
from attnstore_node.tokenization import TokenizedRequest


class Ticket:
    """One request in the batcher: its token rows, then its vectors and its count of rows still open."""

    def __init__(self, request: TokenizedRequest, future: asyncio.Future[Embedded]) -> None:
        self.rows = request.rows
        # Per row, its segments' token counts where its prompt came in segments (the chunk tier's), else ().
        self.segments = request.segments or ((),) * len(request.rows)
        self.prompts = request.prompts  # per row, the prompt tokens its pooling leaves out
        self.labels = request.labels  # a scoring request's label token ids (None: rows are pooled)
        self.softmax = request.softmax
        self.classify = request.classify  # a cross-encoder request: its rows' classifier scores
        self.activation = request.activation
        # Per row, its token types where it is a text pair of a model with token types, else ().
        self.token_types = request.token_types or ((),) * len(request.rows)
        self.all_tokens = request.all_tokens  # ``/embed_all``: each row's token embeddings (``token_rows``)
        self.token_rows: list[np.ndarray | None] = [None] * len(request.rows) if request.all_tokens else []
        self.tokens = request.tokens
        self.future = future
        self.loop = future.get_loop()
        self.arrived = time.monotonic()
        self.cancelled = False  # its client went away (set under the queue's lock)
        self.vectors: np.ndarray | None = None  # (n, dim), allocated at its first row
        self._written = np.zeros(len(request.rows), dtype=bool)  # per row: its vector is in
        self.remaining = len(request.rows)

    def write(self, index: int, vector: np.ndarray) -> None:
        """Row ``index``'s vector is in; once every row's is, the request is answered (a row written twice
        counts once, so the answer never carries a row that was not written)."""
        if self.all_tokens:
            self.token_rows[index] = vector  # (L, hidden)
        else:
            if self.vectors is None:
                self.vectors = np.empty((len(self.rows), vector.shape[-1]), np.float32)
            self.vectors[index] = vector
        if self._written[index]:
            return
        self._written[index] = True
        self.remaining -= 1
        if self.remaining == 0:
            if self.all_tokens:
                rows = tuple(row for row in self.token_rows if row is not None)
                self._settle(Embedded(np.empty((len(rows), 0), np.float32), self.tokens, rows), None)
            else:
                assert self.vectors is not None
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


def reject_open(tickets: Sequence[Ticket], error: ApiError) -> None:
    """Answer with ``error`` each of ``tickets`` still waiting for rows."""
    for ticket in tickets:
        if ticket.remaining > 0:
            ticket.reject(error)


def _settle(future: asyncio.Future[Embedded], result: Embedded | None, error: BaseException | None) -> None:
    if future.done():  # cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        assert result is not None
        future.set_result(result)
