"""Siamese training of the feature projector, and the map distance it learns to predict.

Target for a pair of inputs (DESIGN.md "Feature projector"):

    y = alpha * mean per-row total-variation distance of the maps + |L1 - L2|

with the TV term ``1/2 * ||A1[p, :] - A2[p, :]||_1`` averaged over rows p, heads
and layers. Maps of different lengths are compared on their common top-left
block: for causal models that block *is* the shorter input's map under crop
reuse, so the term is exactly the error crop reuse would make. (For
bidirectional models rows of a block do not sum to one and cross-length reuse
never happens; the value is defined but only causal training uses it.)

The projector predicts the map term only: the prediction is the L2 distance of
the two projections, and the exact length term is added by the index when it
searches longer buckets. So same-length pairs train on the full target, and
cross-length (crop) pairs, used for causal models, on ``y - |L1 - L2|``.

Random pairs are almost all far apart, so pairs are mined: within a length
bucket, each input's nearest neighbours under a cheap estimate (L2 between the
projector's standardised pooled inputs), labelled with true map distances;
random same-length pairs, identical pairs (distance 0) and, for causal models,
random crop pairs are mixed in. Validation inputs are held out: their pairs go
against training inputs, as queries go against a store.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from attnstore.errors import CorpusError, MapShapeError
from attnstore_client.projector import Projector, ProjectorConfig

logger = logging.getLogger(__name__)

# Fewest inputs we train on: below this a validation split cannot hold out
# enough inputs for early stopping to mean anything.
MIN_CORPUS = 16
# Queries per block when mining neighbours by the cheap estimate.
_MINING_BLOCK = 1024
# Elements of the fp32 difference tensor per block in ``map_distances`` (64 MB).
_BLOCK_ELEMENTS = 16 * 1024 * 1024


def map_distances(
    query_maps: torch.Tensor, candidate_maps: torch.Tensor, *, alpha: float = 0.2
) -> np.ndarray:
    """Training target between one input's maps and many same-length candidates.

    Args:
        query_maps: (layers, heads, L, L) maps of the query, fp16 or fp32.
        candidate_maps: (n, layers, heads, L', L') maps of n candidates of one length L'.
        alpha: weight of the TV term (paper: 0.2).
    Returns:
        (n,) float64: ``alpha * TV + |L - L'|``, TV on the common top-left block.
    Raises:
        MapShapeError: shapes that are not maps, or layers/heads that differ.
    """
    if query_maps.ndim != 4 or query_maps.shape[-1] != query_maps.shape[-2]:
        raise MapShapeError(f"map_distances(): query maps must be (layers, heads, L, L), got {tuple(query_maps.shape)}")
    if candidate_maps.ndim != 5 or candidate_maps.shape[-1] != candidate_maps.shape[-2]:
        raise MapShapeError(
            f"map_distances(): candidate maps must be (n, layers, heads, L, L), got {tuple(candidate_maps.shape)}"
        )
    if candidate_maps.shape[1:3] != query_maps.shape[:2]:
        raise MapShapeError(
            f"map_distances(): candidates have (layers, heads) {tuple(candidate_maps.shape[1:3])}, "
            f"the query {tuple(query_maps.shape[:2])}"
        )
    length, stored = query_maps.shape[-1], candidate_maps.shape[-1]
    m = min(length, stored)
    query = query_maps[..., :m, :m].to(torch.float32)  # (layers, heads, m, m)
    per_item = query.numel()
    per_block = max(1, _BLOCK_ELEMENTS // per_item)
    tv = []
    for start in range(0, candidate_maps.shape[0], per_block):
        block = candidate_maps[start : start + per_block, ..., :m, :m].to(torch.float32)  # (c, layers, heads, m, m)
        rows = 0.5 * (block - query).abs().sum(dim=-1)  # (c, layers, heads, m)
        tv.append(rows.mean(dim=(1, 2, 3)).double())
    if not tv:
        return np.empty(0, dtype=np.float64)
    return alpha * torch.cat(tv).numpy() + abs(length - stored)


def map_distance(a: torch.Tensor, b: torch.Tensor, alpha: float = 0.2) -> float:
    """Training target between two inputs' maps, each (layers, heads, L, L); see ``map_distances``."""
    return float(map_distances(a, b.unsqueeze(0), alpha=alpha)[0])


