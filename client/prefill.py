"""One call through the cache: each tier in turn, asked only for the rows that still need it.

1. Rows with identical tokens are one row: computed once, every copy answered.
2. The node-local exact tier (``tiers.local_exact``) answers the rows this process saw.
3. The store's exact tier answers by token hash, a window of rows per call,
   nothing projected; it marks the missed rows the daemon admits for write-back.
4. The prefix tier (``tiers.prefix``, causal models): rows whose first
   blocks of tokens are stored run their forward on the rest only.
5. The cost model (``tiers.cost_model``) picks, per length band, the rows worth
   sending for maps; those are projected and searched.
6. The rows left are batched by length after the lookups, map hits and the
   rest together: a hit's maps stream layer by layer into the forward, which
   skips q/k for that row and computes the others, so the batches pad no more
   than the plain model's. Once the cost model has timed enough forwards, a
   run of rows far shorter than its batch's longest gets a forward of its own
   where the padding would cost more than the forward (``batch.group_by_length``).
7. Computed rows enter the node-local tier; admitted ones are queued for
   write-back (``tiers.write_back``), off the call's path.

Write-back of maps. The model computes its missed rows with its own attention
kernel (``sdpa``), which never materialises the probabilities, so a row's maps
cost extra work. Only the rows that will be written back with maps pay it: the
admitted rows whose length the cost model says replay pays at
(``CostModel.replay_pays``), whose maps fit one message, and which have the
feature of their map lookup (or whose namespace has no projector yet). The
exact-tier reply that admits them comes before the forward, so they are known
when their batch runs: inside that same forward the batch's computing rows take
one batched explicit softmax of the layer's own q/k (``Adapter.forward_keeping``;
cheaper than splitting the batch at every layer) and the admitted rows' maps are
copied out, fp16 as stored, for the worker thread to serialise. No second
forward runs, and batches without such a row run the model's kernel as before.
Measured on all-MiniLM-L6-v2 at 1 torch thread: +6.5% to +8.6% CPU time for a
batch that keeps maps, nothing for one that does not (docs/OPERATIONS.md); so
batches that keep maps are held to ``WriteBackSettings.capture_share`` (0.5) of
the computed tokens, and the miss path to under 5% more.

A hit whose maps cannot be delivered (a row error, a bad checksum, the daemon
going away, the deadline) is computed instead and counted as a fallback; the
outputs stay the plain model's, within the fidelity of the maps that did arrive.
A store that cannot be reached costs retries within the deadline, then the
circuit breaker keeps every call away from it for a while.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar, overload

import numpy as np
import torch
from tqdm.auto import tqdm

from attnstore.errors import AttnStoreError, MapsUnavailableError, ProjectorChangedError
from attnstore.protocol.prefix import PrefixLayout
from attnstore.protocol.records import LookupBatch
from attnstore_client.adapters import Adapter
from attnstore_client.batch import Batch, batch_from_ids, group_by_length
from attnstore_client.connection import MapStream, Match, StoreConnection
from attnstore_client.keys import token_hash
from attnstore_client.projector import Projector
from attnstore_client.resilience import CircuitBreaker, RetryPolicy, call_with_retries, cause_of
from attnstore_client.tiers.cost_model import CostModel
from attnstore_client.tiers.local_exact import LocalExactTier
from attnstore_client.tiers.prefix import DEFAULT_MIN_PREFIX_TOKENS, serve_prefixes
from attnstore_client.tiers.write_back import WriteBackWorker

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PrefillSettings:
    """How calls use the store (see ``AttnCache`` for the user-facing defaults)."""

    namespace: str
    max_distance: float  # threshold on the predicted map distance (when not gated)
    exact: bool  # use the exact tiers (node-local and the store's)
    stream: bool  # start replay while maps still arrive
    timeout: float | None  # deadline of one store call (an exact window, a search, a hit batch's maps)
    retry: RetryPolicy
    gate: bool = False  # decide map hits with the namespace's fidelity gate instead of max_distance
    maps: bool = True  # use the map tier (search and replay) at all
    window: int = 512  # rows per exact-tier call (at most the daemon's --max-queries)
    prefix: bool = True  # start rows from stored prefixes (causal namespaces that store prefix blocks)
    prefix_min_tokens: int = DEFAULT_MIN_PREFIX_TOKENS  # shorter stored prefixes are not fetched


@dataclass(slots=True)
class CallCounts:
    """Mutable tallies of one call, turned into a ``CacheStats`` at its end."""

    rows: int = 0
    deduplicated: int = 0  # rows answered by an identical row of the same call
    local_hits: int = 0  # distinct rows the node-local exact tier answered
    exact_hits: int = 0  # distinct rows the store's exact tier answered
    map_hits: int = 0
    prefix_hits: int = 0  # distinct rows whose forward ran on the suffix only
    prefix_tokens: int = 0  # prompt tokens those rows took from stored prefixes (not computed)
    misses: int = 0
    skipped: int = 0  # distinct rows the cost model kept from a map lookup (computed)
    fallbacks: dict[str, int] = field(default_factory=dict)
    bytes_fetched: int = 0
    projection_s: float = 0.0
    lookup_s: float = 0.0  # exact-tier calls and searches, retries included
    fetch_s: float = 0.0
    forward_s: float = 0.0
    # Per input row, in input order: "exact", "prefix", "map", "miss" or "fallback" (a copy takes its original's).
    row_kinds: list[str] = field(default_factory=list)

    def fallback(self, cause: str, rows: int) -> None:
        """Count ``rows`` computed because of ``cause``."""
        if rows:
            self.fallbacks[cause] = self.fallbacks.get(cause, 0) + rows


class _StreamedLayers(Sequence[torch.Tensor]):
    """One hit row's maps for the adapter: layer ``i`` is fetched (and waited for) when the forward reaches it."""

    def __init__(self, stream: MapStream, row: int, layers: int, device: torch.device) -> None:
        self._stream = stream
        self._row = row
        self._layers = layers
        self._device = device

    def __len__(self) -> int:
        return self._layers

    @overload
    def __getitem__(self, layer: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, layer: slice) -> Sequence[torch.Tensor]: ...

    def __getitem__(self, layer: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        if isinstance(layer, slice):
            return [self[i] for i in range(*layer.indices(self._layers))]
        return to_device(self._stream.layer(self._row, layer), self._device)  # (heads, L', L')


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` as a tensor on ``device``: zero-copy on the CPU; through pinned memory to a GPU."""
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class Prefill:
    """Runs calls of one model against one namespace of a store.

    Args:
        adapter: the model's adapter (its model on ``device``).
        connection: the store.
        fingerprint: the model's fingerprint (checked against the namespace by the caller).
        projector: the namespace's projector; None while the namespace has none (exact tiers only).
        settings: thresholds, deadlines, retries.
        breaker: shared by every call of this client.
        local_tier: the node-local exact tier.
        cost_model: decides which rows are sent for maps.
        device: where the model runs.
        seed: seed of the retry jitter.

    Attributes:
        projector_version: the namespace's version of ``projector``; searches state it.
        reload_namespace: reads the namespace again (its projector, version, threshold and gate)
            when a search is told its projector was replaced; None leaves that a failed call.
        write_back: where the rows this node computes go when the store admits them; None: nowhere.
    """

    def __init__(
        self,
        adapter: Adapter,
        connection: StoreConnection,
        *,
        fingerprint: str,
        projector: Projector | None,
        settings: PrefillSettings,
        breaker: CircuitBreaker,
        local_tier: LocalExactTier,
        cost_model: CostModel,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        self.adapter = adapter
        self.connection = connection
        self.fingerprint = fingerprint
        self.projector = projector
        self.settings = settings
        self.breaker = breaker
        self.local_tier = local_tier
        self.cost_model = cost_model
        self.device = device
        self._pad = adapter.loaded.tokenizer.pad_token_id
        self._rng = random.Random(seed)
        self.projector_version = 0
        self.prefix_layout: PrefixLayout | None = None  # the namespace's, for a causal model; None: no prefix tier
        self.reload_namespace: Callable[[], None] | None = None
        self.write_back: WriteBackWorker | None = None
        self._computed_tokens = 0  # padded tokens of computed rows forwarded so far
        self._capturing_tokens = 0  # of those, the ones in batches that kept maps (held to capture_share)

    def hidden_states(
        self, rows: Sequence[Sequence[int]], counts: CallCounts, *, batch_size: int, progress: bool = False
    ) -> list[torch.Tensor]:
        """Each row's last hidden states ``(L, hidden)`` fp32 on the device, in input order.

        Args:
            rows: token id rows (special tokens included), each non-empty.
            counts: tallies of the current call, updated in place.
            batch_size: rows per forward.
            progress: a bar over the rows computed.
        """
        keys = [token_hash(row) for row in rows]
        first: dict[bytes, int] = {}
        for index, key in enumerate(keys):
            first.setdefault(key, index)
        distinct = list(first.values())
        counts.rows += len(rows)
        counts.deduplicated += len(rows) - len(distinct)
        done: dict[int, torch.Tensor] = {}
        kinds: dict[int, str] = {}
        local = self._from_local_tier(distinct, keys, done, kinds) if self.settings.exact else 0
        counts.local_hits += local
        pending = [i for i in distinct if i not in done]
        reachable = bool(pending) and self._store_allowed(pending, kinds, counts)
        admitted: set[int] = set()  # missed rows the store asks this node to write back
        if reachable and self.settings.exact:
            reachable = self._from_store_exact(pending, rows, keys, done, kinds, counts, admitted)
        rest = [i for i in distinct if i not in done]
        if reachable and self.settings.prefix and self.prefix_layout is not None and rest:
            reachable = serve_prefixes(self, self.prefix_layout, rest, rows, done, kinds, counts, batch_size)
            rest = [i for i in rest if i not in done]
        hits: dict[int, Match] = {}
        features: dict[int, tuple[np.ndarray, int]] = {}  # row -> its projected feature (d,) and projector version
        if reachable and self.settings.maps and self.projector is not None and rest:
            asked = [i for i in rest if i not in kinds and self.cost_model.should_ask(len(rows[i]))]
            counts.skipped += sum(i not in kinds for i in rest) - len(asked)
            hits = self._search(asked, rows, kinds, counts, batch_size, features)
        keep = self._maps_to_keep(admitted, hits, features, rows)
        maps: dict[int, torch.Tensor] = {}  # kept row -> (layers, heads, L, L) fp16
        with tqdm(total=len(rest), desc="rows", unit="row", disable=not progress) as bar:
            # Hits and the rows to compute share length-sorted batches: a hit replays inside its
            # batch, so batching after the lookup pads no more than the plain model does.
            for batch_rows, batch in self._batches(sorted(rest, key=lambda i: -len(rows[i])), rows, batch_size):
                self._forward_batch(batch_rows, batch, hits, done, kinds, counts, keep, maps)
                bar.update(len(batch_rows))
        computed = [i for i in rest if kinds.get(i) != "map"]
        for i in computed:
            kinds.setdefault(i, "miss")
            if self.settings.exact:
                # Only what the plain model computed: replayed rows are within the maps' fidelity, not exact.
                outputs = done[i].cpu().numpy()  # (L, hidden) fp32
                self.local_tier.put(self._local_key(keys[i]), outputs)
                if i in admitted and self.write_back is not None:
                    self._write_back(rows[i], outputs, maps.get(i), features.get(i))
        counts.exact_hits += sum(kinds[i] == "exact" for i in distinct) - local
        counts.map_hits += sum(kinds[i] == "map" for i in distinct)
        counts.prefix_hits += sum(kinds[i] == "prefix" for i in distinct)
        counts.misses += sum(kinds[i] == "miss" for i in distinct)
        counts.row_kinds.extend(kinds[first[key]] for key in keys)
        return [done[first[key]] for key in keys]

    # ---- write-back -------------------------------------------------------------

    def _maps_to_keep(
        self, admitted: set[int], hits: dict[int, Match], features: dict[int, tuple[np.ndarray, int]],
        rows: Sequence[Sequence[int]],
    ) -> set[int]:
        """The admitted rows whose maps are captured in their forward, to be written back with them.

        Their length is one replay pays at, their maps fit one message, and they have the
        feature of their map lookup; in a namespace without a projector every such row
        qualifies (its feature is computed once a projector is trained).
        """
        if self.write_back is None or not self.settings.exact:
            return set()
        per_token = 2 * self.adapter.num_layers * self.adapter.num_heads  # fp16 bytes per L*L
        limit = self.write_back.settings.max_row_map_bytes
        return {
            i for i in admitted
            if i not in hits
            and (self.projector is None or i in features)
            and per_token * len(rows[i]) ** 2 <= limit
            and self.cost_model.replay_pays(len(rows[i]))
        }

    def _write_back(
        self, token_ids: Sequence[int], outputs: np.ndarray, maps: torch.Tensor | None,
        feature: tuple[np.ndarray, int] | None,
    ) -> None:
        """Queue one admitted row (never blocks: a full queue drops it)."""
        assert self.write_back is not None  # the caller checked
        if maps is None:
            self.write_back.put(token_ids, outputs)
            return
        # A feature from a projector replaced since the lookup would be refused: the maps go without it.
        vector, version = feature if feature is not None and feature[1] == self.projector_version else (None, 0)
        self.write_back.put(token_ids, outputs, maps, vector, version)

    # ---- the tiers ------------------------------------------------------------

    def _local_key(self, key: bytes) -> bytes:
        return self.fingerprint.encode() + key

    def _from_local_tier(
        self, rows: list[int], keys: list[bytes], done: dict[int, torch.Tensor], kinds: dict[int, str]
    ) -> int:
        """Answer what the node-local exact tier holds; returns how many rows it answered."""
        answered = 0
        for i in rows:
            outputs = self.local_tier.get(self._local_key(keys[i]))
            if outputs is not None:
                done[i] = to_device(outputs, self.device).float()  # (L, hidden)
                kinds[i] = "exact"
                answered += 1
        return answered

    def _store_allowed(self, rows: list[int], kinds: dict[int, str], counts: CallCounts) -> bool:
        """Whether the store may be asked now; if not, ``rows`` are computed as fallbacks."""
        if self.breaker.allow():
            return True
        counts.fallback("circuit_open", len(rows))
        kinds.update({i: "fallback" for i in rows})
        return False

    def _from_store_exact(
        self, rows: list[int], tokens: Sequence[Sequence[int]], keys: list[bytes], done: dict[int, torch.Tensor],
        kinds: dict[int, str], counts: CallCounts, admitted: set[int],
    ) -> bool:
        """Ask the store's exact tier a window at a time; False (rows counted as fallbacks) when it failed.

        The missed rows the store admits for write-back are added to ``admitted``.
        """
        for start in range(0, len(rows), self.settings.window):
            window = rows[start : start + self.settings.window]
            lengths = [len(tokens[i]) for i in window]
            reply = self._call(partial(self._exact, [keys[i] for i in window], lengths), rows[start:], kinds, counts)
            if reply is None:
                return False
            found, admit = reply
            admitted.update(window[position] for position in admit)
            for position, outputs in found.items():
                i = window[position]
                counts.bytes_fetched += outputs.nbytes
                done[i] = to_device(outputs, self.device).float()  # (L, hidden)
                kinds[i] = "exact"
                self.local_tier.put(self._local_key(keys[i]), outputs)
        return True

    def _search(
        self, rows: list[int], tokens: Sequence[Sequence[int]], kinds: dict[int, str], counts: CallCounts,
        batch_size: int, features: dict[int, tuple[np.ndarray, int]],
    ) -> dict[int, Match]:
        """Project and search ``rows`` a batch at a time; the map hits by row.

        Each projected row's feature and the projector version it came from are added to ``features``
        (a written-back row carries it, so the store indexes it without projecting again).
        """
        assert self.projector is not None  # the caller checked: no map tier without one
        hits: dict[int, Match] = {}
        ordered = sorted(rows, key=lambda i: -len(tokens[i]))
        for start in range(0, len(ordered), batch_size):
            chunk = ordered[start : start + batch_size]
            started = time.perf_counter()
            batch = self._batch([tokens[i] for i in chunk])
            projected_features = self.projector.project(self.adapter.feature_source(batch))  # (B, d)
            projected = time.perf_counter()
            counts.projection_s += projected - started
            features.update((i, (projected_features[k], self.projector_version)) for k, i in enumerate(chunk))
            chunk_tokens = [tokens[i] for i in chunk]
            request = self._search_request(projected_features, batch, chunk_tokens)
            matches = self._call(partial(self._searched, request, batch, chunk_tokens), ordered[start:], kinds, counts)
            if matches is None:
                break
            found = {i: m for i, m in zip(chunk, matches, strict=True) if m.kind == "map" and m.entry_id is not None}
            hits.update(found)
            seconds = time.perf_counter() - started
            for length, group in _by_band([len(tokens[i]) for i in chunk]).items():
                group_hits = sum(chunk[k] in found for k in group)
                self.cost_model.record_lookup(length, len(group), group_hits, seconds * len(group) / len(chunk))
        return hits

    def _exact(
        self, hashes: list[bytes], lengths: list[int], remaining: float | None
    ) -> tuple[dict[int, np.ndarray], frozenset[int]]:
        namespace, fingerprint = self.settings.namespace, self.fingerprint
        if self.write_back is None:
            return self.connection.exact(namespace, fingerprint, hashes, lengths, timeout=remaining), frozenset()
        return self.connection.exact_admitting(namespace, fingerprint, hashes, lengths, timeout=remaining)

    def _search_request(self, features: np.ndarray, batch: Batch, tokens: list[Sequence[int]]) -> LookupBatch:
        return LookupBatch(
            self.settings.namespace, self.fingerprint, features, batch.lengths,
            token_ids=tokens if self.settings.gate else None,
            max_distance=self.settings.max_distance, gate=self.settings.gate, projector_version=self.projector_version,
        )

    def _searched(
        self, request: LookupBatch, batch: Batch, tokens: list[Sequence[int]], remaining: float | None
    ) -> list[Match]:
        """Search ``request``; when the namespace's projector was replaced meanwhile, load the new one and
        search again with the batch projected by it (the store is fine: the breaker is not told)."""
        try:
            return self.connection.search(request, timeout=remaining)
        except ProjectorChangedError as exc:
            if self.reload_namespace is None:
                raise
            log.warning("namespace %r: its projector was replaced, following it (%s)", self.settings.namespace, exc)
            self.reload_namespace()
            assert self.projector is not None  # a replaced projector is a projector
            features = self.projector.project(self.adapter.feature_source(batch))  # (B, d)
            return self.connection.search(self._search_request(features, batch, tokens), timeout=remaining)

    def _call(
        self, call: Callable[[float | None], T], rows: list[int], kinds: dict[int, str], counts: CallCounts
    ) -> T | None:
        """A store call with retries; None (``rows`` counted as fallbacks, the breaker told) when it failed."""
        started = time.perf_counter()
        try:
            result = call_with_retries(call, self.settings.retry, timeout=self.settings.timeout, rng=self._rng)
        except AttnStoreError as exc:
            log.warning("store call failed, computing %d rows: %s", len(rows), exc)
            self.breaker.record_failure()
            unanswered = [i for i in rows if i not in kinds]
            counts.fallback(cause_of(exc), len(unanswered))
            kinds.update({i: "fallback" for i in unanswered})
            return None
        finally:
            counts.lookup_s += time.perf_counter() - started
        self.breaker.record_success()
        return result

    # ---- forwards -------------------------------------------------------------

    def _batch(self, rows: Sequence[Sequence[int]]) -> Batch:
        return batch_from_ids(rows, self._pad).to(self.device)

    def _batches(
        self, ordered: list[int], tokens: Sequence[Sequence[int]], batch_size: int
    ) -> Iterator[tuple[list[int], Batch]]:
        """Forwards of the rows ``ordered`` (longest first), at most ``batch_size`` rows each; once forward
        times are fitted, rows far shorter than a forward's longest get their own where that is faster."""
        cost = self.cost_model.forward_cost()
        lengths = [len(tokens[i]) for i in ordered]
        for group in group_by_length(lengths, batch_size, None if cost is None else cost.seconds):
            chunk = ordered[group]
            yield chunk, self._batch([tokens[i] for i in chunk])

    def _forward_batch(
        self, rows: list[int], batch: Batch, hits: dict[int, Match], done: dict[int, torch.Tensor],
        kinds: dict[int, str], counts: CallCounts, keep: set[int], maps: dict[int, torch.Tensor],
    ) -> None:
        """One forward of ``batch``: its map hits replay their entries' maps, the other rows compute.

        A hit whose maps fail (fetch, checksum, deadline, outage) is computed in the same
        forward and counted as a fallback. The maps of the computed rows in ``keep`` are
        kept, into ``maps`` by row.
        """
        started = time.perf_counter()
        slots = {position: i for position, i in enumerate(rows) if i in hits}  # batch position -> row
        keeping = self._keeping(rows, keep, max(batch.lengths) * (batch.size - len(slots)))
        replayed: list[int] = []
        if not slots:
            out, kept = self._forward(batch, keeping)  # (B, P, hidden)
        else:
            out, replayed, kept = self._replaying(batch, slots, hits, kinds, counts, keeping)
        maps.update((rows[position], row_maps) for position, row_maps in kept.items())
        seconds = time.perf_counter() - started
        counts.forward_s += seconds
        padded = max(batch.lengths)
        self.cost_model.record_forward(
            padded, computed_tokens=padded * (batch.size - len(replayed)), replayed_tokens=padded * len(replayed),
            seconds=seconds,
        )
        for position, i in enumerate(rows):
            done[i] = out[position, : batch.lengths[position]]  # (L, hidden)
        for position in replayed:
            kinds[rows[position]] = "map"

    def _keeping(self, rows: list[int], keep: set[int], computed_tokens: int) -> list[int]:
        """The batch positions whose maps this forward keeps: those of ``keep`` while batches that kept maps
        hold at most ``capture_share`` of the computed tokens so far (past it the rows go back with outputs
        only), so the capture's cost stays a bounded share of the miss path."""
        keeping = [position for position, i in enumerate(rows) if i in keep]
        within = self.write_back is not None and (
            self._capturing_tokens <= self.write_back.settings.capture_share * self._computed_tokens
        )
        self._computed_tokens += computed_tokens
        if not keeping or not within:
            return []
        self._capturing_tokens += computed_tokens
        return keeping

    def _forward(
        self, batch: Batch, keeping: list[int], replay: dict[int, _StreamedLayers] | None = None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The adapter's forward, keeping the maps of the rows at ``keeping`` when there are any."""
        if keeping:
            return self.adapter.forward_keeping(batch, keeping, replay)  # (B, P, hidden), kept maps
        return self.adapter.forward(batch, replay), {}  # (B, P, hidden)

    def _replaying(
        self, batch: Batch, slots: dict[int, int], hits: dict[int, Match], kinds: dict[int, str], counts: CallCounts,
        keeping: list[int],
    ) -> tuple[torch.Tensor, list[int], dict[int, torch.Tensor]]:
        """The forward of a batch with hits (batch position -> row in ``slots``), the positions that replayed,
        and the maps kept of the computed positions in ``keeping``."""
        positions = sorted(slots)
        entries = [(int(hits[slots[p]].entry_id or 0), batch.lengths[p]) for p in positions]
        try:
            stream = self.connection.fetch_maps(
                self.settings.namespace, self.fingerprint, entries, timeout=self.settings.timeout
            )
        except AttnStoreError as exc:
            log.warning("maps of %d hits could not be fetched, computing them: %s", len(positions), exc)
            self.breaker.record_failure()
            counts.fallback(cause_of(exc), len(positions))
            kinds.update({slots[p]: "fallback" for p in positions})
            out, kept = self._forward(batch, keeping)  # (B, P, hidden)
            return out, [], kept
        failed: dict[int, str] = {}  # stream row -> cause
        try:
            if not self.settings.stream:
                stream.wait()
            out, kept = self._forward_replaying(batch, positions, stream, failed, keeping)  # (B, P, hidden)
        finally:
            stream.close()
            counts.bytes_fetched += stream.bytes_fetched
            counts.fetch_s += stream.fetch_seconds
        if stream.outage is not None:
            self.breaker.record_failure()
        for k, cause in failed.items():
            kinds[slots[positions[k]]] = "fallback"
            counts.fallback(cause, 1)
        return out, [p for k, p in enumerate(positions) if k not in failed], kept

    def _forward_replaying(
        self, batch: Batch, positions: list[int], stream: MapStream, failed: dict[int, str], keeping: list[int]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The forward with the batch rows at ``positions`` replaying stream rows 0, 1, ..., less those whose
        maps fail (added to ``failed`` by stream row), keeping the maps of the rows at ``keeping``.

        Each rerun after a row's maps stopped mid-forward drops at least that row,
        so there are at most ``len(positions)`` reruns.
        """
        for _ in range(len(positions) + 1):
            failed.update(stream.failed())
            replay = {
                position: _StreamedLayers(stream, k, self.adapter.num_layers, self.device)
                for k, position in enumerate(positions)
                if k not in failed
            }
            try:
                return self._forward(batch, keeping, replay)  # (B, P, hidden), kept maps
            except MapsUnavailableError as exc:
                # Let the stream settle, then run again with every failed row computed.
                log.warning("replay of a row interrupted (%s); running the batch again", exc.cause)
                failed.setdefault(exc.row, exc.cause)
                stream.wait()
        raise AssertionError("a replaying forward kept failing with no row left to drop")  # each pass drops one


def _by_band(lengths: Sequence[int]) -> dict[int, list[int]]:
    """Positions of ``lengths`` grouped by the cost model's length band, keyed by a length of the band."""
    groups: dict[int, list[int]] = {}
    first: dict[int, int] = {}
    for position, length in enumerate(lengths):
        band = CostModel.band_of(length)
        groups.setdefault(first.setdefault(band, length), []).append(position)
    return groups
