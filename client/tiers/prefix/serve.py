"""One call's prefix tier: which rows start from a stored prefix, grouped into forwards on their suffixes; then the
rows that share a prefix among themselves, computed once (``shared``).

Asked after the exact tiers, before the map tier, for the rows still open whose
stored prefix could pay (``tier.candidates``), in a causal namespace that stores
prefix blocks. Rows are grouped by their count of stored blocks, so a forward's
rows share one past length; a row whose prefix cannot be read (a corrupt or
vanished block, the daemon going away) is dropped from its forward, which runs
again without it, and is left open: the compute tier computes it as a fallback.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import ClassVar

import torch

from attnstore.errors import AttnStoreError, MapsUnavailableError
from attnstore.protocol.prefix import PrefixLayout
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.call.rows import HiddenRows, Row
from attnstore_client.call.state import Call
from attnstore_client.resilience import cause_of
from attnstore_client.tiers.base import Tier, TierContext, ask_store
from attnstore_client.tiers.prefix.shared import serve_shared, shareable
from attnstore_client.tiers.prefix.tier import PrefixCandidate, candidates, forward_with_prefix

log = logging.getLogger(__name__)


class PrefixTier(Tier):
    """Serves rows whose first blocks of tokens are stored, by a forward on the rest (causal models)."""

    name: ClassVar[str] = "prefix"

    def __init__(self, context: TierContext) -> None:
        self._context = context

    def serve(self, rows: list[Row], call: Call) -> list[Row]:
        """See :meth:`Tier.serve`: stored prefixes first, then prefixes the call's rows share, computed once."""
        if not call.settings.prefix:
            return rows
        rows = self._serve_stored(rows, call)
        context = self._context
        if len(rows) < 2 or not shareable(context.adapter):
            return rows
        served = serve_shared(context.adapter, rows, call, context.device, call.settings.prefix_min_tokens)
        return [row for row in rows if row.index not in served]

    def _serve_stored(self, rows: list[Row], call: Call) -> list[Row]:
        """The rows whose prefixes are stored, served; returns the rest."""
        layout = call.namespace.prefix
        if layout is None or call.store_down is not None:
            return rows
        by_index = {row.index: row for row in rows}
        tokens = {row.index: row.tokens for row in rows}
        asked = candidates([row.index for row in rows if row.facts.failed is None], tokens, layout,
                           call.settings.prefix_min_tokens)
        if not asked:
            return rows
        context = self._context
        match = partial(context.connection.match_prefix, call.settings.namespace, context.fingerprint,
                        layout.block_size, [c.chain for c in asked])
        matched = ask_store(context, call, lambda remaining: match(timeout=remaining), [by_index[c.row] for c in asked])
        if matched is None:
            return rows
        groups: dict[int, list[PrefixCandidate]] = {}
        for candidate, blocks in zip(asked, matched, strict=True):
            if blocks * layout.block_size >= max(call.settings.prefix_min_tokens, 1):
                groups.setdefault(blocks, []).append(PrefixCandidate(candidate.row, candidate.chain[:blocks]))
        served: set[int] = set()
        size = call.settings.batch_size
        for blocks, group in sorted(groups.items(), reverse=True):
            for start in range(0, len(group), size):
                forward = [by_index[c.row] for c in group[start : start + size]]
                served.update(self._forward(call, layout, blocks, group[start : start + size], forward))
        return [row for row in rows if row.index not in served]

    def _forward(
        self, call: Call, layout: PrefixLayout, blocks: int, group: list[PrefixCandidate], rows: list[Row]
    ) -> list[int]:
        """One forward of rows sharing a prefix length; rows whose prefix fails are dropped and the rest run
        again. Returns the rows served."""
        context, counts = self._context, call.counts
        prefix_length = blocks * layout.block_size
        started = time.perf_counter()
        try:
            while group:
                try:
                    stream = context.connection.fetch_prefix(
                        call.settings.namespace, context.fingerprint, layout.block_size, [c.chain for c in group],
                        timeout=call.settings.timeout,
                    )
                except AttnStoreError as exc:
                    log.warning("prefixes of %d rows could not be fetched, computing them: %s", len(group), exc)
                    context.breaker.record_failure()
                    call.fail(rows, cause_of(exc))
                    return []
                pad = context.adapter.loaded.tokenizer.pad_token_id
                suffix = batch_from_ids([row.tokens[prefix_length:] for row in rows], pad).to(context.device)
                try:
                    out = forward_with_prefix(context.adapter, suffix, prefix_length, stream)  # (B, S, hidden)
                    hidden = [torch.tensor(stream.hidden(b), device=context.device) for b in range(len(group))]
                except MapsUnavailableError as exc:
                    log.warning("prefix of row %d unavailable (%s): computing it", rows[exc.row].index, exc)
                    call.fail([rows[exc.row]], exc.cause)
                    del group[exc.row], rows[exc.row]
                    continue
                finally:
                    stream.close()
                    counts.bytes_fetched += stream.bytes_fetched
                    counts.fetch_s += stream.fetch_seconds
                states = [torch.cat([hidden[b].float(), out[b, : suffix.lengths[b]].float()]) for b in range(len(rows))]
                call.deliver(rows, HiddenRows.stacked(states), "prefix")  # (L, hidden) each
                counts.forward_tokens += sum(suffix.lengths)
                counts.forwarded_tokens += suffix.size * suffix.padded_length
                counts.prefix_tokens += prefix_length * len(rows)
                return [row.index for row in rows]
            return []
        finally:
            counts.forward_s += time.perf_counter() - started
