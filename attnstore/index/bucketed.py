"""``BucketedIndex``: a namespace's vector indexes, one per token length, and the length rules.

Bidirectional models may only reuse maps of exactly the query's length. Causal
models may also reuse a longer entry by cropping its top-left L x L block (row i
of a causal map covers only columns <= i, so the crop is exact for the prefix).
The projector predicts the map term of the training target; the target's
length term, ``length_penalty * (L' - L)``, is known exactly and added here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from attnstore.errors import VectorIndexError
from attnstore.index.base import VectorIndex, check_dim, check_ids, check_vectors
from attnstore.index.faiss_index import FaissIndex


@dataclass(frozen=True, slots=True)
class Match:
    """The answer to one query: the nearest allowed entry, a hit if within the threshold."""

    entry_id: int | None  # None on a miss
    distance: float  # predicted map distance to the nearest candidate (inf: no candidate)
    stored_length: int | None  # token length of the matched entry; None on a miss

    @property
    def hit(self) -> bool:
        """Whether the nearest candidate was within the threshold."""
        return self.entry_id is not None

    @property
    def similarity(self) -> float:
        """``1 - distance``: the form thresholds are shown in."""
        return 1.0 - self.distance


@dataclass(frozen=True, slots=True)
class Candidate:
    """One of a query's nearest allowed entries."""

    entry_id: int
    distance: float  # predicted map distance, length term included
    stored_length: int  # > the query's length for a causal crop


