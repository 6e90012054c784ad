"""Write-back: rows a node computed, stored so that every node hits them.

A written-back row is its token ids and final outputs, and, when the node
captured them, its attention maps and the feature vector it projected for its
map lookup. The daemon hashes the ids itself (the same key as the client's
``keys.token_hash``), so a node cannot file a row under another row's key, and
it checks every row against its tokens and the namespace layout before anything
is stored: one bad row fails the call and nothing of it is stored. Rows the
admission rule has not admitted (asked about fewer than ``--admit-after`` times)
are skipped, so a node cannot fill the store with rows nobody repeats.

A row without maps becomes an outputs-only entry: the exact tier serves it at
once; the map tier never sees it. A row with maps becomes a full entry in the
namespace's codec: with a feature it joins the map index in the same call (every
node's next search can hit it); without one (the namespace has no projector yet)
it waits for a projector, which computes its feature from its maps' row later.
A feature must come from the namespace's current projector, stated by version,
so no index compares vectors of two projectors.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from attnstore.errors import MapShapeError, WriteBackOffError, shown
from attnstore.protocol.records import NamespaceInfo, NewEntry
from attnstore.service.admission import Admission
from attnstore.store.base import check_projector_version

log = logging.getLogger(__name__)


def hash_token_ids(token_ids: np.ndarray) -> bytes:
    """The exact-tier key of one row: sha256 of its ids as little-endian int64 (as ``client.keys.token_hash``)."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).digest()


@dataclass(frozen=True, slots=True)
class WrittenRow:
    """One row a node computed."""

    token_ids: np.ndarray  # (L,) ints
    outputs: np.ndarray  # (L, hidden) fp16 or fp32 last hidden states
    maps: np.ndarray | None = None  # (layers, heads, L, L) fp16 or fp32 probabilities; None: outputs only
    feature: np.ndarray | None = None  # (feature_dim,) float32 projector output; only with maps
    projector_version: int = 0  # the namespace's projector version ``feature`` was projected with


@dataclass(frozen=True, slots=True)
class WriteBackResult:
    """What one write-back call did."""

    stored: int  # new entries
    duplicates: int  # rows already stored (by another node, or earlier)
    not_admitted: int  # rows skipped: not asked about --admit-after times
    bytes: int  # fp16 bytes of the new entries (outputs and maps)
    maps_stored: int = 0  # of the new entries, those with maps
    maps_bytes: int = 0  # their maps' fp16 bytes


@dataclass(frozen=True, slots=True)
class WriteBackStats:
    """Write-back since the daemon started (the stats and metrics report them)."""

    calls: int
    entries: int  # new entries stored
    bytes: int  # their fp16 bytes, outputs and maps
    duplicates: int
    not_admitted: int
    map_entries: int  # of ``entries``, those stored with maps
    map_bytes: int  # their maps' fp16 bytes


class WriteBackCounter:
    """Thread-safe totals of the write-back calls served."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = [0] * 7

    def add(self, result: WriteBackResult) -> None:
        """Count one call's result."""
        counts = (1, result.stored, result.bytes, result.duplicates, result.not_admitted, result.maps_stored,
                  result.maps_bytes)
        with self._lock:
            for k, n in enumerate(counts):
                self._totals[k] += n

    def stats(self) -> WriteBackStats:
        """The totals so far."""
        with self._lock:
            return WriteBackStats(*self._totals)


def check_rows(rows: Sequence[WrittenRow], info: NamespaceInfo) -> None:
    """Refuse the whole call when any row disagrees with its tokens or the namespace (nothing is stored).

    Raises:
        MapShapeError: a row without tokens; outputs not ``(L, hidden)``; maps not
            ``(layers, heads, L, L)`` of the namespace layout at the row's token length; a
            feature without maps, of another dimension than the namespace's, or in a
            namespace without a projector.
        ProjectorChangedError: a feature projected with another projector version than the namespace's.
    """
    layout = info.layout
    for index, row in enumerate(rows):
        length = int(row.token_ids.shape[0]) if row.token_ids.ndim == 1 else -1
        if length < 1:
            raise MapShapeError(f"write-back row {index}: token_ids must be one non-empty row, got shape"
                                f" {shown(tuple(row.token_ids.shape))}")
        if row.outputs.shape != (length, layout.hidden):
            raise MapShapeError(
                f"write-back row {index}: outputs shape {shown(tuple(row.outputs.shape))} disagrees with its"
                f" {length} tokens: expected ({length}, {layout.hidden})"
            )
        if row.maps is not None and row.maps.shape != layout.map_shape(length):
            raise MapShapeError(
                f"write-back row {index}: maps shape {shown(tuple(row.maps.shape))} disagrees with its {length}"
                f" tokens or the namespace layout: expected {layout.map_shape(length)}"
            )
        if row.feature is None:
            continue
        if row.maps is None:
            raise MapShapeError(
                f"write-back row {index}: a feature needs maps (an outputs-only entry is never searched)"
            )
        if row.feature.shape != (layout.feature_dim,):
            raise MapShapeError(
                f"write-back row {index}: feature shape {shown(tuple(row.feature.shape))} is not the namespace's"
                f" ({layout.feature_dim},)"
            )
        if info.projector is None:
            raise MapShapeError(
                f"write-back row {index}: namespace {info.name!r} has no projector, so a row carries no feature"
                " (send its maps alone)"
            )
        check_projector_version(info, row.projector_version)


def entries_to_store(
    info: NamespaceInfo, rows: Sequence[WrittenRow], admission: Admission
) -> tuple[list[NewEntry], int]:
    """The entries for the admitted rows, and how many rows were not admitted.

    Raises:
        WriteBackOffError: write-back is off (``admit_after`` 0).
        MapShapeError, ProjectorChangedError: see ``check_rows``.
    """
    if not admission.enabled:
        raise WriteBackOffError("this daemon runs with --admit-after 0: write-back is off, nothing was stored")
    check_rows(rows, info)
    entries: list[NewEntry] = []
    for row in rows:
        key = hash_token_ids(row.token_ids)
        if admission.count(info.name, key) < admission.config.admit_after:
            continue
        entries.append(NewEntry(maps=row.maps, token_hash=key, outputs=row.outputs, token_ids=row.token_ids,
                                feature=row.feature))
    return entries, len(rows) - len(entries)