def rank_correlation(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties); ``nan`` if either side is constant."""
    rx, ry = _average_ranks(np.asarray(x, dtype=np.float64)), _average_ranks(np.asarray(y, dtype=np.float64))
    if rx.size < 2 or rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def _average_ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    ranks = np.empty(values.size, dtype=np.float64)
    ranks[order] = np.arange(values.size, dtype=np.float64)
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return sums[inverse] / counts[inverse]


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Settings of ``train_projector``; every default is what ``attnstore build`` uses."""

    alpha: float = 0.2  # weight of the TV term in the target (paper: 0.2)
    causal: bool = False  # causal model: also train crop pairs against longer inputs
    segments: int = 16  # projector pooling bins (see ProjectorConfig)
    width: int = 64  # projector first-layer units per slot
    dim: int = 128  # projector output size
    dropout: float = 0.1  # projector dropout while training
    # Mined nearest neighbours per input, within its length: the pairs that decide
    # top-1 (12 ranked held-out STS-B pairs better than 6 in our measurements).
    neighbours: int = 12
    random_pairs: int = 4  # random same-length partners per input: the far end of the scale
    crop_pairs: int = 2  # random longer partners per input, causal only
    duplicate_fraction: float = 0.05  # identical pairs (target 0) as a share of mined+random
    val_fraction: float = 0.15  # share of inputs held out for validation
    batch_size: int = 512  # pairs per step
    lr: float = 1e-3  # Adam learning rate
    weight_decay: float = 1e-4  # AdamW decoupled weight decay
    # Smooth L1 turns linear past beta, in units of the mean training target; 0.1
    # keeps the loss linear (robust) on all but the closest predictions.
    smooth_l1_beta: float = 0.1
    max_epochs: int = 60  # upper bound; early stopping usually ends sooner
    patience: int = 6  # epochs without a better validation loss before stopping
    seed: int = 0  # seeds the split, the mining, the weights and the batches
    progress: bool = True  # tqdm bar over epochs


@dataclass(frozen=True, slots=True)
class TrainReport:
    """What training did and how well the result ranks held-out pairs."""

    epochs: int  # epochs run, including the patience window past the best
    best_epoch: int  # 1-based epoch whose weights were kept
    train_loss: tuple[float, ...]  # per epoch, in units of the mean training target
    val_loss: tuple[float, ...]  # per epoch, same unit
    val_spearman: float  # predicted vs true distance over all validation pairs
    val_spearman_mean_pooled: float  # same, for L2 between mean-pooled input embeddings
    val_spearman_per_query: float  # within each validation input's pairs, averaged
    val_spearman_per_query_mean_pooled: float  # same, for the mean-pooled key
    train_items: int
    val_items: int
    train_pairs: int
    val_pairs: int
    seconds: float


@dataclass(frozen=True, slots=True)
class _Pairs:
    left: np.ndarray  # (p,) int64 input indices
    right: np.ndarray  # (p,) int64
    target: np.ndarray  # (p,) float32 full target, alpha * TV + |dL|
    gap: np.ndarray  # (p,) float32 |dL|, the part the index adds


