"""The chunk tier: prompts in segments fused from stored chunks, for calls that keep only each row's last state.

Asked after the exact tiers, before the prefix tier, for the rows still open
when the call has chunk settings (``CallSettings.chunks``), the model is a
Llama-like decoder without a sliding window, and the call's sink keeps only
each row's last state (``score_choices``, ``AttnCache.last_hidden_states``):
a fused forward computes the question's states, not every token's, so a call
that wants them all (``encode``, ``hidden_states``) leaves its rows to the
other tiers. A row is served when its prompt came in at least two segments
(instruction, question; chunks between). Its result approximates the full
forward's (the chosen share of chunk tokens decides how closely): rows it
serves are ``"chunk"`` rows and never enter the exact tiers. A row whose
instruction or a chunk the source holds damaged is left to the other tiers and
counted as a ``"checksum"`` fallback: it is computed in full, the call goes on.
"""

from __future__ import annotations

import logging
import time
from typing import ClassVar

from attnstore.errors import UnsupportedModelError
from attnstore_client.call.rows import HiddenRows, Row
from attnstore_client.call.state import Call
from attnstore_client.tiers.base import Tier, TierContext
from attnstore_client.tiers.chunks.audit import ChunkAudit
from attnstore_client.tiers.chunks.plan import FusionCounts, fuse_prompts
from attnstore_client.tiers.chunks.source import ChunkSource

log = logging.getLogger(__name__)


class ChunkTier(Tier):
    """Serves prompts in segments by fusing their stored instruction and chunks (causal models).

    Args:
        context: what the tiers share.
        source: where chunks are looked up and the missing ones put.
    """

    name: ClassVar[str] = "chunks"

    def __init__(self, context: TierContext, source: ChunkSource) -> None:
        self._context = context
        self.source = source
        self._unsupported = not (context.adapter.causal and context.adapter.capabilities.can_share_kv)

    def serve(self, rows: list[Row], call: Call) -> list[Row]:
        """See :meth:`Tier.serve`."""
        settings = call.settings.chunks
        if settings is None or self._unsupported or not call.sink.last_only:
            return rows
        asked = [row for row in rows if len(row.segments) >= 2 and row.segments[-1] > 0]
        if not asked:
            return rows
        asked.sort(key=lambda row: -len(row.tokens))
        counts = FusionCounts()
        started = time.perf_counter()
        try:
            states = fuse_prompts(self._context.adapter, self.source, [(row.tokens, row.segments) for row in asked],
                                  settings, batch_size=call.settings.batch_size, device=self._context.device,
                                  counts=counts,
                                  audit=ChunkAudit(self._context, call) if call.settings.audit_rate > 0 else None)
        except UnsupportedModelError as exc:
            log.warning("chunk tier off for this model: %s", exc)
            self._unsupported = True
            return rows
        seconds = time.perf_counter() - started - counts.fetch_s
        # Tokens computed, as full-forward tokens: token-layers over layers (a chosen token runs most layers).
        computed = round(counts.token_layers / max(self._context.adapter.num_layers, 1))
        call.forwarded(seconds, computed, computed)
        tallies = call.counts
        tallies.fetch_s += counts.fetch_s
        tallies.bytes_fetched += counts.bytes_fetched
        tallies.chunk_tokens += counts.stored_tokens
        tallies.chunk_recomputed += counts.chosen_tokens
        tallies.chunks_captured += counts.captured
        call.fail([row for row, out in zip(asked, states, strict=True) if out is None], "checksum")
        fused = [(row, out) for row, out in zip(asked, states, strict=True) if out is not None]
        if fused:  # the question's states (q, hidden) per row
            call.deliver([row for row, _ in fused], HiddenRows.stacked([out for _, out in fused]), "chunk")
        served = {row.index for row, _ in fused}
        return [row for row in rows if row.index not in served]
