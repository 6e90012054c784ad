"""Map lookups, the daemon's side of the map tier: rows near a stored entry replay its maps.

Two ways to decide a hit: the nearest entry within a threshold on the
projector's predicted map distance, or the namespace's fidelity gate
(``attnstore.projector.gate``) over each row's nearest few entries, which also
looks at how many tokens differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from attnstore.index import Candidate
from attnstore.projector.gate import FidelityGate, differing_positions, gate_features
from attnstore.protocol.records import NamespaceInfo
from attnstore.service.indexes import NamespaceIndexes
from attnstore.service.queries import MatchResult, Query, query_feature, query_length, query_token_ids
from attnstore.store import MapStoreBase


def threshold_matches(
    indexes: NamespaceIndexes,
    info: NamespaceInfo,
    queries: Sequence[Query],
    rows: Sequence[int],
    *,
    max_distance: float,
) -> dict[int, MatchResult]:
    """Each of ``rows``: a map hit on its nearest allowed entry within ``max_distance``, else a miss."""
    features = np.stack([query_feature(queries[row], info.layout.feature_dim) for row in rows])  # (n, d)
    lengths = np.array([query_length(queries[row]) for row in rows], dtype=np.int64)
    matches = indexes.search(info, features, lengths, max_distance=max_distance)
    return {
        row: MatchResult("map", match.entry_id, match.distance, match.stored_length)
        if match.hit
        else MatchResult("miss", None, match.distance, None)
        for row, match in zip(rows, matches, strict=True)
    }


def gated_matches(
    indexes: NamespaceIndexes,
    store: MapStoreBase,
    info: NamespaceInfo,
    gate: FidelityGate,
    queries: Sequence[Query],
    rows: Sequence[int],
) -> dict[int, MatchResult]:
    """Each of ``rows``: a map hit on its most probable candidate when the gate trusts it enough, else a miss."""
    picks = gate_picks(indexes, store, info, gate, [queries[row] for row in rows], rows)
    found: dict[int, MatchResult] = {}
    for row, (pick, probability) in zip(rows, picks, strict=True):
        if pick is None:
            found[row] = MatchResult("miss", None, float("inf"), None)
        elif probability >= gate.cutoff:
            found[row] = MatchResult("map", pick.entry_id, pick.distance, pick.stored_length, probability)
        else:
            found[row] = MatchResult("miss", None, pick.distance, None, probability)
    return found


def gate_picks(
    indexes: NamespaceIndexes,
    store: MapStoreBase,
    info: NamespaceInfo,
    gate: FidelityGate,
    queries: Sequence[Query],
    rows: Sequence[int],
) -> list[tuple[Candidate | None, float]]:
    """Each query's most probable candidate under ``gate`` and its probability, hit or not.

    ``rows`` are the queries' positions in the caller's batch (for messages).
    Every (query, candidate) pair of the batch is read in one store read and scored at once.

    Raises:
        MapShapeError: a query without token ids, or not as many as its length.
    """
    token_ids = [query_token_ids(query, row) for query, row in zip(queries, rows, strict=True)]
    features = np.stack([query_feature(q, info.layout.feature_dim) for q in queries])  # (n, d)
    lengths = np.array([query_length(q) for q in queries], dtype=np.int64)
    candidates = indexes.candidates(info, features, lengths, k=gate.candidates)
    pairs = [(q, rank, c) for q, found in enumerate(candidates) for rank, c in enumerate(found)]
    stored = store.token_ids(info.name, [c.entry_id for _, _, c in pairs])
    usable = [(pair, ids) for pair, ids in zip(pairs, stored, strict=True) if ids is not None]
    picks: list[tuple[Candidate | None, float]] = [(None, 0.0)] * len(queries)
    if not usable:
        return picks
    probabilities = gate.probabilities(gate_features(
        np.array([c.distance for (_, _, c), _ in usable]),
        np.array([len(token_ids[q]) for (q, _, _), _ in usable]),
        np.array([differing_positions(token_ids[q], ids) for (q, _, _), ids in usable]),
        np.array([rank for (_, rank, _), _ in usable]),
    ))
    for ((q, _, candidate), _), probability in zip(usable, probabilities, strict=True):
        if picks[q][0] is None or probability > picks[q][1]:  # ties keep the nearer candidate
            picks[q] = (candidate, float(probability))
    return picks
