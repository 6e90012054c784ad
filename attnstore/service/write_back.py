"""Write-back: rows a node computed, stored so that every node hits them.

A written-back row is its token ids and final outputs, and, when the node
captured them, its attention maps and the feature vector it projected for its
map lookup. The daemon hashes the ids itself (``protocol.keys.token_hash``, the
client's key), so a node cannot file a row under another row's key, and
it checks every row against its tokens, the namespace layout and the store's
own rules for entries before anything is stored. Rows are judged one by one: a
bad row (it does not decode, disagrees with its tokens, holds NaN/inf, has maps
that are not probabilities or a feature of another projector version) is
refused alone and reported, and the rest of the call is stored as if it had not
been sent, so one bad row cannot cost a node its whole batch. Rows the
admission rule has not admitted (asked about fewer than ``--admit-after``
times) are skipped, so a node cannot fill the store with rows nobody repeats.

A row without maps becomes an outputs-only entry: the exact tier serves it at
once; the map tier never sees it. A row with maps becomes a full entry in the
namespace's codec, whose feature the daemon derives from the row's tokens
(``derived_features``: the namespace's projector over its embedding layer), so
it joins the map index in the same call. The feature a node sends is never
stored (a sender choosing it could place its row next to another user's
queries): it is still checked (its shape, and its projector version, which tells
a node its projector is stale), then replaced. A namespace without a projector,
or whose projector was stored without its embedding layer, stores the row
without a feature: it waits for ``admin train-projector``, which features it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from attnstore.errors import (
    AttnStoreError,
    ChecksumError,
    MapShapeError,
    ProjectorChangedError,
    WireFormatError,
    WriteBackOffError,
    shown,
)
from attnstore.protocol.keys import token_hash
from attnstore.protocol.records import NamespaceInfo, NewEntry
from attnstore.service.admission import Admission
from attnstore.service.derived_features import DerivedFeatures
from attnstore.service.queries import IngestResult
from attnstore.store.namespace_rules import check_projector_version
from attnstore.store.validate import prepare_entry

log = logging.getLogger(__name__)

# A write-back is judged against the namespace as it is; a projector replaced before the commit judges it again.
_WRITE_BACK_ROUNDS = 3


@dataclass(frozen=True, slots=True)
class WrittenRow:
    """One row a node computed."""

    token_ids: np.ndarray  # (L,) ints
    outputs: np.ndarray  # (L, hidden) fp16 or fp32 last hidden states
    maps: np.ndarray | None = None  # (layers, heads, L, L) fp16 or fp32 probabilities; None: outputs only
    feature: np.ndarray | None = None  # (feature_dim,) float32 projector output; only with maps
    projector_version: int = 0  # the namespace's projector version ``feature`` was projected with


@dataclass(frozen=True, slots=True)
class RefusedRow:
    """A row of a write-back call refused on its own (the others are judged as if it had not been sent)."""

    row: int  # its index in the call
    error: AttnStoreError  # why: MapShapeError, WireFormatError, ChecksumError or ProjectorChangedError


@dataclass(frozen=True, slots=True)
class WriteBackResult:
    """What one write-back call did."""

    stored: int  # new entries
    duplicates: int  # rows already stored (by another node, or earlier)
    not_admitted: int  # rows skipped: not asked about --admit-after times
    bytes: int  # fp16 bytes of the new entries (outputs and maps)
    maps_stored: int = 0  # of the new entries, those with maps
    maps_bytes: int = 0  # their maps' fp16 bytes
    refused: tuple[RefusedRow, ...] = ()  # rows refused one by one, in call order


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
    refused: int = 0  # rows refused one by one


class WriteBackCounter:
    """Thread-safe totals of the write-back calls served."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = [0] * 8

    def add(self, result: WriteBackResult) -> None:
        """Count one call's result."""
        counts = (1, result.stored, result.bytes, result.duplicates, result.not_admitted, result.maps_stored,
                  result.maps_bytes, len(result.refused))
        with self._lock:
            for k, n in enumerate(counts):
                self._totals[k] += n

    def stats(self) -> WriteBackStats:
        """The totals so far."""
        with self._lock:
            return WriteBackStats(*self._totals)