class BucketedIndex:
    """One ``VectorIndex`` per token length, searched under the causal/bidirectional rule."""

    def __init__(self, dim: int, make_index: Callable[[int], VectorIndex] = FaissIndex) -> None:
        """Create an empty set of buckets.

        Args:
            dim: feature dimension of every bucket.
            make_index: builds the empty index of a new bucket from ``dim``.
        """
        self.dim = check_dim(dim)
        self._make_index = make_index
        self._buckets: dict[int, VectorIndex] = {}

    @property
    def lengths(self) -> tuple[int, ...]:
        """Token lengths that have a bucket, ascending."""
        return tuple(sorted(self._buckets))

    def bucket(self, length: int) -> VectorIndex | None:
        """The index of one length, or ``None``; for persisting it with ``to_bytes``."""
        return self._buckets.get(int(length))

    def set_bucket(self, length: int, index: VectorIndex) -> None:
        """Install a (loaded or rebuilt) index for ``length``, replacing any there."""
        length = _check_length("BucketedIndex.set_bucket()", length)
        if index.dim != self.dim:
            raise VectorIndexError(f"BucketedIndex.set_bucket(): index dim {index.dim} != {self.dim}")
        self._buckets[length] = index

    def buckets(self) -> Iterator[tuple[int, VectorIndex]]:
        """``(length, index)`` pairs, ascending length."""
        for length in self.lengths:
            yield length, self._buckets[length]

    def add(self, ids: np.ndarray, vectors: np.ndarray, lengths: np.ndarray) -> None:
        """Add vectors under ids into the buckets of their token lengths.

        Raises:
            VectorIndexError: bad shapes, NaN/Inf, bad lengths, or ids already present
                in the bucket they go to.
        """
        vectors = check_vectors("BucketedIndex.add()", vectors, self.dim)
        ids = check_ids("BucketedIndex.add()", ids, vectors.shape[0])
        lengths = _check_lengths("BucketedIndex.add()", lengths, vectors.shape[0])
        for length in np.unique(lengths):
            rows = lengths == length
            index = self._buckets.get(int(length))
            if index is None:
                index = self._buckets[int(length)] = self._make_index(self.dim)
            index.add(ids[rows], vectors[rows])

    def remove(self, ids: np.ndarray) -> int:
        """Remove ids from whichever buckets hold them; returns how many were removed."""
        ids = check_ids("BucketedIndex.remove()", ids)
        return sum(index.remove(ids) for index in self._buckets.values())

    def __len__(self) -> int:
        """Number of live vectors over all buckets."""
        return sum(len(index) for index in self._buckets.values())

    @property
    def nbytes(self) -> int:
        """Memory the buckets' indexes hold (``VectorIndex.nbytes``)."""
        return sum(index.nbytes for index in self._buckets.values())

    def search(
        self,
        queries: np.ndarray,
        lengths: np.ndarray,
        *,
        causal: bool,
        max_distance: float,
        length_penalty: float = 1.0,
    ) -> list[Match]:
        """The nearest allowed entry of each query, a hit when within ``max_distance``.

        Args:
            queries: (q, dim) feature vectors.
            lengths: (q,) token lengths of the queries.
            causal: also search longer buckets (crop); otherwise the exact length only.
            max_distance: threshold on the predicted map distance (similarity = 1 - distance).
            length_penalty: added per token of length gap for a longer bucket (the
                training target's weight of the length term).
        Returns:
            One ``Match`` per query. A miss still carries the nearest candidate's
            distance (``inf`` if none), which is what thresholds are calibrated on.
        Raises:
            VectorIndexError: bad shapes, NaN/Inf, bad lengths or a negative/NaN threshold.
        """
        if math.isnan(max_distance) or max_distance < 0:
            raise VectorIndexError(f"BucketedIndex.search(): max_distance must be >= 0, got {max_distance!r}")
        nearest = self.candidates(queries, lengths, causal=causal, k=1, length_penalty=length_penalty)
        return [
            Match(c[0].entry_id, c[0].distance, c[0].stored_length)
            if c and c[0].distance <= max_distance
            else Match(None, c[0].distance if c else math.inf, None)
            for c in nearest
        ]

    def candidates(
        self,
        queries: np.ndarray,
        lengths: np.ndarray,
        *,
        causal: bool,
        k: int,
        length_penalty: float = 1.0,
    ) -> list[list[Candidate]]:
        """The ``k`` nearest allowed entries of each query, nearest first (fewer if fewer are stored).

        Args: as ``search``, and ``k`` >= 1, the candidates kept per query.
        Raises:
            VectorIndexError: bad shapes, NaN/Inf, bad lengths, ``k`` < 1 or a negative penalty.
        """
        queries = check_vectors("BucketedIndex.search()", queries, self.dim)
        lengths = _check_lengths("BucketedIndex.search()", lengths, queries.shape[0])
        if math.isnan(length_penalty) or length_penalty < 0:
            raise VectorIndexError(f"BucketedIndex.search(): length_penalty must be >= 0, got {length_penalty!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise VectorIndexError(f"BucketedIndex.candidates(): k must be an int >= 1, got {k!r}")
        found: list[list[Candidate]] = [[] for _ in range(queries.shape[0])]
        stored = self.lengths
        for length in np.unique(lengths):
            rows = np.flatnonzero(lengths == length)
            allowed = [s for s in stored if s >= length] if causal else [int(length)] if length in self._buckets else []
            for stored_length in allowed:
                gap = length_penalty * (stored_length - int(length))
                # Buckets are ascending: once the gap alone exceeds every row's k-th best, stop.
                if all(len(found[r]) == k and gap > found[r][-1].distance for r in rows):
                    break
                distances, ids = self._buckets[stored_length].search(queries[rows], k=k)
                for row, row_distances, row_ids in zip(rows, distances, ids, strict=True):
                    merged = found[row] + [
                        Candidate(int(i), float(d) + gap, stored_length)
                        for d, i in zip(row_distances, row_ids, strict=True)
                        if i >= 0
                    ]
                    found[row] = sorted(merged, key=lambda c: c.distance)[:k]
        return found


def _check_length(where: str, length: int) -> int:
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
        raise VectorIndexError(f"{where}: a token length must be an int >= 1, got {length!r}")
    return int(length)


def _check_lengths(where: str, lengths: np.ndarray, n: int) -> np.ndarray:
    array = np.asarray(lengths)
    if array.shape != (n,):
        raise VectorIndexError(f"{where}: expected {n} lengths, got shape {array.shape}")
    if n and (not np.issubdtype(array.dtype, np.integer) or array.min() < 1):
        raise VectorIndexError(f"{where}: lengths must be integers >= 1, got {array[:5].tolist()}")
    return array.astype(np.int64)
