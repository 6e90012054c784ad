"""One batch through the cache: projection, one lookup, one forward with replay, fallbacks.

Rows the exact tier answers skip the forward (their stored outputs are the
result). The other rows go through one forward in which map hits replay the
store's maps, layer by layer as they arrive, and misses compute normally. If a
hit row's maps cannot be delivered after the forward has started (a row error,
a bad checksum, the daemon going away, the deadline), the forward is run again
with that row computed: outputs stay those of the plain model, within the
fidelity of the hits that did arrive.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np
import torch

from attnstore.errors import AttnStoreError, MapsUnavailableError, ProjectorChangedError
from attnstore.protocol.records import LookupBatch
from attnstore_client.adapters import Adapter
from attnstore_client.batch import Batch, batch_from_ids
from attnstore_client.connection import Retrieval, StoreConnection
from attnstore_client.keys import token_hash
from attnstore_client.projector import Projector
from attnstore_client.resilience import CircuitBreaker, RetryPolicy, call_with_retries, cause_of

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefillSettings:
    """How batches use the store (see ``AttnCache`` for the user-facing defaults)."""

    namespace: str
    max_distance: float  # threshold on the predicted map distance (when not gated)
    exact: bool  # use the exact tier (stored outputs)
    stream: bool  # start replay while maps still arrive
    timeout: float | None  # deadline of one batch's lookup, arrays included
    retry: RetryPolicy
    gate: bool = False  # decide map hits with the namespace's fidelity gate instead of max_distance


@dataclass(slots=True)
class BatchCounts:
    """Mutable tallies of one call, turned into a ``CacheStats`` at its end."""

    rows: int = 0
    exact_hits: int = 0
    map_hits: int = 0
    misses: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    bytes_fetched: int = 0
    projection_s: float = 0.0
    lookup_s: float = 0.0
    fetch_s: float = 0.0
    forward_s: float = 0.0
    # Per row of every batch, in batch order: "exact", "map", "miss" or "fallback".
    row_kinds: list[str] = field(default_factory=list)

    def fallback(self, cause: str, rows: int) -> None:
        """Count ``rows`` computed because of ``cause``."""
        if rows:
            self.fallbacks[cause] = self.fallbacks.get(cause, 0) + rows


class _StreamedLayers(Sequence[torch.Tensor]):
    """One hit row's maps for the adapter: layer ``i`` is fetched (and waited for) when the forward reaches it."""

    def __init__(self, retrieval: Retrieval, row: int, layers: int) -> None:
        self._retrieval = retrieval
        self._row = row
        self._layers = layers

    def __len__(self) -> int:
        return self._layers

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, index: slice) -> list[torch.Tensor]: ...

    def __getitem__(self, index: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(index, slice):
            return [self[layer] for layer in range(self._layers)[index]]
        return torch.from_numpy(self._retrieval.layer(self._row, index))  # (heads, L', L')


class CachedPrefill:
    """Runs batches of one model against one namespace of a store.

    Args:
        adapter: the model's adapter.
        connection: the store.
        fingerprint: the model's fingerprint (equal to the namespace's; checked by the caller).
        projector: the namespace's projector.
        settings: thresholds, deadlines, retries.
        breaker: shared by every batch of this client.
        seed: seed of the retry jitter.
        projector_version: the namespace's version of ``projector``; lookups state it, and when the
            namespace's projector is replaced the prefill loads the new one (see ``_follow_projector``).
    """

    def __init__(
        self,
        adapter: Adapter,
        connection: StoreConnection,
        *,
        fingerprint: str,
        projector: Projector,
        settings: PrefillSettings,
        breaker: CircuitBreaker,
        seed: int = 0,
        projector_version: int = 0,
    ) -> None:
        self.adapter = adapter
        self.connection = connection
        self.fingerprint = fingerprint
        self.projector = projector
        self.settings = settings
        self.breaker = breaker
        self.projector_version = projector_version
        self._rng = random.Random(seed)

    def hidden_states(self, batch: Batch, counts: BatchCounts) -> list[torch.Tensor]:
        """Each row's last hidden states ``(L, hidden)`` fp32, served from the store where it can.

        Args:
            batch: right-padded token rows.
            counts: tallies of the current call, updated in place.

        Returns:
            One tensor per row, in batch order.
        """
        counts.rows += batch.size
        retrieval = self._retrieve(batch, counts)
        if retrieval is None:
            counts.row_kinds.extend(["fallback"] * batch.size)  # counted by cause in _retrieve
            return self._forward(batch, range(batch.size), counts)
        try:
            return self._serve(batch, retrieval, counts)
        finally:
            retrieval.close()
            counts.bytes_fetched += retrieval.bytes_fetched
            counts.fetch_s += retrieval.fetch_seconds

    def _retrieve(self, batch: Batch, counts: BatchCounts, *, followed: bool = False) -> Retrieval | None:
        """Project and look the batch up; None when every row must be computed (counted).

        When the namespace's projector was replaced, the new one is loaded and the batch
        projected again, once (``followed``): the store is fine, so the breaker is not told.
        """
        if not self.breaker.allow():
            counts.fallback("circuit_open", batch.size)
            return None
        start = time.perf_counter()
        features = self.projector.project(self.adapter.feature_source(batch))  # (B, d)
        hashes = [token_hash(batch.row_ids(row)) for row in range(batch.size)]
        looked_up = time.perf_counter()
        counts.projection_s += looked_up - start
        settings = self.settings
        request = LookupBatch(
            settings.namespace, self.fingerprint, features, batch.lengths,
            token_hashes=hashes if settings.exact else None,
            token_ids=[batch.row_ids(row) for row in range(batch.size)] if settings.gate else None,
            max_distance=settings.max_distance, gate=settings.gate, projector_version=self.projector_version,
        )
        try:
            return call_with_retries(
                lambda remaining: self.connection.lookup(request, timeout=remaining),
                settings.retry,
                timeout=settings.timeout,
                rng=self._rng,
            )
        except ProjectorChangedError as exc:
            if followed or not self._follow_projector(exc):
                counts.fallback("projector_changed", batch.size)
                return None
            return self._retrieve(batch, counts, followed=True)
        except AttnStoreError as exc:
            log.warning("store lookup failed, computing %d rows: %s", batch.size, exc)
            self.breaker.record_failure()
            counts.fallback(cause_of(exc), batch.size)
            return None
        finally:
            counts.lookup_s += time.perf_counter() - looked_up

    def _follow_projector(self, cause: ProjectorChangedError) -> bool:
        """Load the namespace's new projector (and its gate); False when it cannot be had."""
        try:
            handle = self.connection.namespace(self.settings.namespace)
            if handle.projector is None:
                return False
            projector = Projector.from_safetensors_bytes(handle.projector)
        except AttnStoreError as exc:
            log.warning("the namespace's projector changed (%s) and the new one cannot be loaded: %s", cause, exc)
            return False
        log.warning("namespace %r: projector version %d replaced by %d; following it",
                    self.settings.namespace, self.projector_version, handle.projector_version)
        self.projector, self.projector_version = projector, handle.projector_version
        if self.settings.gate and projector.gate is None:
            # The gate came with the old projector: without one, the threshold decides.
            self.settings = dataclasses.replace(self.settings, gate=False)
        return True

    def _serve(self, batch: Batch, retrieval: Retrieval, counts: BatchCounts) -> list[torch.Tensor]:
        """The batch from a lookup's answer: exact rows' outputs, one forward for the rest (map rows replaying)."""
        exact = {
            row: torch.from_numpy(np.asarray(outputs, dtype=np.float32)) for row, outputs in retrieval.outputs.items()
        }
        rest = [row for row in range(batch.size) if row not in exact]
        if rest and not self.settings.stream:
            retrieval.wait()
        # Exact rows whose outputs did not arrive (the stream broke before them) are computed.
        lost = "bad_data" if retrieval.outage is None else cause_of(retrieval.outage)
        failed: dict[int, str] = {row: lost for row in rest if retrieval.matches[row].kind == "exact"}
        hits = [row for row in retrieval.map_rows if row in rest]
        computed = self._forward(batch, rest, counts, retrieval, hits, failed) if rest else []
        for cause in failed.values():
            counts.fallback(cause, 1)
        kinds = []
        for row in range(batch.size):
            kind = "exact" if row in exact else "fallback" if row in failed else "map" if row in hits else "miss"
            kinds.append(kind)
        counts.row_kinds.extend(kinds)
        counts.exact_hits += kinds.count("exact")
        counts.map_hits += kinds.count("map")
        counts.misses += kinds.count("miss")
        if retrieval.outage is None:
            self.breaker.record_success()
        else:
            self.breaker.record_failure()
        by_row = dict(zip(rest, computed, strict=True))
        return [exact[row] if row in exact else by_row[row] for row in range(batch.size)]

    def _forward(
        self,
        batch: Batch,
        rows: Sequence[int],
        counts: BatchCounts,
        retrieval: Retrieval | None = None,
        hits: Sequence[int] = (),
        failed: dict[int, str] | None = None,
    ) -> list[torch.Tensor]:
        """Last hidden states ``(L, hidden)`` of ``rows`` in one forward; ``hits`` replay ``retrieval``'s maps.

        A hit whose maps cannot be delivered is added to ``failed`` with its cause
        and computed instead: when its maps stop coming mid-forward, the forward
        runs again without it (each rerun drops at least one row, so there are at
        most ``len(hits)`` of them).
        """
        failed = {} if failed is None else failed
        sub = batch if len(rows) == batch.size else batch_from_ids(
            [batch.row_ids(row).tolist() for row in rows], self.adapter.loaded.tokenizer.pad_token_id
        )
        start = time.perf_counter()
        try:
            for _ in range(len(hits) + 1):
                if retrieval is not None:
                    failed.update({row: cause for row, cause in retrieval.failed().items() if row in hits})
                replay = {
                    position: _StreamedLayers(retrieval, row, self.adapter.num_layers)
                    for position, row in enumerate(rows)
                    if retrieval is not None and row in hits and row not in failed
                }
                try:
                    out = self.adapter.forward(sub, replay)  # (len(rows), P, hidden)
                    break
                except MapsUnavailableError as exc:
                    # Let the stream settle, then run again with every failed row computed.
                    log.warning("replay of row %d interrupted (%s); running the batch again", exc.row, exc.cause)
                    failed.setdefault(exc.row, exc.cause)
                    if retrieval is not None:
                        retrieval.wait()
        finally:
            counts.forward_s += time.perf_counter() - start
        return [out[i, : batch.lengths[row]] for i, row in enumerate(rows)]  # (L, hidden) each