def check_row(index: int, row: WrittenRow, info: NamespaceInfo, writer: str | None = None) -> NewEntry:
    """The entry to store for one row (recorded as ``writer``'s), once it agrees with its tokens and the namespace.

    The store's own checks of an entry (``validate.prepare_entry``: maps are probabilities,
    causal where the namespace is; outputs and feature finite once in fp16) run here too, so
    a bad row is refused alone instead of failing the ingest of its whole call.

    Raises:
        MapShapeError: a row without tokens, longer than the model's maximum, or with a token id
            outside its vocabulary; outputs not ``(L, hidden)``, or constant over the hidden size;
            maps not ``(layers, heads, L, L)`` of the namespace layout at the row's token length; a
            feature without maps, of another dimension than the namespace's, or in a namespace
            without a projector; NaN/inf; maps that are not attention distributions.
        ProjectorChangedError: a feature projected with another projector version than the namespace's.
    """
    layout = info.layout
    length = int(row.token_ids.shape[0]) if row.token_ids.ndim == 1 else -1
    if length < 1:
        raise MapShapeError(f"write-back row {index}: token_ids must be one non-empty row, got shape"
                            f" {shown(tuple(row.token_ids.shape))}")
    if row.outputs.shape != (length, layout.hidden):
        raise MapShapeError(
            f"write-back row {index}: outputs shape {shown(tuple(row.outputs.shape))} disagrees with its"
            f" {length} tokens: expected ({length}, {layout.hidden})"
        )
    _check_tokens(index, row.token_ids, info)
    if row.maps is not None and row.maps.shape != layout.map_shape(length):
        raise MapShapeError(
            f"write-back row {index}: maps shape {shown(tuple(row.maps.shape))} disagrees with its {length}"
            f" tokens or the namespace layout: expected {layout.map_shape(length)}"
        )
    _check_outputs(index, row.outputs)
    if row.feature is not None:
        _check_feature(index, row, info)
    entry = NewEntry(maps=row.maps, token_hash=token_hash(row.token_ids), outputs=row.outputs,
                     token_ids=row.token_ids, feature=row.feature, writer=writer)
    prepare_entry(entry, layout, index, what="write-back row")
    return entry


def _check_tokens(index: int, token_ids: np.ndarray, info: NamespaceInfo) -> None:
    """Token ids the namespace's model could have been given: inside its vocabulary, within its length."""
    limits = info.limits
    assert limits is not None  # plan_write_back refuses a namespace without limits first
    if len(token_ids) > limits.max_length:
        raise MapShapeError(f"write-back row {index}: {len(token_ids)} tokens is over the model's maximum of"
                            f" {limits.max_length} (namespace {info.name!r})")
    outside = (token_ids < 0) | (token_ids >= limits.vocab_size)
    if outside.any():
        raise MapShapeError(f"write-back row {index}: token id {int(token_ids[outside.argmax()])} is outside the"
                            f" vocabulary of {limits.vocab_size} (namespace {info.name!r})")


def _check_outputs(index: int, outputs: np.ndarray) -> None:
    """Refuse outputs no model computes: a token whose hidden state is constant (zeros, a filler value).

    The numbers of a hidden state cannot be checked without the model, but a (normalised, mixed) last
    hidden state never has every dimension equal: such a row is a placeholder, not a result.
    """
    if outputs.shape[-1] < 2:
        return
    spread = np.ptp(np.asarray(outputs, dtype=np.float32), axis=-1)  # (L,)
    if (spread == 0).any():
        raise MapShapeError(f"write-back row {index}: the outputs of token {int((spread == 0).argmax())} are"
                            " constant across the hidden size: not a model's hidden state")


def _check_feature(index: int, row: WrittenRow, info: NamespaceInfo) -> None:
    assert row.feature is not None
    if row.maps is None:
        raise MapShapeError(
            f"write-back row {index}: a feature needs maps (an outputs-only entry is never searched)"
        )
    if row.feature.shape != (info.layout.feature_dim,):
        raise MapShapeError(
            f"write-back row {index}: feature shape {shown(tuple(row.feature.shape))} is not the namespace's"
            f" ({info.layout.feature_dim},)"
        )
    if info.projector is None:
        raise MapShapeError(
            f"write-back row {index}: namespace {info.name!r} has no projector, so a row carries no feature"
            " (send its maps alone)"
        )
    check_projector_version(info, row.projector_version)


@dataclass(frozen=True, slots=True)
class WriteBackPlan:
    """What one call stores: the admitted rows' entries, and the rows refused or not admitted."""

    entries: list[NewEntry]
    refused: tuple[RefusedRow, ...]
    not_admitted: int


