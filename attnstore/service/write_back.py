"""Write-back: rows a node computed, stored for the exact tier so that every node hits them.

A written-back row is its token ids and its final outputs, nothing else: the
daemon hashes the ids itself (the same key as the client's ``keys.token_hash``),
so a node cannot file outputs under another row's key, and it checks that the
outputs have one row per token before anything is stored. Rows the admission
rule has not admitted (asked about fewer than ``--admit-after`` times) are
skipped, so a node cannot fill the store with rows nobody repeats. Stored rows
are outputs-only entries (no maps, no feature): the exact tier serves them at
once; the map tier never sees them.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from attnstore.errors import MapShapeError, WriteBackOffError, shown
from attnstore.protocol.records import NewEntry
from attnstore.service.admission import Admission

log = logging.getLogger(__name__)


def hash_token_ids(token_ids: np.ndarray) -> bytes:
    """The exact-tier key of one row: sha256 of its ids as little-endian int64 (as ``client.keys.token_hash``)."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).digest()


@dataclass(frozen=True, slots=True)
class WrittenRow:
    """One row a node computed."""

    token_ids: np.ndarray  # (L,) ints
    outputs: np.ndarray  # (L, hidden) fp16 or fp32 last hidden states


@dataclass(frozen=True, slots=True)
class WriteBackResult:
    """What one write-back call did."""

    stored: int  # new entries
    duplicates: int  # rows already stored (by another node, or earlier)
    not_admitted: int  # rows skipped: not asked about --admit-after times
    bytes: int  # outputs bytes received (fp16 as stored)


@dataclass(frozen=True, slots=True)
class WriteBackStats:
    """Write-back since the daemon started (the stats and metrics report them)."""

    calls: int
    entries: int  # new entries stored
    bytes: int  # their outputs' bytes (fp16)
    duplicates: int
    not_admitted: int


class WriteBackCounter:
    """Thread-safe totals of the write-back calls served."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = [0, 0, 0, 0, 0]

    def add(self, result: WriteBackResult) -> None:
        """Count one call's result."""
        with self._lock:
            for k, n in enumerate((1, result.stored, result.bytes, result.duplicates, result.not_admitted)):
                self._totals[k] += n

    def stats(self) -> WriteBackStats:
        """The totals so far."""
        with self._lock:
            return WriteBackStats(*self._totals)


def check_rows(rows: Sequence[WrittenRow], hidden: int) -> None:
    """Refuse the whole call when any row's outputs disagree with its tokens (nothing is stored).

    Raises:
        MapShapeError: a row without tokens, or outputs not ``(len(token_ids), hidden)`` of finite floats.
    """
    for index, row in enumerate(rows):
        length = int(row.token_ids.shape[0]) if row.token_ids.ndim == 1 else -1
        if length < 1:
            raise MapShapeError(f"write-back row {index}: token_ids must be one non-empty row, got shape"
                                f" {shown(tuple(row.token_ids.shape))}")
        if row.outputs.shape != (length, hidden):
            raise MapShapeError(
                f"write-back row {index}: outputs shape {shown(tuple(row.outputs.shape))} disagrees with its"
                f" {length} tokens: expected ({length}, {hidden})"
            )


def entries_to_store(
    namespace: str, rows: Sequence[WrittenRow], admission: Admission, *, hidden: int
) -> tuple[list[NewEntry], int]:
    """The outputs-only entries for the admitted rows, and how many rows were not admitted.

    Raises:
        WriteBackOffError: write-back is off (``admit_after`` 0).
        MapShapeError: see ``check_rows``.
    """
    if not admission.enabled:
        raise WriteBackOffError("this daemon runs with --admit-after 0: write-back is off, nothing was stored")
    check_rows(rows, hidden)
    entries: list[NewEntry] = []
    for row in rows:
        key = hash_token_ids(row.token_ids)
        if admission.count(namespace, key) < admission.config.admit_after:
            continue
        entries.append(NewEntry(maps=None, token_hash=key, outputs=row.outputs, token_ids=row.token_ids))
    return entries, len(rows) - len(entries)
