"""The store's exact tier: stored outputs of rows whose tokens are stored, by token hash alone.

Asked a window of rows per call (``CallSettings.window``, at most the daemon's
``--max-queries``), nothing projected. What it answers also enters this
process's own exact tier. With write-back on, the same call says which missed
rows the store admits (``RowFacts.admitted``): the compute tier writes those back.
A sample of the rows found (``CallSettings.audit_rate``) is not served but set
aside for its audit (``RowFacts.audit``, ``attnstore_client.audit``): the compute
tier computes it and compares.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import ClassVar

import numpy as np

from attnstore_client.call.rows import HiddenRows, Row
from attnstore_client.call.state import Call
from attnstore_client.tiers.base import Tier, TierContext, ask_store
from attnstore_client.tiers.local_exact import LocalExactTier


class StoreExactTier(Tier):
    """Serves the rows the store holds outputs of, when the call uses exact tiers."""

    name: ClassVar[str] = "store_exact"

    def __init__(self, context: TierContext, local: LocalExactTier) -> None:
        self._context = context
        self._local = local

    def serve(self, rows: list[Row], call: Call) -> list[Row]:
        """See :meth:`Tier.serve`."""
        if not call.settings.exact:
            return rows
        left: list[Row] = []
        size = call.settings.window
        for start in range(0, len(rows), size):
            window = rows[start : start + size]
            reply = ask_store(self._context, call, partial(self._exact, call, window), rows[start:])
            if reply is None:
                return left + rows[start:]
            found, admitted = reply
            for position in admitted:
                window[position].facts.admitted = True
            found = self._fitting(found, window, call)
            for position in [p for p in sorted(found) if self._context.audit.sample(call.settings.audit_rate)]:
                window[position].facts.audit = found.pop(position)  # computed and compared (``audit``), not served
            served = [window[position] for position in sorted(found)]
            if served:
                outputs = [found[position] for position in sorted(found)]
                call.counts.bytes_fetched += sum(array.nbytes for array in outputs)
                call.deliver(served, HiddenRows.stacked([self._context.to_device(o) for o in outputs]), "exact")
                for row, array in zip(served, outputs, strict=True):
                    self._local.outputs.put(self._local.key(row), array)
            left += [row for position, row in enumerate(window) if position not in found]
        return left

    def _fitting(self, found: dict[int, np.ndarray], window: Sequence[Row], call: Call) -> dict[int, np.ndarray]:
        """The stored outputs shaped as their rows, ``(L, hidden)``; a store answering another shape is bad data,
        and its rows are computed (a ``bad_data`` fallback), never served."""
        hidden = self._context.adapter.hidden_size
        wrong = [p for p, array in found.items() if array.shape != (len(window[p].tokens), hidden)]
        if not wrong:
            return found
        call.fail([window[p] for p in wrong], "bad_data")
        return {p: array for p, array in found.items() if p not in wrong}

    def _exact(
        self, call: Call, window: Sequence[Row], remaining: float | None
    ) -> tuple[dict[int, np.ndarray], frozenset[int]]:
        """Window position -> stored outputs ``(L, hidden)`` fp16, and the missed positions the store admits."""
        context, namespace = self._context, call.settings.namespace
        hashes, lengths = [row.key for row in window], [len(row.tokens) for row in window]
        if context.writing_back is None:
            found = context.connection.exact(namespace, context.fingerprint, hashes, lengths, timeout=remaining)
            return found, frozenset()
        return context.connection.exact_admitting(namespace, context.fingerprint, hashes, lengths, timeout=remaining)
