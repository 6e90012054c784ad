"""The map tier: near-duplicates replay a stored entry's attention maps, where the cost model expects it to pay.

Per length band the cost model (``cost_model``) says whether a map lookup pays;
the rows it sends are projected (the namespace's projector over their feature
source) and searched a batch at a time. A row whose nearest entries the
namespace's fidelity gate trusts (or, ungated, whose entry lies within
``max_distance``) is a hit: hits run in forwards of their own, packed, their
maps streaming in layer by layer while the forward runs (a hit row computes no
q/k projection, RoPE, QKᵀ or softmax). A hit whose maps cannot be delivered (a
row error, a bad checksum, the daemon going away, the deadline) is dropped from
its forward, which runs again without it, and left open for the compute tier,
counted as a fallback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from functools import partial
from typing import ClassVar, overload

import numpy as np
import torch

from attnstore.errors import AttnStoreError, MapsUnavailableError, ProjectorChangedError
from attnstore.protocol.records import LookupBatch
from attnstore_client.adapters.batch import Batch, batch_from_ids
from attnstore_client.call.rows import Row
from attnstore_client.call.settings import CallSettings
from attnstore_client.call.state import Call
from attnstore_client.connection import MapStream, Match
from attnstore_client.projector import Projector
from attnstore_client.resilience import cause_of
from attnstore_client.tiers.base import Tier, TierContext, ask_store
from attnstore_client.tiers.cost_model import CostModel
from attnstore_client.tiers.forwards import cut, run_forward

log = logging.getLogger(__name__)


class StreamedLayers(Sequence[torch.Tensor]):
    """One hit row's maps for the adapter: layer ``i`` is fetched (and waited for) when the forward reaches it."""

    def __init__(self, stream: MapStream, row: int, layers: int, context: TierContext) -> None:
        self._stream = stream
        self._row = row
        self._layers = layers
        self._context = context

    def __len__(self) -> int:
        return self._layers

    @overload
    def __getitem__(self, layer: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, layer: slice) -> Sequence[torch.Tensor]: ...

    def __getitem__(self, layer: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        if isinstance(layer, slice):
            return [self[i] for i in range(*layer.indices(self._layers))]
        maps = torch.from_numpy(self._stream.layer(self._row, layer))  # (heads, L', L'), zero-copy
        if self._context.device.type != "cpu":
            maps = maps.pin_memory().to(self._context.device, non_blocking=True)
        return maps


class MapTier(Tier):
    """Serves near-duplicates of stored entries by replaying their maps."""

    name: ClassVar[str] = "maps"

    def __init__(self, context: TierContext) -> None:
        self._context = context

    def serve(self, rows: list[Row], call: Call) -> list[Row]:
        """See :meth:`Tier.serve`."""
        replayable = self._context.adapter.capabilities.can_replay  # a model without an adapter replays nothing
        if not call.settings.maps or call.namespace.projector is None or not replayable:
            return rows
        cost_model = self._context.cost_model
        # A text pair with token types has no stored maps to find: the store's entries and features are of one segment.
        eligible = [row for row in rows if row.facts.failed is None and not row.token_types]
        asked = [row for row in eligible if cost_model.should_ask(len(row.tokens))]
        call.counts.skipped += len(eligible) - len(asked)
        hits = self._search(asked, call)
        if not hits:
            return rows
        served: set[int] = set()
        ordered = sorted((row for row in rows if row.index in hits), key=lambda row: -len(row.tokens))
        for forward in cut(ordered, call.settings, cost_model):
            served.update(self._replay(forward, hits, call))
        return [row for row in rows if row.index not in served]

    # ---- search ---------------------------------------------------------------

    def _search(self, rows: list[Row], call: Call) -> dict[int, Match]:
        """Project and search ``rows`` a batch at a time; the map hits by row index.

        Each projected row's feature and the projector version it came from are kept on the row
        (``RowFacts.feature``: a written-back row carries it and its version, which the daemon checks to tell a
        node its projector is stale; the daemon indexes the row by the feature it derives from the tokens).
        """
        context = self._context
        hits: dict[int, Match] = {}
        ordered = sorted(rows, key=lambda row: -len(row.tokens))
        first = 0
        while first < len(ordered):
            rest = ordered[first:]  # this batch's rows and the ones after it
            asked = rest[: _projection_rows(call.settings, len(rest[0].tokens))]
            first += len(asked)
            projector = call.namespace.projector
            if projector is None:
                _projector_gone(call, rest)
                break
            started = time.perf_counter()
            batch = batch_from_ids([row.tokens for row in asked], context.adapter.loaded.tokenizer.pad_token_id)
            batch = batch.to(context.device)
            features = self._project(projector, batch)  # (B, d)
            call.counts.projection_s += time.perf_counter() - started
            _keep_features(call, asked, features)
            search = partial(self._searched, call, asked, features, batch)
            matches = ask_store(context, call, search, rest)
            if matches is None:
                if call.store_down is None:  # not a store failure: the namespace has no projector any more
                    _projector_gone(call, rest)
                break
            found = {row.index: m for row, m in zip(asked, matches, strict=True) if m.kind == "map" and m.entry_id}
            hits.update(found)
            seconds = time.perf_counter() - started
            for length, group in _by_band([len(row.tokens) for row in asked]).items():
                group_hits = sum(asked[k].index in found for k in group)
                context.cost_model.record_lookup(length, len(group), group_hits, seconds * len(group) / len(asked))
        return hits

    def _project(self, projector: Projector, batch: Batch) -> np.ndarray:
        return projector.project(self._context.adapter.feature_source(batch))  # (B, d)

    def _request(self, call: Call, features: np.ndarray, batch: Batch, tokens: list[Sequence[int]]) -> LookupBatch:
        settings = call.settings
        return LookupBatch(
            settings.namespace, self._context.fingerprint, features, batch.lengths,
            token_ids=tokens if settings.gate else None, max_distance=settings.max_distance, gate=settings.gate,
            projector_version=call.namespace.version,
        )

    def _searched(
        self, call: Call, asked: list[Row], features: np.ndarray, batch: Batch, remaining: float | None
    ) -> list[Match] | None:
        """Search the batch; when the namespace's projector was replaced meanwhile, load the new one and search
        again with the batch projected by it (the store is fine: the breaker is not told).

        None when the namespace read again has no projector at all (the store was emptied and the namespace
        made again): the view is adopted (exact tiers only from now on) and nothing is searched.
        """
        context = self._context
        tokens = [row.tokens for row in asked]
        try:
            return context.connection.search(self._request(call, features, batch, tokens), timeout=remaining)
        except ProjectorChangedError as exc:
            if context.reload_namespace is None:
                raise
            log.warning("namespace %r: its projector was replaced, following it (%s)", call.settings.namespace, exc)
            call.namespace = context.reload_namespace()
            projector = call.namespace.projector
            if projector is None:
                return None
            features = self._project(projector, batch)  # (B, d)
            _keep_features(call, asked, features)
            return context.connection.search(self._request(call, features, batch, tokens), timeout=remaining)

    # ---- replay ---------------------------------------------------------------

    def _replay(self, rows: list[Row], hits: dict[int, Match], call: Call) -> list[int]:
        """One forward of hit rows replaying their entries' maps; the rows served (the others marked failed)."""
        context, counts = self._context, call.counts
        entries = [(int(hits[row.index].entry_id or 0), len(row.tokens)) for row in rows]
        try:
            stream = context.connection.fetch_maps(
                call.settings.namespace, context.fingerprint, entries, timeout=call.settings.timeout
            )
        except AttnStoreError as exc:
            log.warning("maps of %d hits could not be fetched, computing them: %s", len(rows), exc)
            context.breaker.record_failure()
            call.fail(rows, cause_of(exc))
            return []
        failed: dict[int, str] = {}  # stream row -> cause
        try:
            if not call.settings.stream:
                stream.wait()
            # Each rerun after a row's maps stopped mid-forward drops at least that row.
            for _ in range(len(rows) + 1):
                failed.update(stream.failed())
                live = [k for k in range(len(rows)) if k not in failed]
                if not live:
                    break
                layers = context.adapter.num_layers
                replay = {p: StreamedLayers(stream, k, layers, context) for p, k in enumerate(live)}
                try:
                    result = run_forward(context, [rows[k] for k in live], call.settings, replay=replay)
                except MapsUnavailableError as exc:
                    log.warning("replay of a row interrupted (%s); running the forward again", exc.cause)
                    failed.setdefault(exc.row, exc.cause)  # the stream's row
                    stream.wait()
                    continue
                call.forwarded(result.seconds, result.tokens, result.forwarded)
                call.deliver([rows[k] for k in live], result.hidden, "map")
                break
        finally:
            stream.close()
            counts.bytes_fetched += stream.bytes_fetched
            counts.fetch_s += stream.fetch_seconds
        if stream.outage is not None:
            context.breaker.record_failure()
        for k, cause in failed.items():
            call.fail([rows[k]], cause)
        return [row.index for k, row in enumerate(rows) if k not in failed]


def _keep_features(call: Call, asked: Sequence[Row], features: np.ndarray) -> None:
    """Keep each row's feature with the projector version it came from (a written-back row carries it)."""
    for k, row in enumerate(asked):
        row.facts.feature, row.facts.projector_version = features[k], call.namespace.version


def _projector_gone(call: Call, rows: Sequence[Row]) -> None:
    """The namespace lost its projector mid-call (made again without one): ``rows`` are computed, as fallbacks.

    The store can only make a call faster, so a namespace replaced under a client is a reason to compute,
    never an error; their features of the old projector are dropped with it.
    """
    log.warning("namespace %r has no projector any more: computing %d rows, exact hits only until it has one",
                call.settings.namespace, len(rows))
    for row in rows:
        row.facts.feature = None
    call.fail(rows, "refused")


def _by_band(lengths: Sequence[int]) -> dict[int, list[int]]:
    """Positions of ``lengths`` grouped by the cost model's length band, keyed by a length of the band."""
    groups: dict[int, list[int]] = {}
    first: dict[int, int] = {}
    for position, length in enumerate(lengths):
        band = CostModel.band_of(length)
        groups.setdefault(first.setdefault(band, length), []).append(position)
    return groups


def _projection_rows(settings: CallSettings, longest: int) -> int:
    """Rows projected in one padded batch: ``batch_size``, or fewer where ``max_batch_tokens`` bounds a forward's
    tokens (a memory budget's: the projection's padded batch holds ``rows * longest`` tokens)."""
    if settings.max_batch_tokens is None:
        return settings.batch_size
    return max(1, min(settings.batch_size, settings.max_batch_tokens // max(longest, 1)))
