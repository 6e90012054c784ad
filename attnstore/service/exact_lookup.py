"""Exact lookups, the daemon's side of the exact tiers: rows whose token ids are stored get the stored final
outputs, no forward at all.

One rule for every process that serves it (the daemon and embedded mode): an
exact hit stored without outputs still has the row's own maps, so it is served
as a map hit at distance 0; one whose outputs cannot be read becomes a miss.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from attnstore.errors import AttnStoreError, ChecksumError, EntryNotFoundError, MapShapeError
from attnstore.service.queries import MISS, MatchResult, Query
from attnstore.store import MapStoreBase

log = logging.getLogger(__name__)

# Failures reading one entry that cost that row its hit, never the whole call.
ROW_ERRORS: tuple[type[AttnStoreError], ...] = (ChecksumError, EntryNotFoundError, MapShapeError)


@dataclass(frozen=True, slots=True)
class ExactOutputs:
    """A lookup's results with the exact hits' outputs read, and the hits that could not be served demoted."""

    results: list[MatchResult]  # one per query, in order
    outputs: dict[int, tuple[int, np.ndarray]]  # row -> (entry id, its outputs (L, hidden) fp16)


def exact_matches(store: MapStoreBase, namespace: str, queries: Sequence[Query]) -> dict[int, MatchResult]:
    """The rows whose token hash is stored at the row's own length, as exact hits (one store read)."""
    rows = [row for row, query in enumerate(queries) if query.token_hash]
    refs = store.find_by_hashes(namespace, [queries[row].token_hash or b"" for row in rows])
    found: dict[int, MatchResult] = {}
    for row, ref in zip(rows, refs, strict=True):
        # A query claiming another length than the stored tokens' is not the same input.
        if ref is not None and ref.length == queries[row].length:
            found[row] = MatchResult("exact", ref.id, 0.0, ref.length)
    return found


def read_exact_outputs(
    store: MapStoreBase,
    namespace: str,
    results: Sequence[MatchResult],
    on_read: Callable[[float], None] | None = None,
) -> ExactOutputs:
    """Read the outputs of every exact hit in ``results``, demoting the hits that cannot be served.

    Args:
        store: the store the results came from.
        namespace: their namespace.
        results: a lookup's results.
        on_read: called with the seconds each successful read took (metrics).
    """
    served: list[MatchResult] = []
    outputs: dict[int, tuple[int, np.ndarray]] = {}
    for row, result in enumerate(results):
        if result.kind == "exact" and result.entry_id is not None:
            entry_id = result.entry_id
            start = time.perf_counter()
            try:
                array = store.read_outputs(namespace, entry_id)  # (L, hidden)
            except ROW_ERRORS as exc:
                log.warning("event=exact_hit_unreadable namespace=%s entry=%d error=%r", namespace, entry_id, exc)
                result = MISS
            else:
                if array is None:
                    result = MatchResult("map", entry_id, 0.0, result.stored_length)
                else:
                    outputs[row] = (entry_id, array)
                    if on_read is not None:
                        on_read(time.perf_counter() - start)
        served.append(result)
    return ExactOutputs(served, outputs)
