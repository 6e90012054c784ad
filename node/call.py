"""A batcher call's two ends for ``AttnCache.run``: its tickets' rows in, each served row pooled back into its ticket.

A call's rows are every ticket's rows in arrival order (``ArrivalRows``), so the
pipeline's deduplication of identical rows spans requests: a line sent by
several clients at once is served once, and earlier requests' rows go through
the tiers first. The call's sink (``TicketSink``, the library's ``Sink``: it
keeps which rows were received and refuses a copy of one not yet written) pools
each row as its tier or forward ends and writes the vector into the ticket that
sent it, and into every copy of it: a request is answered the moment its last
row is in, so one whose rows all hit the exact tiers does not wait for the
call's forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from attnstore_client.call.rows import HiddenRows
from attnstore_client.call.sinks import Sink
from attnstore_client.call.sources import TokenRows
from attnstore_node.ticket import Ticket

# Pools right-padded last hidden states (B, P, hidden), their mask (B, P) and the prompt tokens to leave out.
PromptPool = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


class ArrivalRows(TokenRows):
    """A call's rows in arrival order: earlier requests' rows go through the tiers first."""

    def order(self) -> np.ndarray:
        """See :meth:`RowSource.order`: as given."""
        return np.arange(len(self))


class TicketSink(Sink):
    """Pools a call's served rows and writes each into the ticket (and the row) it belongs to.

    Args:
        owners: per position of the call, its ticket and its row there.
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


def call_ends(tickets: Sequence[Ticket], pool: PromptPool) -> tuple[ArrivalRows, TicketSink]:
    """The rows and the sink of one call of ``tickets`` (in arrival order), pooled by ``pool``."""
    owners = [(ticket, index) for ticket in tickets for index in range(len(ticket.rows))]
    rows = [row for ticket in tickets for row in ticket.rows]
    prompts = [prompt for ticket in tickets for prompt in ticket.prompts]
    return ArrivalRows(rows), TicketSink(owners, prompts, pool)
