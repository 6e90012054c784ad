"""A batcher call's two ends for ``AttnCache.run``: its tickets' rows in, each served row pooled back into its ticket.

A call's rows are every ticket's rows in arrival order (``ArrivalRows``), so the
pipeline's deduplication of identical rows spans requests: a line sent by
several clients at once is served once, and earlier requests' rows go through
the tiers first. A scoring row whose prompt came in segments carries its
segments' token counts, for the chunk tier (the same tokens cut otherwise, or
given whole, are another row: the pipeline keys rows by both when the chunk
tier is on, and so does the sink). The call's sink (``TicketSink``, the
library's ``Sink``: it keeps which rows were received and refuses a copy of one
not yet written) pools each row as its tier or forward ends (or, for a scoring
request, runs its last state through the LM head over its labels) and writes the
vector into the ticket that sent it, and into every copy of it, whichever kind of
request the copy is: a request is answered the moment its last row is in, so one
whose rows all hit the exact tiers does not wait for the call's forwards.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from attnstore_client.call.rows import HiddenRows, last_positions
from attnstore_client.call.sinks import Sink
from attnstore_client.call.sources import RowSource, Tokenized
from attnstore_client.choices import label_probabilities
from attnstore_client.classifier import SequenceClassifier
from attnstore_client.sentence.cross_encoder import default_activation
from attnstore_node.schema import Activation
from attnstore_node.ticket import Ticket

# Pools right-padded last hidden states (B, P, hidden), their mask (B, P) and the prompt tokens to leave out.
PromptPool = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


class ArrivalRows(RowSource):
    """A call's rows in arrival order (earlier requests' rows go through the tiers first), each with its segments'
    token counts where its prompt came in segments."""

    def __init__(self, rows: Sequence[Tokenized]) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def order(self) -> np.ndarray:
        """See :meth:`RowSource.order`: as given."""
        return np.arange(len(self))

    def tokens(self, positions: Sequence[int]) -> list[Tokenized]:
        """See :meth:`RowSource.tokens`."""
        return [self._rows[position] for position in positions]


# What a row's result is: its pooled embedding (with its prompt length), its label probabilities, or its classifier
# scores (with how its logits are activated, None: left as logits).
RowResult = tuple[str, int] | tuple[str, tuple[int, ...], bool] | tuple[str, Activation | None]


class TicketSink(Sink):
    """Reduces a call's served rows and writes each into the ticket (and the row) it belongs to.

    An embedding row is pooled; a scoring row's last state goes through the LM head over its labels
    (``choices.label_probabilities``, fp32); a cross-encoder row's states through the model's classifier head
    (``classifier.SequenceClassifier``), then its activation. Identical rows of the call are served once: each
    served row's results are kept by its tokens and segments, one per kind that any of its copies asks for, for
    the copies to read.

    Args:
        owners: per position of the call, its ticket and its row there.
        rows: per position, its tokens (and segments' token counts).
        pool: the model's pooling.
        lm_head: the decoder's output head (None: an encoder, which no scoring request reaches).
        classifier: a cross-encoder's head (None: no classifying request reaches this model).
    """

    # The chunk tier may hand over only the last tokens' states of a row in segments: such a row is always a scoring
    # row (only ``/v1/score`` and ``/v1/classify`` take segments), which reads its last state alone. Embedding rows
    # never come in segments, so they always arrive whole.
    last_only: ClassVar[bool] = True

    def __init__(self, owners: Sequence[tuple[Ticket, int]], rows: Sequence[Tokenized], pool: PromptPool,
                 lm_head: nn.Module | None = None, classifier: SequenceClassifier | None = None) -> None:
        super().__init__(len(owners))
        self._owners = owners
        self._rows = rows
        self._pool = pool
        self._lm_head = lm_head
        self._classifier = classifier
        self._results: dict[Tokenized, dict[RowResult, np.ndarray]] = {}  # by row: what was served
        self._needs: dict[Tokenized, set[RowResult]] = {}  # by row: what its positions ask for
        for position, row in enumerate(rows):
            self._needs.setdefault(row, set()).add(self._kind(position))

    def _kind(self, position: int) -> RowResult:
        ticket, index = self._owners[position]
        if ticket.all_tokens:
            return ("tokens", 0)
        if ticket.classify:
            return ("classify", ticket.activation)
        if ticket.labels is None:
            return ("pool", ticket.prompts[index])
        return ("labels", ticket.labels, ticket.softmax)

    def _put(self, targets: Sequence[Sequence[int]], hidden: HiddenRows) -> None:
        tokens, mask = hidden.padded()  # (B, P, hidden), (B, P)
        jobs: dict[RowResult, list[int]] = {}
        for r, positions in enumerate(targets):
            for kind in self._needs[self._rows[positions[0]]]:
                jobs.setdefault(kind, []).append(r)
        results: list[dict[RowResult, np.ndarray]] = [{} for _ in targets]
        for kind, rows in jobs.items():
            picked = torch.tensor(rows, device=tokens.device)
            if kind[0] == "tokens":  # each row's own states, unpadded: (L, hidden)
                for r in rows:
                    results[r][kind] = tokens[r, : int(mask[r].sum())].float().cpu().numpy()
                continue
            if kind[0] == "classify":
                ids = [self._rows[targets[r][0]].ids for r in rows]
                activation = kind[1]
                assert activation is None or isinstance(activation, str)
                vectors = self._classify(activation, tokens.index_select(0, picked), mask.index_select(0, picked),
                                         ids)
            else:
                vectors = self._reduce(kind, tokens.index_select(0, picked), mask.index_select(0, picked))  # (b, dim)
            values = vectors.float().cpu().numpy()
            for i, r in enumerate(rows):
                results[r][kind] = values[i]
        for r, positions in enumerate(targets):
            self._results[self._rows[positions[0]]] = results[r]
            for position in positions:
                ticket, index = self._owners[position]
                ticket.write(index, results[r][self._kind(position)])

    def _reduce(self, kind: RowResult, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``kind``'s result of rows' right-padded states ``(b, P, hidden)``, mask ``(b, P)``: ``(b, dim)``."""
        if kind[0] == "pool":  # ("pool", its prompt's tokens)
            prompt = kind[1]
            assert isinstance(prompt, int)
            return self._pool(tokens, mask, prompt)
        assert self._lm_head is not None and len(kind) == 3  # the route refuses scoring on an encoder
        _, labels, softmax = kind
        last = last_positions(mask)  # (b,)
        states = tokens[torch.arange(tokens.shape[0], device=tokens.device), last]  # (b, hidden)
        return label_probabilities(self._lm_head, states, labels, over_labels=softmax)  # (b, labels)

    def _classify(self, activation: Activation | None, tokens: torch.Tensor, mask: torch.Tensor,
                  ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """The classifier scores ``(b, labels)`` of rows' right-padded states ``(b, P, hidden)``, mask ``(b, P)``,
        and token ids (a decoder's head finds its last token by them)."""
        assert self._classifier is not None  # the route refuses classifying on a model without the head
        padded = torch.full(mask.shape, self._classifier.pad_token_id or 0, dtype=torch.long)  # (b, P)
        for r, row in enumerate(ids):
            padded[r, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
        logits = self._classifier(tokens, padded.to(tokens.device), mask)  # (b, labels) fp32
        return activated(logits, self._classifier, activation)

    def _copy(self, source: int, target: int) -> None:
        owner, row = self._owners[target]
        owner.write(row, self._results[self._rows[source]][self._kind(target)])


def distinct_tokens(rows: Sequence[Sequence[int]]) -> int:
    """The tokens of ``rows`` with every shared prefix counted once (the nodes of their prefix tree): what a call
    must compute at least, each prefix once."""
    ordered = sorted(tuple(row) for row in rows)
    total = 0
    previous: tuple[int, ...] = ()
    for row in ordered:
        total += len(row) - len(os.path.commonprefix([previous, row]))
        previous = row
    return total


def activated(logits: torch.Tensor, classifier: SequenceClassifier, activation: Activation | None) -> torch.Tensor:
    """A cross-encoder's scores ``(b, labels)`` from its logits: as TEI's ``/predict`` gives them (``"tei"``: a
    sigmoid for one label, else a softmax over the labels), as ``CrossEncoder.predict`` does (``"model"``: the
    model's own activation), or the logits themselves (None)."""
    if activation is None:
        return logits
    if activation == "model":
        with torch.inference_mode():
            return default_activation(classifier)(logits)
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)


def call_ends(tickets: Sequence[Ticket], pool: PromptPool, lm_head: nn.Module | None = None,
              classifier: SequenceClassifier | None = None) -> tuple[ArrivalRows, TicketSink]:
    """The rows and the sink of one call of ``tickets`` (in arrival order): pooled by ``pool``, scored by
    ``lm_head`` (scoring tickets), or by ``classifier`` (cross-encoder tickets)."""
    owners = [(ticket, index) for ticket in tickets for index in range(len(ticket.rows))]
    rows = [Tokenized(tuple(row), segments, types) for ticket in tickets
            for row, segments, types in zip(ticket.rows, ticket.segments, ticket.token_types, strict=True)]
    return ArrivalRows(rows), TicketSink(owners, rows, pool, lm_head, classifier)
