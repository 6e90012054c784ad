"""The baselines of the evaluation harness: LazyFormer, SAN and AttnCache-f, as ``Variant``s.

All three are inference-time methods (no retraining) run through
``planned.forward_planned``:

- **LazyFormer**: layers in blocks of two; layer ``2k`` computes its maps and layer
  ``2k+1`` replays them (its own v projection, maps·V and o projection). With an
  odd layer count the last layer computes.
- **SAN**: layer ``l`` reuses the maps of layer ``l-1``'s source where the mean
  Jensen–Shannon divergence between the two layers' maps, measured on
  calibration inputs from the build corpus, is under a threshold.
- **AttnCache-f**: per layer, each row's key is the standardised positional
  pooling of the layer's input hidden states; the nearest stored entry of the
  same token length within that layer's threshold lends its stored maps for
  that layer (see ``LayerKeys``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from attnstore.errors import ConfigError
from attnstore.service import AttnStoreService
from attnstore_client.adapters import Adapter
from attnstore_client.adapters.batch import Batch, batch_from_ids
from attnstore_client.keys import token_hash
from attnstore_client.projector import Projector, ProjectorConfig
from attnstore_tools.eval.planned import LayerPlan, SharedMapsPlan, forward_planned
from attnstore_tools.eval.variants import BatchRun, BatchVariant

log = logging.getLogger(__name__)


# --- layer sharing: LazyFormer and SAN --------------------------------------------


def lazyformer_sources(num_layers: int) -> dict[int, int]:
    """LazyFormer's plan: layer ``2k+1`` reuses layer ``2k``'s maps (an odd last layer computes)."""
    return {layer: layer - 1 for layer in range(1, num_layers, 2)}


@dataclass(frozen=True)
class SanCalibration:
    """SAN's measurement of how alike adjacent layers' maps are.

    Attributes:
        divergences: per adjacent pair ``(l-1, l)`` for ``l = 1 .. layers-1``, the
            mean Jensen–Shannon divergence (nats, in ``[0, ln 2]``) between the two
            layers' per-query-row attention distributions.
        inputs: calibration inputs the means were taken over.
    """

    divergences: tuple[float, ...]
    inputs: int

    def threshold_for(self, share: float) -> float:
        """The JS threshold under which ``round(share * pairs)`` adjacent pairs fall (the most alike ones).

        Raises:
            ConfigError: ``share`` outside ``[0, 1]``.
        """
        if not 0.0 <= share <= 1.0:
            raise ConfigError(f"SanCalibration.threshold_for(): share must be in [0, 1], got {share!r}")
        ranked = sorted(self.divergences)
        count = round(share * len(ranked))
        if count == 0:
            return 0.0
        # Halfway to the next pair's divergence, so that pair stays out.
        upper = ranked[count] if count < len(ranked) else ranked[-1] * 2 + 1e-9
        return (ranked[count - 1] + upper) / 2

    def sources(self, threshold: float) -> dict[int, int]:
        """SAN's plan at a threshold: layer -> the computing layer whose maps it reuses.

        Layer ``l`` reuses where ``divergences[l-1] < threshold``; if layer ``l-1``
        itself reuses, ``l`` takes the same source (the chain's first computing layer).
        """
        sources: dict[int, int] = {}
        for layer, divergence in enumerate(self.divergences, start=1):
            if divergence < threshold:
                sources[layer] = sources.get(layer - 1, layer - 1)
        return sources


def calibrate_san(adapter: Adapter, batches: Iterable[Batch]) -> SanCalibration:
    """Measure adjacent layers' map divergences on calibration batches.

    Each input contributes the mean over its heads and query rows (at its true
    length) of the per-row JS divergence; the result is the mean over inputs.

    Args:
        adapter: the model's adapter.
        batches: calibration batches, texts of the build corpus (never queries).

    Returns:
        The per-pair divergences.

    Raises:
        ConfigError: no calibration input.
    """
    totals = torch.zeros(max(adapter.num_layers - 1, 0), dtype=torch.float64)
    inputs = 0
    for batch in batches:
        for maps in adapter.capture(batch).maps:  # per row (layers, H, L, L)
            totals += _js_divergence(maps[:-1], maps[1:]).mean(dim=(1, 2)).double()  # (layers-1,)
            inputs += 1
    if inputs == 0:
        raise ConfigError("calibrate_san(): no calibration inputs; pass at least one non-empty batch")
    return SanCalibration(divergences=tuple((totals / inputs).tolist()), inputs=inputs)


def _js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen–Shannon divergence of each distribution along the last axis: ``(..., L) -> (...)``."""
    m = (p + q) / 2  # (..., L)
    # xlogy(a, a) - xlogy(a, m) is a·log(a/m) with 0·log 0 = 0 (causal maps hold zeros).
    kl_p = (torch.special.xlogy(p, p) - torch.special.xlogy(p, m)).sum(-1)  # (...)
    kl_q = (torch.special.xlogy(q, q) - torch.special.xlogy(q, m)).sum(-1)  # (...)
    return (kl_p + kl_q) / 2


class _SharingVariant(BatchVariant):
    """A forward in which some layers replay the maps an earlier layer computed, for every row."""

    def __init__(self, adapter: Adapter, sources: Mapping[int, int]) -> None:
        self.adapter = adapter
        self.sources = dict(sources)  # layer -> computing layer whose maps it reuses

    def plan(self) -> SharedMapsPlan:
        """A fresh plan for one forward (``run`` makes its own)."""
        return SharedMapsPlan(self.sources)

    def run(self, batch: Batch) -> BatchRun:
        out = forward_planned(self.adapter, batch, self.plan())  # (B, P, hidden)
        return BatchRun(
            hidden=[out[row, :length] for row, length in enumerate(batch.lengths)],
            layer_replays=batch.size * len(self.sources),
        )


class LazyFormerVariant(_SharingVariant):
    """LazyFormer at inference time: every odd layer reuses the even layer before it."""

    name = "lazyformer"

    def __init__(self, adapter: Adapter) -> None:
        super().__init__(adapter, lazyformer_sources(adapter.num_layers))


class SanVariant(_SharingVariant):
    """SAN at one JS-divergence threshold (the ``setting``)."""

    name = "san"

    def __init__(self, adapter: Adapter, calibration: SanCalibration, threshold: float) -> None:
        """Plan the sharing from a calibration.

        Raises:
            ConfigError: the calibration is for another layer count, or a negative threshold.
        """
        if len(calibration.divergences) != adapter.num_layers - 1:
            raise ConfigError(
                f"SanVariant: calibration of {len(calibration.divergences) + 1} layers, "
                f"the model has {adapter.num_layers}"
            )
        if not threshold >= 0:
            raise ConfigError(f"SanVariant: threshold must be >= 0, got {threshold!r}")
        super().__init__(adapter, calibration.sources(threshold))
        self.calibration = calibration
        self.setting = threshold


# --- per-layer search: AttnCache-f -------------------------------------------------


@dataclass(frozen=True)
class _Bucket:
    """The stored entries of one token length."""

    entry_ids: tuple[int, ...]
    keys: torch.Tensor  # (layers, n, features) standardised pooled keys


class LayerKeys:
    """AttnCache-f's search space: every stored entry's per-layer key, by token length.

    A key is ``Projector.pool`` of the layer's attention input ``(L, hidden)``,
    standardised per layer with the mean and standard deviation over the stored
    entries. Build it once per store with ``build`` and share it across settings.

    Attributes:
        num_layers: layers of the model.
        loo: per layer, each stored entry's distance to its nearest other entry of
            the same length (entries alone in their length are left out).
    """

    def __init__(
        self, pooler: Projector, mean: torch.Tensor, scale: torch.Tensor, buckets: Mapping[int, _Bucket]
    ) -> None:
        """Hold built keys (``build`` makes them) and compute the leave-one-out distances."""
        self._pooler = pooler
        self._mean = mean  # (layers, features)
        self._scale = scale  # (layers, features), > 0
        self._buckets = dict(buckets)
        self.num_layers = int(mean.shape[0])
        self.loo = [_leave_one_out(layer, self._buckets.values()) for layer in range(self.num_layers)]

    @classmethod
    def build(
        cls,
        adapter: Adapter,
        service: AttnStoreService,
        namespace: str,
        corpus_ids: Sequence[Sequence[int]],
        *,
        batch_size: int = 16,
        pad_id: int | None = None,
    ) -> LayerKeys:
        """Compute the stored entries' keys by running the plain model on their token ids.

        Args:
            adapter: the model's adapter.
            service: the store the namespace lives in.
            namespace: the namespace built from ``corpus_ids``.
            corpus_ids: the build corpus as token-id rows; rows the namespace does
                not hold (skipped or evicted) are left out, repeats count once.
            batch_size: rows per forward (rows are sorted by length first).
            pad_id: id of pad positions; None takes the tokenizer's.

        Returns:
            The keys.

        Raises:
            ConfigError: none of the rows is stored in the namespace.
        """
        entries: dict[int, tuple[int, ...]] = {}  # entry id -> token ids
        for ids in corpus_ids:
            entry_id = service.store.find_by_hash(namespace, token_hash(list(ids)))
            if entry_id is not None:
                entries.setdefault(entry_id, tuple(ids))
        if not entries:
            raise ConfigError(f"LayerKeys.build(): none of the {len(corpus_ids)} rows is stored in {namespace!r}")
        log.info("AttnCache-f keys: %d entries of %d corpus rows", len(entries), len(corpus_ids))
        if pad_id is None:
            pad_id = adapter.loaded.tokenizer.pad_token_id
        pooler = Projector(ProjectorConfig(hidden=adapter.hidden_size))
        order = sorted(entries, key=lambda entry_id: len(entries[entry_id]))
        pooled = []  # per batch (layers, B, features)
        for start in range(0, len(order), batch_size):
            batch = batch_from_ids([entries[entry_id] for entry_id in order[start : start + batch_size]], pad_id)
            pooled.append(_pooled_inputs(adapter, pooler, batch))
        keys = torch.cat(pooled, dim=1)  # (layers, n, features)
        mean = keys.mean(dim=1)  # (layers, features)
        std = keys.std(dim=1, correction=0)  # (layers, features)
        # A feature constant over the store (e.g. the length features of one length) carries no distance.
        scale = torch.where(std > 0, std, torch.ones_like(std))  # (layers, features)
        keys = (keys - mean[:, None]) / scale[:, None]  # (layers, n, features)
        by_length: dict[int, list[int]] = {}
        for position, entry_id in enumerate(order):
            by_length.setdefault(len(entries[entry_id]), []).append(position)
        buckets = {
            length: _Bucket(tuple(order[p] for p in positions), keys[:, positions])
            for length, positions in by_length.items()
        }
        return cls(pooler, mean, scale, buckets)

    def thresholds(self, q: float) -> list[float]:
        """Per layer, the ``q``-quantile of the leave-one-out distances; ``-inf`` (never replay) at q = 0.

        A layer without any leave-one-out distance (every length stored once) never replays.

        Raises:
            ConfigError: ``q`` outside ``[0, 1]``.
        """
        if not 0.0 <= q <= 1.0:
            raise ConfigError(f"LayerKeys.thresholds(): q must be in [0, 1], got {q!r}")
        if q == 0.0:
            return [-math.inf] * self.num_layers
        return [float(np.quantile(loo, q)) if loo.size else -math.inf for loo in self.loo]

    def keys(self, layer: int, sources: Sequence[torch.Tensor]) -> torch.Tensor:
        """Standardised keys ``(n, features)`` of rows' attention inputs, each ``(L, hidden)``, at a layer."""
        return (self._pooler.pool(sources) - self._mean[layer]) / self._scale[layer]  # (n, features)

    def nearest(self, layer: int, key: torch.Tensor, length: int) -> tuple[int, float] | None:
        """The stored entry of this token length nearest to ``key`` at a layer, and its L2 distance.

        Returns:
            ``(entry_id, distance)``, or None when no entry has that length.
        """
        bucket = self._buckets.get(length)
        if bucket is None:
            return None
        distances = torch.linalg.vector_norm(bucket.keys[layer] - key, dim=1)  # (n,)
        best = int(distances.argmin())
        return bucket.entry_ids[best], float(distances[best])


def _pooled_inputs(adapter: Adapter, pooler: Projector, batch: Batch) -> torch.Tensor:
    """Pooled attention inputs of every layer and row, ``(layers, B, features)``, from a plain forward."""
    pooled: list[torch.Tensor] = []

    def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # (B, P, hidden)
        pooled.append(pooler.pool([hidden[row, :length] for row, length in enumerate(batch.lengths)]))  # (B, F)

    handles = [module.register_forward_pre_hook(record, with_kwargs=True) for module in adapter.attention_modules]
    try:
        adapter.forward(batch)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(pooled)  # (layers, B, features)


def _leave_one_out(layer: int, buckets: Iterable[_Bucket]) -> np.ndarray:
    """Each entry's distance to its nearest other entry of the same length at a layer."""
    nearest = []
    for bucket in buckets:
        if len(bucket.entry_ids) < 2:
            continue
        distances = torch.cdist(bucket.keys[layer], bucket.keys[layer])  # (n, n)
        distances.fill_diagonal_(math.inf)
        nearest.append(distances.min(dim=1).values)  # (n,)
    return torch.cat(nearest).numpy() if nearest else np.empty(0, dtype=np.float32)


class AttnCacheFPlan(LayerPlan):
    """Per layer and row: replay the nearest same-length entry's stored maps if it is close enough.

    Attributes:
        retrieval_s: seconds spent in key pooling, search and map reads.
        replayed: ``(row, layer, entry_id)`` for every layer a row replayed.
    """

    def __init__(
        self, keys: LayerKeys, thresholds: Sequence[float], service: AttnStoreService, namespace: str
    ) -> None:
        self._keys = keys
        self._thresholds = thresholds
        self._service = service
        self._namespace = namespace
        self.retrieval_s = 0.0
        self.replayed: list[tuple[int, int, int]] = []

    def replay(self, layer: int, hidden: torch.Tensor, lengths: Sequence[int]) -> Mapping[int, torch.Tensor]:
        threshold = self._thresholds[layer]
        if threshold == -math.inf:
            return {}
        started = time.perf_counter()
        keys = self._keys.keys(layer, [hidden[row, :length] for row, length in enumerate(lengths)])  # (B, F)
        maps: dict[int, torch.Tensor] = {}
        for row, length in enumerate(lengths):
            found = self._keys.nearest(layer, keys[row], length)
            if found is not None and found[1] <= threshold:
                stored = self._service.read_layer(self._namespace, found[0], layer)  # (H, L, L) fp16
                maps[row] = torch.from_numpy(stored)
                self.replayed.append((row, layer, found[0]))
        self.retrieval_s += time.perf_counter() - started
        return maps


class AttnCacheFVariant(BatchVariant):
    """AttnCache-f at one quantile ``q`` (the ``setting``) of the leave-one-out distances.

    ``map_hits`` counts rows that replayed at least one layer. The service is the
    caller's: ``close`` leaves it open.
    """

    name = "attncache_f"

    def __init__(
        self, adapter: Adapter, service: AttnStoreService, namespace: str, keys: LayerKeys, q: float
    ) -> None:
        """Set the per-layer thresholds from ``q``.

        Raises:
            ConfigError: ``q`` outside ``[0, 1]``, or keys of another layer count.
        """
        if keys.num_layers != adapter.num_layers:
            raise ConfigError(
                f"AttnCacheFVariant: keys of {keys.num_layers} layers, the model has {adapter.num_layers}"
            )
        self.adapter = adapter
        self.service = service
        self.namespace = namespace
        self.keys = keys
        self.setting = q
        self.thresholds = keys.thresholds(q)

    def plan(self) -> AttnCacheFPlan:
        """A fresh plan for one forward (``run`` makes its own)."""
        return AttnCacheFPlan(self.keys, self.thresholds, self.service, self.namespace)

    def run(self, batch: Batch) -> BatchRun:
        plan = self.plan()
        out = forward_planned(self.adapter, batch, plan)  # (B, P, hidden)
        return BatchRun(
            hidden=[out[row, :length] for row, length in enumerate(batch.lengths)],
            retrieval_s=plan.retrieval_s,
            inline_s=plan.retrieval_s,  # keys, search and map reads all happen inside the attention modules
            map_hits=len({row for row, _, _ in plan.replayed}),
            layer_replays=len(plan.replayed),
        )
