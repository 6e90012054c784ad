"""The store service: a map store plus one vector index per namespace and length.

This is what the daemon serves over gRPC and what embedded mode (``local:PATH``)
runs in-process. It answers lookups exact tier first (same token ids: stored
outputs, no forward at all), then by nearest feature vector under a predicted
map-distance threshold or, when asked, by the namespace's fidelity gate over the
nearest few (``attnstore.protocol.gate``: distance, length and differing tokens). It keeps
the indexes in step with ingest, delete, eviction and compaction. Indexes are rebuilt from the feature vectors kept in
the entry records when a store is opened, so nothing but the store is persisted.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from attnstore.errors import FingerprintMismatchError, MapShapeError, NamespaceNotReadyError
from attnstore.protocol.gate import FidelityGate, differing_positions, gate_features
from attnstore.index import BucketedIndex, Candidate, FaissIndex, VectorIndex
from attnstore.protocol.projector_blob import gate_from_projector
from attnstore.store import (
    CompactReport,
    EntryInfo,
    MapStore,
    MapStoreBase,
    NamespaceInfo,
    NamespaceLayout,
    NewEntry,
    StoreStats,
    VerifyReport,
)

log = logging.getLogger(__name__)

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


@dataclass(frozen=True, slots=True)
class IngestResult:
    """Ids of ingested entries in input order, and how many were already stored."""

    entry_ids: list[int]
    duplicates: int


class AttnStoreService:
    """A map store with its vector indexes; thread-safe.

    Reads of maps go straight to the store (many threads at once). Index searches
    and updates share one lock: faiss indexes must not be searched while they change.
    """

    def __init__(
        self,
        store: MapStoreBase,
        *,
        make_index: Callable[[int], VectorIndex] = FaissIndex,
        length_penalty: float = 1.0,
    ) -> None:
        """Wrap an open store and build its indexes from the stored feature vectors.

        Args:
            store: an open map store; the service closes it on ``close()``.
            make_index: builds an empty index of a given dimension for a new bucket.
            length_penalty: predicted distance added per token when a causal query
                matches a longer entry (the training target's length term).
        """
        self._store = store
        self._make_index = make_index
        self._length_penalty = length_penalty
        self._index_lock = threading.Lock()
        self._indexes: dict[str, BucketedIndex] = {}
        for info in store.list_namespaces():
            self._indexes[info.name] = self._build_index(info)

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        create: bool = False,
        dram_bytes: int | None = None,
        max_bytes: int | None = None,
        map_size: int | None = None,
        readonly: bool = False,
    ) -> AttnStoreService:
        """Open the LMDB store at ``path`` and build its indexes.

        Raises:
            StoreNotFoundError: no store there and ``create`` is False.
            FormatVersionError: the store was written in an unknown format version.
        """
        options: dict[str, object] = {"create": create, "max_bytes": max_bytes, "readonly": readonly}
        if dram_bytes is not None:
            options["dram_bytes"] = dram_bytes
        if map_size is not None:
            options["map_size"] = map_size
        return cls(MapStore.open(path, **options))

    @property
    def store(self) -> MapStoreBase:
        """The underlying map store."""
        return self._store

    # ---- namespaces ---------------------------------------------------------

    def create_namespace(self, name: str, *, model: str, fingerprint: str, layout: NamespaceLayout) -> NamespaceInfo:
        """Create a namespace (idempotent for the same model, fingerprint and layout)."""
        info = self._store.create_namespace(name, model=model, fingerprint=fingerprint, layout=layout)
        with self._index_lock:
            self._indexes.setdefault(name, BucketedIndex(layout.feature_dim, self._make_index))
        return info

    def get_namespace(self, name: str) -> NamespaceInfo:
        """The namespace called ``name``; raises NamespaceNotFoundError."""
        return self._store.get_namespace(name)

    def list_namespaces(self) -> list[NamespaceInfo]:
        """Every namespace, sorted by name."""
        return self._store.list_namespaces()

    def drop_namespace(self, name: str) -> None:
        """Remove a namespace, its entries and its index.

        Raises:
            NamespaceNotFoundError: no such namespace.
        """
        self._store.drop_namespace(name)
        with self._index_lock:
            self._indexes.pop(name, None)

    def set_projector(self, name: str, blob: bytes) -> None:
        """Store the namespace's projector weights (safetensors bytes)."""
        self._store.set_projector(name, blob)

    def check_fingerprint(self, name: str, fingerprint: str) -> NamespaceInfo:
        """The namespace, if ``fingerprint`` is its model's.

        Raises:
            NamespaceNotFoundError: no such namespace.
            FingerprintMismatchError: the request was made with another model.
        """
        info = self._store.get_namespace(name)
        if fingerprint != info.fingerprint:
            raise FingerprintMismatchError(
                f"namespace {name!r} belongs to model {info.model!r} with fingerprint "
                f"{info.fingerprint[:16]}...; the request's fingerprint is {fingerprint[:16] or '(empty)'}..."
                " (a different model, tokenizer or weights: its maps would be wrong)"
            )
        return info

    # ---- serving ------------------------------------------------------------

    def lookup(
        self,
        namespace: str,
        fingerprint: str,
        queries: Sequence[Query],
        *,
        max_distance: float,
        exact: bool = True,
        gate: bool = False,
    ) -> list[MatchResult]:
        """Match each query: exact tier first, then the nearest entry within ``max_distance``.

        Args:
            namespace: namespace name.
            fingerprint: the caller's model fingerprint; must equal the namespace's.
            queries: one per batch row.
            max_distance: threshold on the predicted map distance (ignored when gated).
            exact: consult the exact tier (token hash) first.
            gate: decide map hits with the namespace's fidelity gate (``attnstore.protocol.gate``)
                instead of ``max_distance``; every query needs its token ids.

        Returns:
            One ``MatchResult`` per query, in order.

        Raises:
            NamespaceNotFoundError, FingerprintMismatchError: see ``check_fingerprint``.
            NamespaceNotReadyError: ``gate`` on a namespace without one.
            MapShapeError: a feature of the wrong dimension, a bad length, or a gated
                query without token ids (or not as many as its length).
            VectorIndexError: NaN/Inf features or a bad threshold.
        """
        info = self.check_fingerprint(namespace, fingerprint)
        fidelity_gate = _gate_of(info) if gate else None
        if gate and fidelity_gate is None:
            raise NamespaceNotReadyError(
                f"namespace {namespace!r} has no fidelity gate (built without calibration, or before gates):"
                " look up with a max distance instead"
            )
        results: list[MatchResult | None] = [None] * len(queries)
        if exact:
            for i, query in enumerate(queries):
                if query.token_hash:
                    entry_id = self._store.find_by_hash(namespace, query.token_hash)
                    if entry_id is not None:
                        results[i] = MatchResult("exact", entry_id, 0.0, query.length)
        pending = [i for i, result in enumerate(results) if result is None]
        if pending and fidelity_gate is not None:
            picks = self._gate_picks(namespace, info, fidelity_gate, [queries[i] for i in pending], pending)
            for i, (pick, probability) in zip(pending, picks, strict=True):
                if pick is None:
                    results[i] = MatchResult("miss", None, math.inf, None)
                elif probability >= fidelity_gate.min_probability:
                    results[i] = MatchResult("map", pick.entry_id, pick.distance, pick.stored_length, probability)
                else:
                    results[i] = MatchResult("miss", None, pick.distance, None, probability)
        elif pending:
            dim = info.layout.feature_dim
            features = np.stack([_feature(queries[i].feature, dim) for i in pending])
            lengths = np.array([_length(queries[i].length) for i in pending], dtype=np.int64)
            with self._index_lock:
                matches = self._index(namespace).search(
                    features,
                    lengths,
                    causal=info.layout.causal,
                    max_distance=max_distance,
                    length_penalty=self._length_penalty,
                )
            for i, match in zip(pending, matches, strict=True):
                results[i] = (
                    MatchResult("map", match.entry_id, match.distance, match.stored_length)
                    if match.hit
                    else MatchResult("miss", None, match.distance, None)
                )
        hit_ids = [r.entry_id for r in results if r is not None and r.entry_id is not None]
        if hit_ids:
            self._store.record_hits(namespace, hit_ids)
        return [r for r in results if r is not None]

    def gate(self, namespace: str) -> FidelityGate | None:
        """The namespace's fidelity gate, from its projector blob; None when it has none.

        Raises:
            NamespaceNotFoundError: no such namespace.
            FormatVersionError: the projector blob is not safetensors, or its gate is malformed.
        """
        return _gate_of(self.get_namespace(namespace))

    def gate_picks(
        self, namespace: str, fingerprint: str, queries: Sequence[Query], gate: FidelityGate
    ) -> list[tuple[Candidate | None, float]]:
        """Each query's most probable candidate under ``gate`` and its probability, hit or not.

        What a gated lookup decides on (it serves the pick when the probability reaches
        ``gate.min_probability``); for evaluations, which need the pick of a miss too.

        Raises:
            as ``lookup``.
        """
        info = self.check_fingerprint(namespace, fingerprint)
        return self._gate_picks(namespace, info, gate, queries, range(len(queries)))

    def _gate_picks(
        self,
        namespace: str,
        info: NamespaceInfo,
        gate: FidelityGate,
        queries: Sequence[Query],
        rows: Iterable[int],
    ) -> list[tuple[Candidate | None, float]]:
        """``gate_picks`` for ``queries``; ``rows`` are their positions in the caller's batch (for messages)."""
        token_ids = [_token_ids(query, row) for query, row in zip(queries, rows, strict=True)]
        features = np.stack([_feature(q.feature, info.layout.feature_dim) for q in queries])
        lengths = np.array([_length(q.length) for q in queries], dtype=np.int64)
        with self._index_lock:
            candidates = self._index(namespace).candidates(
                features, lengths, causal=info.layout.causal, k=gate.candidates, length_penalty=self._length_penalty
            )
        # Every (query, candidate) pair of the batch in one store read and one scoring.
        pairs = [(q, rank, c) for q, found in enumerate(candidates) for rank, c in enumerate(found)]
        stored = self._store.token_ids(namespace, [c.entry_id for _, _, c in pairs])
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

    def read_layer(self, namespace: str, entry_id: int, layer: int, length: int | None = None) -> np.ndarray:
        """One layer of an entry's maps ``(heads, length, length)`` fp16, cropped for causal reuse.

        Raises:
            EntryNotFoundError, ChecksumError: see the store.
            MapShapeError: ``length`` longer than the entry, or a crop of a bidirectional entry.
        """
        maps = self._store.read_layer(namespace, entry_id, layer).numpy()
        return self._crop(namespace, entry_id, maps, length)

    def read_maps(self, namespace: str, entry_id: int, length: int | None = None) -> np.ndarray:
        """All layers of an entry's maps ``(layers, heads, length, length)`` fp16."""
        maps = self._store.read_maps(namespace, entry_id).numpy()
        return self._crop(namespace, entry_id, maps, length)

    def read_outputs(self, namespace: str, entry_id: int) -> np.ndarray | None:
        """An entry's stored final outputs ``(L, hidden)`` fp16, or None."""
        outputs = self._store.read_outputs(namespace, entry_id)
        return None if outputs is None else outputs.numpy()

    def prefetch(self, namespace: str, entry_ids: Iterable[int]) -> int:
        """Queue entries for loading into the DRAM tier; returns how many were queued."""
        ids = list(entry_ids)
        self._store.prefetch(namespace, ids)
        return len(ids)

    def entry(self, namespace: str, entry_id: int) -> EntryInfo:
        """Metadata of one live entry."""
        return self._store.entry(namespace, entry_id)

    # ---- admin --------------------------------------------------------------

    def ingest(self, namespace: str, fingerprint: str, entries: Sequence[NewEntry]) -> IngestResult:
        """Store entries and index their features; all-or-nothing.

        An entry whose token ids are already stored is not stored again; its
        existing id is returned and counted as a duplicate.

        Raises:
            FingerprintMismatchError, NamespaceNotFoundError: see ``check_fingerprint``.
            MapShapeError: an entry does not fit the namespace (nothing is written).
            StoreFullError: the store is full (nothing is written).
        """
        self.check_fingerprint(namespace, fingerprint)
        known = {e.token_hash for e in entries if self._store.find_by_hash(namespace, e.token_hash) is not None}
        ids = self._store.ingest(namespace, entries)
        # Only newly stored entries enter the index; a row repeated within the
        # call maps to one id and is indexed once.
        rows = list({
            entry_id: e
            for entry_id, e in zip(ids, entries, strict=True)
            if e.token_hash not in known and e.feature is not None
        }.items())
        if rows:
            features = np.stack([np.asarray(e.feature, dtype=np.float32) for _, e in rows])
            lengths = np.array([int(e.maps.shape[-1]) for _, e in rows], dtype=np.int64)
            with self._index_lock:
                self._index(namespace).add(np.array([i for i, _ in rows], dtype=np.uint64), features, lengths)
        self._forget_evicted(namespace)
        return IngestResult(entry_ids=ids, duplicates=sum(e.token_hash in known for e in entries))

    def delete(self, namespace: str, entry_ids: Iterable[int]) -> int:
        """Delete entries from the store and the index; returns how many existed."""
        ids = list(entry_ids)
        deleted = self._store.delete(namespace, ids)
        with self._index_lock:
            self._index(namespace).remove(np.array(ids, dtype=np.uint64))
        return deleted

    def compact(self) -> CompactReport:
        """Compact the store, then rebuild every index from the live entries."""
        report = self._store.compact()
        self.rebuild_indexes()
        return report

    def rebuild_indexes(self) -> None:
        """Rebuild every namespace's index from the stored feature vectors."""
        fresh = {info.name: self._build_index(info) for info in self._store.list_namespaces()}
        with self._index_lock:
            self._indexes = fresh

    def dead_threads(self) -> list[str]:
        """Names of the store's background threads that have died (see ``MapStoreBase.dead_threads``)."""
        return self._store.dead_threads()

    def verify(self) -> VerifyReport:
        """Check every stored chunk against its checksum."""
        return self._store.verify()

    def stats(self) -> StoreStats:
        """Store statistics (entries, bytes, codec ratios, DRAM tier, evictions)."""
        return self._store.stats()

    def close(self) -> None:
        """Close the store (flushes hit counters). Idempotent."""
        self._store.close()

    def __enter__(self) -> AttnStoreService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------

    def _index(self, namespace: str) -> BucketedIndex:
        index = self._indexes.get(namespace)
        if index is None:
            # Created by another process sharing the store, or not yet seen here.
            info = self._store.get_namespace(namespace)
            index = self._indexes[namespace] = self._build_index(info)
        return index

    def _build_index(self, info: NamespaceInfo) -> BucketedIndex:
        index = BucketedIndex(info.layout.feature_dim, self._make_index)
        for length in self._store.lengths(info.name):
            rows = [e for e in self._store.entries(info.name, length) if e.feature is not None]
            if rows:
                index.add(
                    np.array([e.id for e in rows], dtype=np.uint64),
                    np.stack([e.feature for e in rows]).astype(np.float32),
                    np.full(len(rows), length, dtype=np.int64),
                )
        log.info("namespace %s: indexed %d entries in %d length buckets", info.name, len(index), len(index.lengths))
        return index

    def _forget_evicted(self, namespace: str) -> None:
        evicted = getattr(self._store, "drain_evicted", None)
        if evicted is None:
            return
        for name, ids in evicted().items():
            with self._index_lock:
                if name in self._indexes:
                    self._indexes[name].remove(np.array(ids, dtype=np.uint64))

    def _crop(self, namespace: str, entry_id: int, maps: np.ndarray, length: int | None) -> np.ndarray:
        stored = maps.shape[-1]
        if length is None or length == stored:
            return maps
        if length > stored or length < 1:
            raise MapShapeError(f"entry {entry_id} has length {stored}; cannot serve length {length}")
        if not self._store.get_namespace(namespace).layout.causal:
            raise MapShapeError(
                f"namespace {namespace!r} is bidirectional: entry {entry_id} (length {stored}) "
                f"cannot be cropped to length {length}"
            )
        return maps[..., :length, :length]


def _feature(feature: np.ndarray, dim: int) -> np.ndarray:
    vector = np.asarray(feature, dtype=np.float32)
    if vector.shape != (dim,):
        raise MapShapeError(f"feature vectors of this namespace have {dim} values, got shape {vector.shape}")
    return vector


def _gate_of(info: NamespaceInfo) -> FidelityGate | None:
    """The fidelity gate in a namespace's projector blob, if any."""
    return None if info.projector is None else gate_from_projector(info.projector)


def _token_ids(query: Query, row: int) -> np.ndarray:
    """A gated query's token ids as ``(L,)`` int64."""
    if query.token_ids is None:
        raise MapShapeError(f"query {row}: a gated lookup needs the row's token ids")
    ids = np.asarray(query.token_ids)
    if ids.shape != (query.length,) or ids.dtype.kind not in "iu":
        raise MapShapeError(f"query {row}: {ids.shape} token ids of dtype {ids.dtype} for length {query.length}")
    return ids.astype(np.int64)


def _length(length: int) -> int:
    if length < 1:
        raise MapShapeError(f"query length must be >= 1, got {length}")
    return int(length)
