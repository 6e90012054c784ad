"""The forwards a call runs: rows cut into batches, packed end to end (or right-padded), timed for the cost model.

Packed (the default, ``CallSettings.packed``): a forward is a length-sorted run of
rows end to end with nothing padded (``adapters.packed``), as many as fit in the
tokens a padded batch of ``batch_size`` of them would hold (see ``cut``).
Padded: the rows are cut as sentence-transformers cuts them until the cost model
has timed ``min_forwards`` forwards, then where its fit predicts the least time
(``batch.group_by_length``). Either way every forward's time is recorded with
its computed and replayed tokens and the token pairs its attention covers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnstore_client.adapters.base import Adapter
from attnstore_client.adapters.batch import batch_from_ids, group_by_length
from attnstore_client.adapters.packed import pack
from attnstore_client.adapters.replay import ReplayMaps
from attnstore_client.call.rows import HiddenRows, Row
from attnstore_client.call.settings import CallSettings
from attnstore_client.tiers.cost_model import CostModel
from attnstore_client.tiers.engines.runtimes import GraphEngine

if TYPE_CHECKING:
    from attnstore_client.tiers.base import TierContext


@dataclass(frozen=True)
class ForwardResult:
    """One forward's rows' last hidden states, the maps it kept, and its time."""

    hidden: HiddenRows
    kept: dict[int, torch.Tensor]  # position in the forward -> (layers, heads, L, L) fp16
    seconds: float
    tokens: int  # the rows' own tokens
    forwarded: int  # tokens the forward ran, padding included (packed: ``tokens``)


def cut(
    rows: Sequence[Row], settings: CallSettings, cost_model: CostModel, *, side_by_side: int = 1,
    least_tokens: int = 0,
) -> list[list[Row]]:
    """``rows`` (sorted longest first) cut into forwards.

    Packed, with ``settings.max_batch_tokens``: at most ``batch_size`` rows and that many tokens (a longer row
    goes alone). Packed without it: the tokens a padded batch of ``batch_size`` of these rows would hold (their
    longest times ``batch_size``), so a forward takes no more memory than sentence-transformers' batch, and the
    shorter rows fill the room its padding would have taken; and room for ``least_tokens`` at least (each, side
    by side).
    Padded: as sentence-transformers cuts them, then where the cost model's fit predicts the least time.
    Packed forwards run ``side_by_side`` at once (``forward_pool``) get that share of the room each (together
    they hold what one would), and come in a multiple of that many of even tokens (fewer where a row is longer
    than a share; more where a share of short rows holds more than ``most`` rows), so that they end together: a
    window of 2 to 11 forwards otherwise left a core idle for half a forward.
    """
    size = settings.batch_size
    if settings.packed:
        if settings.max_batch_tokens is None:
            longest = max((len(row.tokens) for row in rows), default=0)
            most, budget = len(rows), max(size * longest, least_tokens * max(side_by_side, 1))
        else:
            most, budget = size, settings.max_batch_tokens
        if side_by_side > 1 and len(rows) > 1:  # their share of the room each, all at once holding what one does
            forwards = _packed(rows, most, -(-budget // side_by_side))
            even = _even(rows, -(-len(forwards) // side_by_side) * side_by_side)
            # Evening goes by tokens: a share of short rows is cut again to the ``most`` rows a forward may hold.
            return [part for forward in even for part in _packed(forward, most, budget)]
        return _packed(rows, most, budget)
    cost = cost_model.forward_cost()
    groups = group_by_length([len(row.tokens) for row in rows], size, None if cost is None else cost.seconds)
    return [list(rows[group]) for group in groups]


def _packed(rows: Sequence[Row], most: int, budget: int) -> list[list[Row]]:
    """Rows in order, cut into forwards of at most ``most`` rows and ``budget`` tokens (a longer row alone)."""
    forwards: list[list[Row]] = []
    tokens = 0
    for row in rows:
        length = len(row.tokens)
        if not forwards or len(forwards[-1]) >= most or tokens + length > budget:
            forwards.append([])
            tokens = 0
        forwards[-1].append(row)
        tokens += length
    return forwards


def _even(rows: Sequence[Row], count: int) -> list[list[Row]]:
    """Rows in order, cut into at most ``count`` forwards of about the same tokens each."""
    total = sum(len(row.tokens) for row in rows)
    forwards: list[list[Row]] = [[] for _ in range(count)]
    start = 0
    for row in rows:  # each row goes to the share its first token falls in
        forwards[start * count // total].append(row)
        start += len(row.tokens)
    return [forward for forward in forwards if forward]


def run_forward(
    context: TierContext, rows: Sequence[Row], settings: CallSettings, *,
    replay: Mapping[int, ReplayMaps] | None = None, keep: Sequence[int] = (), side_by_side: int = 1,
    adapter: Adapter | None = None, graph: GraphEngine | None = None,
) -> ForwardResult:
    """One forward of ``rows``: positions in ``replay`` replay those maps, positions in ``keep`` keep theirs.

    Run as one of ``side_by_side`` forwards at once (``forward_pool``), its time counts as that share of it:
    the wall time it takes of the call, and what the cost model weighs a map hit's saving by. ``adapter``
    runs it instead of the model's own (the int8 model, ``int8``); ``graph`` runs it padded on an exported graph
    instead (``engines``: no replay, no maps kept).

    Raises:
        MapsUnavailableError: a replaying row's maps stopped arriving (the caller runs it again without).
    """
    adapter = adapter or context.adapter
    tokens = [row.tokens for row in rows]
    types = [row.token_types for row in rows] if any(row.token_types for row in rows) else None
    started = time.perf_counter()
    if graph is not None:
        if replay or keep:
            raise ValueError("run_forward(): a graph engine neither replays nor keeps maps")
        batch = batch_from_ids(tokens, adapter.loaded.tokenizer.pad_token_id, types)
        hidden = HiddenRows(graph.forward(batch).to(context.device), batch.lengths)
        kept: dict[int, torch.Tensor] = {}
        padded = batch.padded_length
        pairs = batch.size * padded * padded
        computed = total = batch.size * padded
    elif settings.packed and adapter.capabilities.can_pack:
        packed = pack(tokens, types).to(context.device)
        out, kept = adapter.forward_packed(packed, replay, keep)  # (T, hidden)
        hidden = HiddenRows(out.float(), packed.lengths, packed.starts)
        pairs = sum(length * length for length in packed.lengths)
        computed = sum(length for position, length in enumerate(packed.lengths) if position not in (replay or {}))
        total = packed.tokens
    else:
        batch = batch_from_ids(tokens, adapter.loaded.tokenizer.pad_token_id, types).to(context.device)
        if keep:
            out, kept = adapter.forward_keeping(batch, keep, replay)  # (B, P, hidden)
        else:
            out, kept = adapter.forward(batch, replay), {}  # (B, P, hidden)
        hidden = HiddenRows(out.float(), batch.lengths)
        padded = batch.padded_length
        pairs = batch.size * padded * padded
        total = batch.size * padded
        computed = padded * (batch.size - len(replay or {}))
    seconds = (time.perf_counter() - started) / side_by_side
    context.cost_model.record_forward(
        max(hidden.lengths), computed_tokens=computed, replayed_tokens=total - computed, pairs=pairs, seconds=seconds
    )
    return ForwardResult(hidden, kept, seconds, sum(hidden.lengths), total)