def train_projector(
    sources: Sequence[torch.Tensor],
    maps: Sequence[torch.Tensor],
    *,
    config: TrainConfig = TrainConfig(),
) -> tuple[Projector, TrainReport]:
    """Train a feature projector on a corpus' feature sources and attention maps.

    Args:
        sources: per input, its (L, hidden) feature source.
        maps: per input, its (layers, heads, L, L) maps (fp16 or fp32); may be a lazy
            sequence: each map is read when its pairs are labelled.
        config: training settings.
    Returns:
        The trained projector (eval mode, best validation weights) and a report.
    Raises:
        CorpusError: fewer than ``MIN_CORPUS`` inputs, or fewer than 3 of any one length.
        MapShapeError: a map whose shape does not match its source.
        FeatureSourceError: a source of the wrong shape or holding NaN/Inf.
    """
    started = time.perf_counter()
    lengths = _check_corpus(sources, maps, causal=config.causal)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        rng = np.random.default_rng(config.seed)
        hidden = int(sources[0].shape[1])
        shape = ProjectorConfig(
            hidden, segments=config.segments, width=config.width, dim=config.dim, dropout=config.dropout
        )
        projector = Projector(shape)
        with torch.no_grad():
            pooled = projector.pool(sources)  # (n, features)
        train_idx, val_idx = _split(lengths, config.val_fraction, rng, causal=config.causal)
        mean = pooled[train_idx].mean(dim=0)
        std = pooled[train_idx].std(dim=0)
        # Constant features (e.g. length in a one-length corpus) must not divide by ~0.
        projector.set_standardisation(mean, torch.where(std > 1e-6, std, torch.ones_like(std)))
        cheap = ((pooled - projector.feature_mean) / projector.feature_scale).numpy()  # (n, features)
        # Validation inputs are queried against training inputs, as queries go against a store.
        train_sample = _sample_pairs(cheap, lengths, train_idx, train_idx, config, rng, symmetric=True)
        val_sample = _sample_pairs(cheap, lengths, val_idx, train_idx, config, rng, symmetric=False)
        train_pairs = _label(train_sample, maps, lengths, config.alpha)
        val_pairs = _label(val_sample, maps, lengths, config.alpha)
        if train_pairs.left.size == 0 or val_pairs.left.size == 0:
            raise CorpusError("train_projector(): no same-length pairs to train or validate on")
        logger.info(
            "projector training: %s train inputs, %s val inputs, %s train pairs, %s val pairs",
            train_idx.size, val_idx.size, train_pairs.left.size, val_pairs.left.size,
        )
        train_loss, val_loss, best_epoch = _fit(projector, pooled, train_pairs, val_pairs, config)
    projector.eval()
    with torch.no_grad():
        projected = projector(pooled).numpy()  # (n, dim)
    means = torch.stack([s.detach().float().mean(dim=0) for s in sources]).numpy()  # (n, hidden)
    predicted = np.linalg.norm(projected[val_pairs.left] - projected[val_pairs.right], axis=1) + val_pairs.gap
    simple = np.linalg.norm(means[val_pairs.left] - means[val_pairs.right], axis=1) + val_pairs.gap
    report = TrainReport(
        epochs=len(train_loss),
        best_epoch=best_epoch,
        train_loss=tuple(train_loss),
        val_loss=tuple(val_loss),
        val_spearman=rank_correlation(predicted, val_pairs.target),
        val_spearman_mean_pooled=rank_correlation(simple, val_pairs.target),
        val_spearman_per_query=_per_query_correlation(val_pairs.left, predicted, val_pairs.target),
        val_spearman_per_query_mean_pooled=_per_query_correlation(val_pairs.left, simple, val_pairs.target),
        train_items=int(train_idx.size),
        val_items=int(val_idx.size),
        train_pairs=int(train_pairs.left.size),
        val_pairs=int(val_pairs.left.size),
        seconds=time.perf_counter() - started,
    )
    logger.info(
        "projector trained: %s epochs (best %s), val Spearman %.3f (mean-pooled key %.3f)",
        report.epochs, report.best_epoch, report.val_spearman, report.val_spearman_mean_pooled,
    )
    return projector, report


def _check_corpus(sources: Sequence[torch.Tensor], maps: Sequence[torch.Tensor], *, causal: bool) -> np.ndarray:
    """Token lengths of the corpus after checking sizes and shapes.

    Causal models also train on crop pairs (an input against a longer one), so
    they need no length shared by three inputs: long prompts rarely share one.
    """
    if len(sources) != len(maps):
        raise MapShapeError(f"train_projector(): {len(sources)} sources but {len(maps)} maps")
    if len(sources) < MIN_CORPUS:
        raise CorpusError(
            f"train_projector(): the corpus has {len(sources)} inputs; training needs at least {MIN_CORPUS}"
        )
    lengths = np.array([int(s.shape[0]) for s in sources], dtype=np.int64)
    layout = tuple(maps[0].shape[:2])
    for i, (length, m) in enumerate(zip(lengths, maps, strict=True)):
        if m.ndim != 4 or tuple(m.shape[:2]) != layout or tuple(m.shape[2:]) != (length, length):
            expected = layout + (int(length), int(length))
            raise MapShapeError(f"train_projector(): maps {i} have shape {tuple(m.shape)}, expected {expected}")
    _, counts = np.unique(lengths, return_counts=True)
    if counts.max() < 3 and not causal:
        raise CorpusError(
            "train_projector(): training needs at least 3 inputs of one token length "
            f"(a train pair and a held-out query); the most of any length here is {counts.max()}"
        )
    return lengths


