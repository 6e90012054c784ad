"""The chunk tier's audit: a sample of the chunks the store serves (instructions and chunks alike) is computed
again after its context, as the node that stored it computed it, and compared with the stored keys and values
(``attnstore_client.audit``).

Values of chunks come from writers (``PutChunks``), like written-back rows. A chunk out of tolerance is reported
by its key and quarantined at the daemon, which names its writer (the token that put it;
``AttnCache.audit_findings``): not stored, for every node, until an admin releases it. The prompt
is fused from the chunk computed here instead, so no row is fused from a chunk found wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from attnstore_client.call.settings import ChunkSettings
from attnstore_client.call.state import Call
from attnstore_client.tiers.base import TierContext
from attnstore_client.tiers.chunks.capture import capture_chunks
from attnstore_client.tiers.chunks.source import ChunkKV


class ChunkAudit:
    """Audits the chunks one call is served, at the call's ``audit_rate``.

    Args:
        context: what the tiers share (the audit log, the store, the model).
        call: the call (its settings and tallies).
    """

    def __init__(self, context: TierContext, call: Call) -> None:
        self._context = context
        self._call = call

    def __call__(
        self, found: dict[bytes, ChunkKV], wanted: Mapping[bytes, tuple[ChunkKV | None, Sequence[int]]],
        settings: ChunkSettings, batch_size: int, device: torch.device,
    ) -> dict[bytes, ChunkKV]:
        """``found`` (the stored chunks of ``wanted``: key -> context, ids) with each sampled one computed again
        and compared; a wrong one reported and replaced by the one computed here."""
        context, call = self._context, self._call
        sampled = [key for key in found if context.audit.sample(call.settings.audit_rate)]
        if not sampled:
            return found
        fresh = capture_chunks(context.adapter, [wanted[key] for key in sampled], dtype=settings.dtype,
                               batch_size=batch_size, device=device)
        tolerance = context.audit.tolerance
        checked = dict(found)
        for key, computed in zip(sampled, fresh, strict=True):
            stored = found[key]
            measured = [tolerance.measure(a.reshape(-1, a.shape[-1]).cpu().numpy(), b.reshape(-1, b.shape[-1]))
                        for a, b in ((stored.keys, computed.keys), (stored.values, computed.values))]  # (N, d) each
            worst = (min(m[0] for m in measured), max(m[1] for m in measured))
            call.counts.audited += 1
            if tolerance.holds(*worst):
                continue
            call.counts.audit_mismatches += 1
            context.audit.report(context.connection, call.settings.namespace, context.fingerprint, key, worst,
                                 timeout=call.settings.timeout, kind="chunk")
            checked[key] = computed
        return checked
