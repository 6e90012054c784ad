"""One call's prefix tier: which rows start from a stored prefix, grouped into forwards on their suffixes; then the
rows that share a prefix among themselves, computed once (``shared``).

Asked after the exact tiers, before the map tier, for the rows still open whose
stored prefix could pay (``tier.candidates``), in a causal namespace that stores
prefix blocks. Rows are grouped by their count of stored blocks, so a forward's
rows share one past length; a row whose prefix cannot be read (a corrupt or
vanished block, the daemon going away) is dropped from its forward, which runs
again without it, and is left open: the compute tier computes it as a fallback.
A sample of the rows (``CallSettings.audit_rate``) is computed whole instead and
its stored prefix compared with the forward's (``audit``).

A namespace read without a prefix layout may get one later (another node's
write-back, a build): while it has none, a call with a row long enough for a
stored prefix asks for it again (its layouts only, no projector), at most every
``LAYOUT_REREAD_SECONDS``. Where write-back is on, each prefix the call's rows
share is handed to the ``PrefixWriter`` in the namespace's layout, so later calls
and other nodes start from it; a namespace that records none takes no prefix
(the daemon refuses a writer's put there: its layout is the model's, recorded by
``admin create-namespace``), so none is sent.
"""

from __future__ import annotations

import logging
import threading
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
from attnstore_client.tiers.prefix.audit import audit_prefix
from attnstore_client.tiers.prefix.shared import ComputedPrefix, serve_shared, shareable
from attnstore_client.tiers.prefix.tier import PrefixCandidate, candidates, forward_with_prefix
from attnstore_client.tiers.prefix.writer import PrefixWriter

log = logging.getLogger(__name__)

# How often a namespace without a prefix layout is asked for one again, by calls that could use it.
LAYOUT_REREAD_SECONDS = 10.0


class PrefixTier(Tier):
    """Serves rows whose first blocks of tokens are stored, by a forward on the rest (causal models)."""

    name: ClassVar[str] = "prefix"

    def __init__(self, context: TierContext, writer: PrefixWriter | None = None) -> None:
        """
        Args:
            context: what the tiers share.
            writer: where the prefixes the call's rows share go once computed (None: write-back is off).
        """
        self._context = context
        self._writer = writer
        self._lock = threading.Lock()
        self._learnt: PrefixLayout | None = None  # the namespace's layout, learnt after its view was read
        self._asked_at = -LAYOUT_REREAD_SECONDS  # the first call that could use a stored prefix asks

    def serve(self, rows: list[Row], call: Call) -> list[Row]:
        """See :meth:`Tier.serve`: stored prefixes first, then prefixes the call's rows share, computed once."""
        if not call.settings.prefix:
            return rows
        layout = self._layout(rows, call)
        if layout is not None:
            rows = self._serve_stored(rows, call, layout)
        context = self._context
        if len(rows) < 2 or not shareable(context.adapter):
            return rows
        keep = None if self._writer is None or layout is None else partial(self._keep, self._writer, call, layout)
        served = serve_shared(context.adapter, rows, call, context.device, call.settings.prefix_min_tokens, keep)
        return [row for row in rows if row.index not in served]

    def _layout(self, rows: list[Row], call: Call) -> PrefixLayout | None:
        """How the namespace stores prefix blocks: as its view says, else as learnt since (see the module)."""
        if call.namespace.prefix is not None or not shareable(self._context.adapter):
            return call.namespace.prefix
        longest = max((len(row.tokens) for row in rows), default=0)
        with self._lock:
            if self._learnt is None and self._writer is not None:
                self._learnt = self._writer.layout
            due = time.monotonic() - self._asked_at >= LAYOUT_REREAD_SECONDS
            if self._learnt is not None or not due or call.store_down is not None:
                return self._learnt
            if longest <= max(call.settings.prefix_min_tokens, 1):  # no row could start from a stored prefix
                return None
            self._asked_at = time.monotonic()
        try:
            layout = self._context.connection.prefix_layout(call.settings.namespace)
        except AttnStoreError as exc:
            log.info("prefix layout of namespace %r not read (%s): asking again in %g s", call.settings.namespace,
                     exc, LAYOUT_REREAD_SECONDS)
            return None
        with self._lock:
            self._learnt = self._learnt or layout
            return self._learnt

    def _keep(self, writer: PrefixWriter, call: Call, layout: PrefixLayout, prefix: ComputedPrefix) -> None:
        """Hand a prefix the call's rows share to ``writer``, when its whole blocks are long enough to be fetched."""
        whole = len(prefix.tokens) // layout.block_size * layout.block_size
        if whole >= max(call.settings.prefix_min_tokens, 1):
            writer.put(prefix, layout)

    def _serve_stored(self, rows: list[Row], call: Call, layout: PrefixLayout) -> list[Row]:
        """The rows whose prefixes are stored, served; returns the rest."""
        if call.store_down is not None:
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
        # Rows audited (``audit``): computed whole, their stored prefix compared with the forward's.
        audited = {row.index for row in rows if context.audit.sample(call.settings.audit_rate)}
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
                    computed = {b: audit_prefix(context, call, rows[b], group[b].chain, layout, stream, b)
                                for b in range(len(rows)) if rows[b].index in audited}
                except MapsUnavailableError as exc:
                    log.warning("prefix of row %d unavailable (%s): computing it", rows[exc.row].index, exc)
                    call.fail([rows[exc.row]], exc.cause)
                    del group[exc.row], rows[exc.row]
                    continue
                finally:
                    stream.close()
                    counts.bytes_fetched += stream.bytes_fetched
                    counts.fetch_s += stream.fetch_seconds
                served = [b for b in range(len(rows)) if b not in computed]
                states = [torch.cat([hidden[b].float(), out[b, : suffix.lengths[b]].float()]) for b in served]
                if served:
                    call.deliver([rows[b] for b in served], HiddenRows.stacked(states), "prefix")  # (L, hidden) each
                if computed:  # the audited rows, computed whole: never a stored prefix found wrong
                    call.deliver([rows[b] for b in computed], HiddenRows.stacked(list(computed.values())), "miss")
                counts.forward_tokens += sum(suffix.lengths)
                counts.forwarded_tokens += suffix.size * suffix.padded_length
                counts.prefix_tokens += prefix_length * len(served)
                return [row.index for row in rows]
            return []
        finally:
            counts.forward_s += time.perf_counter() - started