def _split(
    lengths: np.ndarray, val_fraction: float, rng: np.random.Generator, *, causal: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Hold out inputs for validation, leaving each held-out length at least two training inputs.

    Causal corpora may also hold out an input with a longer one left in training
    (its crop pairs validate it), which is what corpora of long, rarely
    same-length prompts rely on.
    """
    values, counts = np.unique(lengths, return_counts=True)
    left_in_train = dict(zip(values.tolist(), counts.tolist(), strict=True))
    target = max(1, int(round(val_fraction * lengths.size)))
    longest = int(lengths.max())
    val = []
    for i in rng.permutation(lengths.size):
        if len(val) == target:
            break
        length = int(lengths[i])
        if left_in_train[length] > 2 or (causal and length < longest):
            left_in_train[length] -= 1
            val.append(int(i))
    is_val = np.zeros(lengths.size, dtype=bool)
    is_val[val] = True
    return np.flatnonzero(~is_val), np.flatnonzero(is_val)


def _sample_pairs(
    cheap: np.ndarray,
    lengths: np.ndarray,
    queries: np.ndarray,
    pool: np.ndarray,
    config: TrainConfig,
    rng: np.random.Generator,
    *,
    symmetric: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (query, pool input): mined and random same-length, identical, and causal crop pairs.

    ``symmetric`` says queries and pool are the same inputs, so (a, b) and (b, a) count once.
    """
    pairs: set[tuple[int, int]] = set()
    for length in np.unique(lengths[queries]):
        q = queries[lengths[queries] == length]
        p = pool[lengths[pool] == length]
        k = min(config.neighbours, p.size - (1 if symmetric else 0))
        pool_features = torch.from_numpy(cheap[p])
        # Blocks of queries bound the distance matrix of a big bucket (10K x 10K floats is 400 MB).
        for start in range(0, q.size if k > 0 else 0, _MINING_BLOCK):
            block = q[start : start + _MINING_BLOCK]
            distance = torch.cdist(torch.from_numpy(cheap[block]), pool_features).numpy()  # (b, |p|)
            distance[block[:, None] == p[None, :]] = np.inf  # never a self-pair here
            nearest = np.argpartition(distance, k - 1, axis=1)[:, :k]  # (b, k)
            for row, cols in zip(block, nearest, strict=True):
                pairs.update(_ordered(int(row), int(p[c]), symmetric) for c in cols)
        for row in q:
            others = p[p != row]
            for c in rng.choice(others, size=min(config.random_pairs, others.size), replace=False):
                pairs.add(_ordered(int(row), int(c), symmetric))
    if config.causal and config.crop_pairs > 0:
        for row in queries:
            longer = pool[lengths[pool] > lengths[row]]
            for c in rng.choice(longer, size=min(config.crop_pairs, longer.size), replace=False):
                pairs.add((int(row), int(c)))
    ordered = sorted(pairs)
    duplicates = rng.choice(queries, size=int(round(config.duplicate_fraction * len(ordered))))
    left = np.array([a for a, _ in ordered] + duplicates.tolist(), dtype=np.int64)
    right = np.array([b for _, b in ordered] + duplicates.tolist(), dtype=np.int64)
    return left, right


def _ordered(a: int, b: int, symmetric: bool) -> tuple[int, int]:
    """Canonical order of a pair, so (a, b) and (b, a) count once when both come from one set."""
    return (min(a, b), max(a, b)) if symmetric else (a, b)


def _label(
    pairs: tuple[np.ndarray, np.ndarray], maps: Sequence[torch.Tensor], lengths: np.ndarray, alpha: float
) -> _Pairs:
    """Attach true map distances, reading each left input's maps once."""
    left, right = pairs
    target = np.empty(left.size, dtype=np.float64)
    order = np.argsort(left, kind="stable")
    bounds = np.flatnonzero(np.diff(left[order])) + 1
    for group in np.split(order, bounds):
        if group.size == 0:
            continue
        query = maps[int(left[group[0]])]
        for length in np.unique(lengths[right[group]]):
            members = group[lengths[right[group]] == length]
            candidates = torch.stack([maps[int(j)] for j in right[members]])  # (c, layers, heads, L', L')
            target[members] = map_distances(query, candidates, alpha=alpha)
    gap = np.abs(lengths[left] - lengths[right]).astype(np.float32)
    return _Pairs(left, right, target.astype(np.float32), gap)


def _fit(
    projector: Projector, pooled: torch.Tensor, train: _Pairs, val: _Pairs, config: TrainConfig
) -> tuple[list[float], list[float], int]:
    """Siamese training with early stopping; leaves the best weights in ``projector``.

    Targets are trained in units of the mean training target, so the learning rate
    and ``smooth_l1_beta`` mean the same for every model (random-weight models
    have targets ~1e-4, trained ones ~1e-2); the unit goes back into the output
    layer at the end. Losses are reported in that unit.
    """
    map_term = train.target - train.gap  # the part the projector predicts
    unit = max(float(map_term.mean()), 1e-12)
    left, right = torch.from_numpy(train.left), torch.from_numpy(train.right)
    target = torch.from_numpy(map_term / unit)
    val_left, val_right = torch.from_numpy(val.left), torch.from_numpy(val.right)
    val_target = torch.from_numpy((val.target - val.gap) / unit)
    projector.eval()
    with torch.no_grad():
        vectors = projector(pooled)  # (n, dim)
        start = _pair_distance(vectors[left], vectors[right]).median()
    # Start the distances at the targets' scale, so early epochs learn ranking
    # rather than just shrinking the output.
    projector.scale_output(float(target.median().clamp_min(1e-3) / start.clamp_min(1e-12)))
    optimiser = torch.optim.AdamW(projector.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    best_loss, best_epoch, best_state = float("inf"), 0, copy.deepcopy(projector.state_dict())
    train_losses: list[float] = []
    val_losses: list[float] = []
    bar = tqdm(range(1, config.max_epochs + 1), desc="projector", unit="epoch", disable=not config.progress)
    for epoch in bar:
        projector.train()
        total = 0.0
        for batch in torch.randperm(left.numel()).split(config.batch_size):
            items, inverse = torch.unique(torch.cat([left[batch], right[batch]]), return_inverse=True)
            vectors = projector(pooled[items])  # (u, dim)
            a, b = inverse.split(batch.numel())
            predicted = _pair_distance(vectors[a], vectors[b])  # (batch,)
            loss = F.smooth_l1_loss(predicted, target[batch], beta=config.smooth_l1_beta)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            total += loss.item() * batch.numel()
        train_losses.append(total / left.numel())
        projector.eval()
        with torch.no_grad():
            vectors = projector(pooled)  # (n, dim)
            val_loss = F.smooth_l1_loss(
                _pair_distance(vectors[val_left], vectors[val_right]), val_target, beta=config.smooth_l1_beta
            )
        val_losses.append(float(val_loss))
        logger.info("epoch %s: train loss %.5f, val loss %.5f", epoch, train_losses[-1], val_losses[-1])
        bar.set_postfix(train=f"{train_losses[-1]:.4f}", val=f"{val_losses[-1]:.4f}")
        if val_losses[-1] < best_loss:
            best_loss, best_epoch, best_state = val_losses[-1], epoch, copy.deepcopy(projector.state_dict())
        elif epoch - best_epoch >= config.patience:
            break
    bar.close()
    projector.load_state_dict(best_state)
    projector.scale_output(unit)
    return train_losses, val_losses, best_epoch


def _pair_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """L2 distance per row, with a floor inside the root so identical pairs have a gradient."""
    return ((a - b).pow(2).sum(dim=1) + 1e-12).sqrt()  # (p,)


def _per_query_correlation(queries: np.ndarray, predicted: np.ndarray, truth: np.ndarray) -> float:
    """Mean within-query rank correlation over queries with at least three pairs."""
    scores = []
    for q in np.unique(queries):
        rows = queries == q
        if rows.sum() >= 3:
            score = rank_correlation(predicted[rows], truth[rows])
            if not np.isnan(score):
                scores.append(score)
    return float(np.mean(scores)) if scores else float("nan")
