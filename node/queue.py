"""The queue: tickets waiting for a call, in arrival order, with their rows and tokens counted.

Requests reach it tokenized and held to their limits (``tokenization``), so
everything queued is ready to run. The batcher's thread takes a call's tickets
(``take``): it waits for a first ticket, then up to ``max_wait`` seconds for more,
or less once the tokens waiting fill a forward's token budget; a call takes
tickets in arrival order up to its row limit. A ticket whose client goes away
while queued is taken out (its rows are never computed); once its call has begun
it stays in it, so the requests its rows were shared with get them all.

Once stopped (``stop``, ``close``) the queue takes no new ticket; once ``max_rows`` rows wait it takes none
that would pass them (the node answers 429), so a burst's memory is bounded by the settings.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from attnstore_node.metrics import NodeMetrics
from attnstore_node.ticket import Ticket


class QueueFullError(Exception):
    """A ticket would take the rows waiting past the queue's limit (the node answers 429)."""


class TicketQueue:
    """Tickets waiting for the batcher's thread, safe to use from any thread.

    Args:
        metrics: where its length is shown and cancelled tickets are counted.
        max_rows: rows waiting at most (a ticket that would pass it is refused, unless the queue is empty).
    """

    def __init__(self, metrics: NodeMetrics, max_rows: int) -> None:
        self._metrics = metrics
        self._max_rows = max_rows
        self._cond = threading.Condition()
        self._tickets: deque[Ticket] = deque()
        self._rows = 0  # every queued ticket's rows
        self._tokens = 0  # and their tokens
        self._stopping = False

    @property
    def stopping(self) -> bool:
        """Whether the queue takes no new ticket (``stop`` or ``close`` was called)."""
        return self._stopping

    @property
    def waiting(self) -> int:
        """Tickets queued now."""
        with self._cond:
            return len(self._tickets)

    def put(self, ticket: Ticket) -> bool:
        """Queue ``ticket``; False (not queued) once the queue is stopping.

        Raises:
            QueueFullError: its rows would take the rows waiting past ``max_rows`` (a ticket alone always fits).
        """
        with self._cond:
            if self._stopping:
                return False
            if self._tickets and self._rows + len(ticket.rows) > self._max_rows:
                raise QueueFullError(f"{self._rows} rows are waiting and this request has {len(ticket.rows)}: more"
                                     f" than the {self._max_rows} this node queues (--max-queued-rows); retry later")
            self._tickets.append(ticket)
            self._count(ticket, +1)
            self._cond.notify()
            return True

    def cancel(self, ticket: Ticket) -> None:
        """``ticket``'s client went away: take it out of the queue if its call has not begun."""
        self._metrics.cancelled.inc()
        with self._cond:
            ticket.cancelled = True
            if ticket in self._tickets:
                self._tickets.remove(ticket)
                self._count(ticket, -1)
                self._metrics.freed_rows.inc(len(ticket.rows))

    def take(self, budget: int, max_wait: float, max_rows: int, *, idle: float | None = None) -> list[Ticket] | None:
        """The next call's tickets; None once stopping with nothing queued.

        Args:
            budget: a forward's tokens: once that many wait, the call begins without waiting longer.
            max_wait: seconds the first ticket waits for others to join its call.
            max_rows: rows per call at most (a first ticket of more rows is taken alone).
            idle: seconds to wait for a first ticket, then an empty list if none came (None: wait until one
                comes): the batcher's thread has other work while idle.
        """
        with self._cond:
            if idle is not None and not self._tickets and not self._stopping:
                if idle > 0:
                    self._cond.wait(idle)
                if not self._tickets and not self._stopping:
                    return []
            while not self._tickets and not self._stopping:
                self._cond.wait()
            if not self._tickets:
                return None
            deadline = self._tickets[0].arrived + max_wait
            while not self._stopping and self._tokens < budget:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            batch: list[Ticket] = []
            rows = 0
            while self._tickets and (not batch or rows + len(self._tickets[0].rows) <= max_rows):
                ticket = self._tickets.popleft()
                self._count(ticket, -1)
                batch.append(ticket)
                rows += len(ticket.rows)
            return batch

    def begin(self, batch: list[Ticket]) -> list[Ticket]:
        """The tickets of ``batch`` still wanted as their call begins; one cancelled from now on stays in the
        call (its rows may be another's)."""
        with self._cond:
            return [ticket for ticket in batch if not ticket.cancelled]

    def stop(self) -> None:
        """Take no new ticket; ``take`` hands out what is queued, then None."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def close(self) -> list[Ticket]:
        """Take no new ticket and hand back every queued one (for the caller to refuse)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            queued, self._tickets = list(self._tickets), deque()
            for ticket in queued:
                self._count(ticket, -1)
            return queued

    def _count(self, ticket: Ticket, sign: int) -> None:
        """Count ``ticket`` into (+1) or out of (-1) the queue; the caller holds the lock."""
        self._rows += sign * len(ticket.rows)
        self._tokens += sign * ticket.tokens
        self._metrics.queue_requests.set(len(self._tickets))
        self._metrics.queue_rows.set(self._rows)