def plan_write_back(
    info: NamespaceInfo, rows: Sequence[WrittenRow | AttnStoreError], admission: Admission, writer: str | None = None,
    derived: DerivedFeatures | None = None,
) -> WriteBackPlan:
    """Judge each row on its own: refused (it did not decode, or fails ``check_row``), not admitted, or stored,
    with the feature ``derived`` computes from its tokens (none without it).

    Args:
        info: the namespace as it is now.
        rows: each row of the call, or the error decoding it raised.
        admission: the daemon's admission rule.
        writer: the name of the token writing (recorded with each entry stored).
        derived: derives the stored rows' features (None: they are stored without one).

    Raises:
        WriteBackOffError: write-back is off (``admit_after`` 0), or the namespace records no token limits
            (it was made before they were; ``CreateNamespace`` with them records them).
    """
    if not admission.enabled:
        raise WriteBackOffError("this daemon runs with --admit-after 0: write-back is off, nothing was stored")
    if info.limits is None:
        raise WriteBackOffError(
            f"namespace {info.name!r} records no vocabulary size and maximum length (it was created before they"
            f" were recorded), so written-back token ids cannot be checked: nothing was stored. Record them with"
            f" `attnstore admin create-namespace --model {info.model} --namespace {info.name}`"
        )
    checked: list[NewEntry] = []
    refused: list[RefusedRow] = []
    for index, row in enumerate(rows):
        try:
            if isinstance(row, AttnStoreError):
                raise row
            checked.append(check_row(index, row, info, writer))
        except (MapShapeError, ProjectorChangedError, WireFormatError, ChecksumError) as exc:
            refused.append(RefusedRow(index, exc))
    if refused:
        log.info("event=write_back_rows_refused namespace=%s refused=%d first=%r", info.name, len(refused),
                 str(refused[0].error)[:200])
    admitted = admission.admitted(info.name, [entry.token_hash for entry in checked])
    entries = _with_derived_features(info, [entry for entry, yes in zip(checked, admitted, strict=True) if yes],
                                     derived)
    return WriteBackPlan(entries, tuple(refused), len(checked) - len(entries))


def _with_derived_features(info: NamespaceInfo, entries: list[NewEntry], derived: DerivedFeatures | None
                           ) -> list[NewEntry]:
    """``entries`` with the sent features dropped, and those with maps given the feature of their tokens."""
    mapped = [k for k, entry in enumerate(entries) if entry.maps is not None]
    features = None  # (len(mapped), feature_dim)
    if derived is not None and mapped:
        try:
            features = derived.features(info, [np.asarray(entries[k].token_ids) for k in mapped])
        except MapShapeError as exc:  # tokens the limits let through but the layer cannot embed: no feature
            log.warning("event=write_back_features_not_derived namespace=%s rows=%d: %s", info.name, len(mapped), exc)
    out = [dataclasses.replace(entry, feature=None) if entry.feature is not None else entry for entry in entries]
    if features is not None:
        for row, k in enumerate(mapped):
            out[k] = dataclasses.replace(out[k], feature=features[row])
    return out


def summarise(
    info: NamespaceInfo, plan: WriteBackPlan, entry_ids: Sequence[int], added: Sequence[int], duplicates: int
) -> WriteBackResult:
    """The result of storing ``plan.entries`` (ids in order, those new, duplicates): bytes of the new ones."""
    new: list[NewEntry] = []  # the first entry of each id this call stored (a row may repeat in a call)
    fresh = set(added)
    for entry_id, entry in zip(entry_ids, plan.entries, strict=True):
        if entry_id in fresh:
            fresh.discard(entry_id)
            new.append(entry)
    layout = info.layout
    lengths = [len(np.asarray(e.token_ids)) for e in new]
    map_bytes = sum(layout.map_nbytes(n) for e, n in zip(new, lengths, strict=True) if e.maps is not None)
    output_bytes = sum(layout.outputs_nbytes(n) for n in lengths)
    return WriteBackResult(len(new), duplicates, plan.not_admitted, output_bytes + map_bytes,
                           sum(e.maps is not None for e in new), map_bytes, plan.refused)


def write_rows(
    namespace_now: Callable[[], NamespaceInfo],
    ingest: Callable[[list[NewEntry], int | None], IngestResult],
    rows: Sequence[WrittenRow | AttnStoreError],
    admission: Admission,
    writer: str | None,
    derived: DerivedFeatures | None = None,
) -> WriteBackResult:
    """Judge ``rows`` (``plan_write_back``) and store the admitted ones with ``ingest``; see
    ``AttnStoreService.write_back``.

    Args:
        namespace_now: the namespace as it is now (checking the caller's fingerprint).
        ingest: stores entries, checking the projector version given (None: none) inside its write.
        rows, admission, writer, derived: see ``plan_write_back``.

    Raises:
        WriteBackOffError: see ``plan_write_back``; and whatever ``namespace_now`` and ``ingest`` raise for
            the whole call (the namespace, its fingerprint, a full store).
    """
    info = namespace_now()
    for attempt in range(_WRITE_BACK_ROUNDS):
        plan = plan_write_back(info, rows, admission, writer, derived)
        featured = any(e.feature is not None for e in plan.entries)
        try:
            # Checked again inside the write: the projector may be replaced between the check and the commit.
            report = ingest(plan.entries, info.projector_version if featured else None) if plan.entries \
                else IngestResult([], 0)
        except ProjectorChangedError:
            if attempt + 1 == _WRITE_BACK_ROUNDS:
                raise
            info = namespace_now()  # the new version refuses the stale rows one by one
            continue
        return summarise(info, plan, report.entry_ids, report.added, report.duplicates)
    raise AssertionError("unreachable: the last round returns or raises")
