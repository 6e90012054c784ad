"""What a lookup asks and answers, row by row, and the checks every tier applies to a query."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from attnstore.errors import MapShapeError

MatchKindName = Literal["miss", "exact", "map"]


@dataclass(frozen=True, slots=True)
class Query:
    """One row of a lookup."""

    feature: np.ndarray  # (feature_dim,) float32 projector output
    length: int  # token length L
    token_hash: bytes | None = None  # exact-tier key; None skips the exact tier
    token_ids: np.ndarray | None = None  # (L,) the row's token ids: what the fidelity gate compares


@dataclass(frozen=True, slots=True)
class MatchResult:
    """What the service found for one query."""

    kind: MatchKindName
    entry_id: int | None  # None on a miss
    distance: float  # predicted map distance (0 for exact hits, nearest candidate's on a miss)
    stored_length: int | None  # >= the query length for causal crops; None on a miss
    probability: float | None = None  # gated lookups: the fidelity gate's P(faithful) of the best candidate
    admit: bool = False  # a miss of the exact tier that the admission rule admits: write its outputs back


MISS = MatchResult("miss", None, float("inf"), None)


@dataclass(frozen=True, slots=True)
class IngestResult:
    """Ids of ingested entries in input order, and how many were already stored."""

    entry_ids: list[int]
    duplicates: int
    added: tuple[int, ...] = ()  # the ids this call stored anew


def query_feature(query: Query, dim: int) -> np.ndarray:
    """The query's feature as ``(dim,)`` float32.

    Raises:
        MapShapeError: it has another shape.
    """
    vector = np.asarray(query.feature, dtype=np.float32)
    if vector.shape != (dim,):
        raise MapShapeError(f"feature vectors of this namespace have {dim} values, got shape {vector.shape}")
    return vector


def query_length(query: Query) -> int:
    """The query's token length.

    Raises:
        MapShapeError: below 1.
    """
    if query.length < 1:
        raise MapShapeError(f"query length must be >= 1, got {query.length}")
    return int(query.length)


def query_token_ids(query: Query, row: int) -> np.ndarray:
    """A gated query's token ids as ``(L,)`` int64.

    Raises:
        MapShapeError: none given, or not one integer per token of its length.
    """
    if query.token_ids is None:
        raise MapShapeError(f"query {row}: a gated lookup needs the row's token ids")
    ids = np.asarray(query.token_ids)
    if ids.shape != (query.length,) or ids.dtype.kind not in "iu":
        raise MapShapeError(f"query {row}: {ids.shape} token ids of dtype {ids.dtype} for length {query.length}")
    return ids.astype(np.int64)
