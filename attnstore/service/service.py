"""The store service: a map store plus one vector index per namespace and length.

This is what the daemon serves over gRPC and what embedded mode (``local:PATH``)
runs in-process. A lookup decides each row in turn (``exact_lookup``: same token ids,
stored outputs, no forward at all; then ``map_lookup``: the nearest entries,
under a threshold or the namespace's fidelity gate); every row leaves with a
result. ``indexes`` keeps the vector indexes in step with ingest, delete,
eviction and compaction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from attnstore.errors import (
    AttnStoreError,
    ConfigError,
    EntryNotFoundError,
    FingerprintMismatchError,
    MapShapeError,
    NamespaceNotReadyError,
    shown,
)
from attnstore.index import Candidate, FaissIndex, VectorIndex
from attnstore.projector.blob import gate_from_projector
from attnstore.projector.gate import FidelityGate
from attnstore.protocol.records import NamespaceInfo, NamespaceLayout, NewEntry, TokenLimits
from attnstore.service.admission import Admission, AdmissionConfig
from attnstore.service.chunks import ServiceChunks
from attnstore.service.derived_features import DerivedFeatures
from attnstore.service.exact_lookup import ExactOutputs, exact_matches, read_exact_outputs
from attnstore.service.follower import IndexFollower
from attnstore.service.indexes import NamespaceIndexes
from attnstore.service.map_lookup import gate_picks, gated_matches, threshold_matches
from attnstore.service.monitoring import ServiceMonitoring
from attnstore.service.prefixes import ServicePrefixes
from attnstore.service.quarantine import ObjectKind, Quarantine, QuarantinedObject, check_kind, quarantined_now
from attnstore.service.queries import MISS, IngestResult, MatchResult, Query
from attnstore.service.write_back import WriteBackCounter, WriteBackResult, WrittenRow, write_rows
from attnstore.store import CompactReport, MapStoreBase
from attnstore.store.namespace_rules import check_projector_version
from attnstore.store.opening import open_store
from attnstore.store.reports import FeaturesReport

if TYPE_CHECKING:
    from attnstore.store.redis.connection import RedisStats


class AttnStoreService:
    """A map store with its vector indexes; thread-safe.

    Reads of maps go straight to the store (many threads at once); index
    searches and updates are serialised by ``NamespaceIndexes``. Its parts over the
    same store: ``prefixes`` (the prefix tier), ``chunks`` (the chunk tier) and
    ``monitoring`` (what the daemon watches). What the store answers alone (an entry,
    its outputs, prefetch, the DRAM cache's admission, verify, stats) callers ask of
    ``store``: a method here does what the store alone cannot (keep the indexes, the
    gate, admission and quarantine in step with it).
    """

    def __init__(
        self,
        store: MapStoreBase,
        *,
        make_index: Callable[[int], VectorIndex] = FaissIndex,
        length_penalty: float = 1.0,
        redis_stats: Callable[[], RedisStats] | None = None,
        drop_mapped: Callable[[], None] | None = None,
    ) -> None:
        """Wrap an open store and build its indexes from the stored feature vectors.

        Args:
            store: an open map store; the service closes it on ``close()``.
            make_index: builds an empty index of a given dimension for a new bucket.
            length_penalty: predicted distance added per token when a causal query
                matches a longer entry (the training target's length term).
            redis_stats: the Redis client's figures of a store opened from a ``redis://`` URL, for the
                daemon's metrics (``open`` passes them).
            drop_mapped: drops the store's pages this process's reads mapped (``open`` passes it for a
                read-only LMDB store; see :meth:`drop_mapped_pages`).
        """
        self._store = store
        self._drop_mapped = drop_mapped or (lambda: None)
        self._indexes = NamespaceIndexes(store, make_index, length_penalty=length_penalty)
        # A store other daemons write to (Redis) is followed, so their ingests and deletes reach this index.
        self._follower = IndexFollower(self._indexes) if store.supports_change_feed else None
        # namespace -> (the projector blob, its gate): parsed once per projector, not per lookup
        self._gates: dict[str, tuple[bytes, FidelityGate | None]] = {}
        # Counts the exact tier's asks and admits repeated misses for write-back. Off here (embedded mode
        # cannot write back, and should not pay for counting); the daemon sets its --admit-after rule.
        self.admission = Admission(AdmissionConfig(admit_after=0))
        self.write_backs = WriteBackCounter()
        self.derived_features = DerivedFeatures()  # written-back rows' features, from their tokens
        # Prefix blocks and chunks are admitted by the same rule as rows (read as it is now: the daemon sets it).
        self.prefixes = ServicePrefixes(store, self.check_fingerprint, lambda: self.admission,
                                        held=lambda namespace, key: self.quarantine.holds(namespace, "prefix", key))
        self.chunks = ServiceChunks(store, self.check_fingerprint, lambda: self.admission,
                                    held=lambda namespace, key: self.quarantine.holds(namespace, "chunk", key))
        self.monitoring = ServiceMonitoring(store, self._follower, redis_stats)
        self.quarantine = Quarantine()  # objects an audit found wrong: misses for every caller until an admin looks

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
        """Open the store at ``path`` (an LMDB folder or a ``redis://`` URL: see ``store.opening.open_store``)
        and build its indexes.

        Raises:
            StoreNotFoundError: no store there and ``create`` is False.
            FormatVersionError: the store was written in an unknown format version.
            ConfigError: a malformed Redis URL, or ``map_size`` with one.
            UnavailableError: Redis cannot be reached.
        """
        opened = open_store(path, create=create, dram_bytes=dram_bytes, max_bytes=max_bytes, map_size=map_size,
                            readonly=readonly)
        try:
            service = cls(opened.store, redis_stats=opened.redis_stats, drop_mapped=opened.drop_mapped)
        except BaseException:
            # Building the indexes failed: the store (its environment, writer lock and threads) must not
            # outlive the failure, or a retry in this process finds it "open for writing elsewhere".
            opened.store.close()
            raise
        service.drop_mapped_pages()  # building the indexes read every feature vector
        return service

    @property
    def index_bytes(self) -> int:
        """Memory this process holds for the store's indexes, every namespace's (``VectorIndex.nbytes``)."""
        return self._indexes.nbytes

    def drop_mapped_pages(self) -> None:
        """Give back the store's pages this process's reads mapped: a read-only LMDB store's reads map the
        neighbouring pages too, which count in the process's resident memory until dropped (they stay in the
        page cache; a later read maps them again). Embedded clients call it as their reads go on."""
        self._drop_mapped()

    @property
    def store(self) -> MapStoreBase:
        """The underlying map store."""
        return self._store

    # ---- namespaces ---------------------------------------------------------

    def create_namespace(
        self, name: str, *, model: str, fingerprint: str, layout: NamespaceLayout, limits: TokenLimits | None = None
    ) -> NamespaceInfo:
        """Create a namespace (idempotent for the same model, fingerprint and layout; see the store's)."""
        info = self._store.create_namespace(name, model=model, fingerprint=fingerprint, layout=layout, limits=limits)
        self._indexes.ensure(info)
        return info

    def use_admission(self, config: AdmissionConfig) -> Admission:
        """Admit written-back rows by ``config``, counting in the store when it is shared (so every daemon
        of a fleet sees every daemon's asks), else in this process; returns the rule now in force."""
        shared = self._store.admission_counts(config.shape) if self._store.supports_shared_admission else None
        self.admission = Admission(config, shared)
        return self.admission

    def get_namespace(self, name: str) -> NamespaceInfo:
        """The namespace called ``name``; raises NamespaceNotFoundError.

        The store's answer, kept here beside ``create_namespace``, ``drop_namespace`` and ``set_projector``
        (which must go through the service to keep its indexes in step): namespaces are the service's surface,
        read and written in one place by the servicer, the daemon and embedded mode."""
        return self._store.get_namespace(name)

    def list_namespaces(self) -> list[NamespaceInfo]:
        """Every namespace, sorted by name (the store's answer, kept here as ``get_namespace`` is)."""
        return self._store.list_namespaces()

    def drop_namespace(self, name: str) -> None:
        """Remove a namespace, its entries and its index.

        Raises:
            NamespaceNotFoundError: no such namespace.
        """
        self._store.drop_namespace(name)
        self._indexes.drop(name)
        self.prefixes.forget(name)
        self.quarantine.forget(name)

    def set_projector(self, name: str, blob: bytes, *, replace: bool = False) -> NamespaceInfo:
        """Store the namespace's projector weights (safetensors bytes); returns the namespace as it is now.

        See ``MapStoreBase.set_projector``: a different projector needs ``replace``, which drops
        the stored feature vectors, so the namespace's index is rebuilt (empty) with them.

        Raises:
            NamespaceExistsError: another projector is stored and ``replace`` is False.
        """
        before = self._store.get_namespace(name).projector_version
        info = self._store.set_projector(name, blob, replace=replace)
        if before and info.projector_version != before:
            self._indexes.rebuild()
        return info

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

    def gate(self, namespace: str) -> FidelityGate | None:
        """The namespace's fidelity gate, from its projector blob; None when it has none.

        Raises:
            NamespaceNotFoundError: no such namespace.
            FormatVersionError: the projector blob is not safetensors, or its gate is malformed.
        """
        return self._gate_of(self.get_namespace(namespace))

    # ---- serving ------------------------------------------------------------

    def lookup(
        self,
        namespace: str,
        fingerprint: str,
        queries: Sequence[Query],
        *,
        max_distance: float,
        exact: bool = True,
        maps: bool = True,
        gate: bool = False,
        projector_version: int | None = None,
        caller: str | None = None,
    ) -> list[MatchResult]:
        """Match each query: exact tier first, then the map tier.

        Args:
            namespace: namespace name.
            fingerprint: the caller's model fingerprint; must equal the namespace's.
            queries: one per batch row.
            max_distance: threshold on the predicted map distance (ignored when gated).
            exact: consult the exact tier (token hash) first.
            maps: search the map tier for the rest (else they are misses, and their features are not read).
            gate: decide map hits with the namespace's fidelity gate instead of
                ``max_distance``; every query needs its token ids.
            projector_version: the namespace's projector version the features were
                projected with; None states none.
            caller: who asks, for admission (each caller counts once per row; see ``admission``); None: nobody
                that admission counts (a read token, embedded mode), so no row is counted or marked admit.

        Returns:
            One ``MatchResult`` per query, in order.

        Raises:
            NamespaceNotFoundError, FingerprintMismatchError: see ``check_fingerprint``.
            ProjectorChangedError: ``projector_version`` is not the namespace's.
            NamespaceNotReadyError: ``gate`` on a namespace without one.
            MapShapeError: a feature of the wrong dimension, a bad length, or a gated
                query without token ids (or not as many as its length).
            VectorIndexError: NaN/Inf features or a bad threshold.
        """
        info = self.check_fingerprint(namespace, fingerprint)
        if maps:  # an exact-only lookup reads no features: any projector version will do
            check_projector_version(info, projector_version)
        fidelity_gate = self._gate_of(info) if gate and maps else None
        if gate and maps and fidelity_gate is None:
            raise NamespaceNotReadyError(
                f"namespace {namespace!r} has no fidelity gate (built without calibration, or before gates):"
                " look up with a max distance instead"
            )
        results = exact_matches(self._store, namespace, queries) if exact else {}
        held = self.quarantine.held_keys(namespace, "row", [queries[row].token_hash for row in results])
        results = {row: r for row, r in results.items() if queries[row].token_hash not in held}
        pending = [row for row in range(len(queries)) if row not in results]
        if pending and not maps:
            results.update({row: MISS for row in pending})
        elif pending and fidelity_gate is not None:
            results.update(gated_matches(self._indexes, self._store, info, fidelity_gate, queries, pending))
        elif pending:
            results.update(threshold_matches(self._indexes, info, queries, pending, max_distance=max_distance))
        if len(self.quarantine):  # a quarantined row's maps are not replayed either
            results = {row: MISS if self.quarantine.held_entry(namespace, r.entry_id) else r
                       for row, r in results.items()}
        hit_ids = [r.entry_id for r in results.values() if r.entry_id is not None]
        if hit_ids:
            self._store.record_hits(namespace, hit_ids)
        if exact and self.admission.enabled:
            missed = [results[row].kind != "exact" for row in range(len(queries))]
            admitted = self.admission.observe(namespace, [q.token_hash for q in queries], missed, caller)
            results.update({row: replace(results[row], admit=True) for row, yes in enumerate(admitted) if yes})
        return [results[row] for row in range(len(queries))]  # every tier answers each row it is given

    def write_back(
        self, namespace: str, fingerprint: str, rows: Sequence[WrittenRow | AttnStoreError], *,
        writer: str | None = None,
    ) -> WriteBackResult:
        """Store the admitted rows, visible to every lookup at once (``service.write_back``).

        Rows are judged one by one: a bad row (or one that did not decode: its error is given in
        its place) is refused alone and listed in the result; the others are stored. Rows with
        maps become full entries (in the map index at once with the feature the daemon derives from
        their tokens, where the namespace's projector carries its embedding layer; a sent feature is never
        stored), rows
        without outputs-only ones. Rows the admission rule has not admitted are skipped; rows
        already stored count as duplicates. New entries are recorded as ``writer``'s (the name of
        the writing token: ``admin drop-writer`` removes them).

        Raises:
            NamespaceNotFoundError, FingerprintMismatchError: see ``check_fingerprint``.
            WriteBackOffError: the admission rule turns write-back off, or the namespace records no token
                limits (nothing is stored).
            StoreFullError: the store or its disk is full (nothing is stored).
        """
        result = write_rows(
            lambda: self.check_fingerprint(namespace, fingerprint),
            lambda entries, version: self.ingest(namespace, fingerprint, entries, projector_version=version),
            rows, self.admission, writer, self.derived_features,
        )
        self.write_backs.add(result)
        return result

    def read_exact_outputs(
        self, namespace: str, results: Sequence[MatchResult], on_read: Callable[[float], None] | None = None
    ) -> ExactOutputs:
        """The exact hits' outputs, and ``results`` with the hits that cannot be served demoted (``exact_lookup``)."""
        return read_exact_outputs(self._store, namespace, results, on_read)

    def gate_picks(
        self, namespace: str, fingerprint: str, queries: Sequence[Query], gate: FidelityGate
    ) -> list[tuple[Candidate | None, float]]:
        """Each query's most probable candidate under ``gate`` and its probability, hit or not.

        What a gated lookup decides on (it serves the pick when the probability reaches
        ``gate.cutoff``); for evaluations, which need the pick of a miss too. Only the oracle evaluation
        (``attnstore_tools.eval.oracle.search``) calls it; it stays on the service because it searches the
        service's own indexes (private, their searches serialised by ``NamespaceIndexes``) with the function
        a gated lookup uses, so the tool scores what the daemon would serve.

        Raises:
            as ``lookup``.
        """
        info = self.check_fingerprint(namespace, fingerprint)
        return gate_picks(self._indexes, self._store, info, gate, queries, range(len(queries)))

    def read_layer(self, namespace: str, entry_id: int, layer: int, length: int | None = None) -> np.ndarray:
        """One layer of an entry's maps ``(heads, length, length)`` fp16, cropped for causal reuse.

        Raises:
            EntryNotFoundError, ChecksumError: see the store.
            MapShapeError: ``length`` longer than the entry, or a crop of a bidirectional entry.
        """
        maps = self._store.read_layer(namespace, entry_id, layer)
        return self._crop(namespace, entry_id, maps, length)

    def read_maps(self, namespace: str, entry_id: int, length: int | None = None) -> np.ndarray:
        """All layers of an entry's maps ``(layers, heads, length, length)`` fp16."""
        maps = self._store.read_maps(namespace, entry_id)
        return self._crop(namespace, entry_id, maps, length)

    # ---- quarantine ---------------------------------------------------------

    def report_mismatch(
        self, namespace: str, fingerprint: str, kind: str, key: bytes, *, reporter: str, detail: str = "",
    ) -> tuple[QuarantinedObject, bool] | None:
        """Quarantine a stored object an audit found wrong (see ``service.quarantine``): no lookup serves it again
        until an admin releases or drops it.

        Args:
            namespace, fingerprint: the namespace and the reporter's model fingerprint (a node of another model
                cannot judge the namespace's values).
            kind: ``"row"`` (key: the row's token hash), ``"prefix"`` (a block's chain hash) or ``"chunk"``.
            key: the object's key.
            reporter: the caller's name (its token's).
            detail: what the audit measured.

        Returns:
            The quarantined object, with its writer, and whether this report quarantined it (False: an earlier
            one did, and its record is returned); None when no such object is stored.

        Raises:
            NamespaceNotFoundError, FingerprintMismatchError: see ``check_fingerprint``.
            ConfigError: an unknown kind, or a key that is not 32 bytes.
        """
        checked = check_kind(kind)
        if not isinstance(key, bytes) or len(key) != 32:
            raise ConfigError(f"ReportMismatch: key must be 32 bytes, got {shown(key)}")
        self.check_fingerprint(namespace, fingerprint)
        stored, writer, entry_id = self._writer_of(namespace, checked, key)
        if not stored:
            return None
        item = quarantined_now(namespace, checked, key, writer=writer, entry_id=entry_id, reporter=reporter,
                               detail=detail)
        if not self.quarantine.add(item):
            earlier = [i for i in self.quarantine.items(namespace) if (i.kind, i.key) == (checked, key)]
            return (earlier[0] if earlier else item), False
        return item, True

    def keep_quarantine_in(self, path: Path | None) -> Quarantine:
        """Keep the quarantine in the JSON file ``path`` (read now, rewritten at each change; see
        ``service.quarantine``), what it holds in memory replaced by the file's; None: memory only.

        Raises:
            StorageError: ``path`` is not a quarantine file this version reads.
        """
        self.quarantine = Quarantine(path)
        return self.quarantine

    def release_quarantined(self, namespace: str, kind: str, key: bytes, *, drop: bool = False) -> QuarantinedObject:
        """Take an object out of quarantine: served again, or (``drop``, a row or a chunk) deleted from the store.

        Raises:
            EntryNotFoundError: the object is not quarantined.
            ConfigError: an unknown kind, or ``drop`` of a prefix block (kept in quarantine).
        """
        checked = check_kind(kind)
        if drop and checked == "prefix":
            raise ConfigError("a quarantined prefix block cannot be dropped alone (blocks are chained after it):"
                              " release it, or remove its writer's blocks (admin drop-writer)")
        item = self.quarantine.release(namespace, checked, key)
        if item is None:
            raise EntryNotFoundError(f"no quarantined {checked} with key {key.hex()[:16]}... in {shown(namespace)}")
        if drop and item.entry_id is not None:
            self.delete(namespace, [item.entry_id])
        elif drop:  # a chunk
            self._store.require_chunks("chunks.delete()").delete(namespace, [key])
        return item

    def _writer_of(self, namespace: str, kind: ObjectKind, key: bytes) -> tuple[bool, str | None, int | None]:
        """Whether the object is stored, its writer and its entry id (a row's)."""
        if kind == "chunk":
            chunks = self._store.chunks
            return (*chunks.writer_of(namespace, key), None) if chunks is not None else (False, None, None)
        if kind == "prefix":
            prefixes = self._store.prefixes
            return (*prefixes.writer_of(namespace, key), None) if prefixes is not None else (False, None, None)
        ref = self._store.find_by_hashes(namespace, [key])[0]
        if ref is None:
            return False, None, None
        return True, self._store.entry(namespace, ref.id).writer, ref.id

    # ---- admin --------------------------------------------------------------

    def ingest(
        self, namespace: str, fingerprint: str, entries: Sequence[NewEntry], *, projector_version: int | None = None
    ) -> IngestResult:
        """Store entries and index their features; all-or-nothing.

        An entry whose token ids are already stored is not stored again; its
        existing id is returned and counted as a duplicate. Whether an entry is
        new is decided by the store inside its write, so concurrent ingests of
        one new input index it once.

        Raises:
            FingerprintMismatchError, NamespaceNotFoundError: see ``check_fingerprint``.
            ProjectorChangedError: ``projector_version`` is not the namespace's (nothing is written).
            MapShapeError: an entry does not fit the namespace (nothing is written).
            StoreFullError: the store or its disk is full (nothing is written).
        """
        self.check_fingerprint(namespace, fingerprint)
        report = self._store.ingest(namespace, entries, projector_version=projector_version)
        # The first entry of each id this call added or gave a feature; a row repeated within the call is indexed once.
        first = {entry_id: entry for entry_id, entry in reversed(list(zip(report.entry_ids, entries, strict=True)))}
        indexed = [*report.added, *report.featured]
        rows = [(entry_id, first[entry_id]) for entry_id in indexed if first[entry_id].feature is not None]
        if rows:
            self._indexes.add(
                namespace,
                [entry_id for entry_id, _ in rows],
                np.stack([np.asarray(e.feature, dtype=np.float32) for _, e in rows]),
                [_length_of(e) for _, e in rows],
            )
        self._indexes.remove(report.evicted)
        return IngestResult(
            entry_ids=list(report.entry_ids), duplicates=report.duplicates, added=tuple(report.added)
        )

    def set_features(
        self, namespace: str, entry_ids: Sequence[int], features: np.ndarray, *, projector_version: int
    ) -> FeaturesReport:
        """Give stored entries feature vectors of the namespace's projector and index them at once
        (replacing their rows); see ``MapStoreBase.set_features``.

        Raises:
            ConfigError, MapShapeError, NamespaceNotFoundError, ProjectorChangedError: see the store
                (nothing is written or indexed).
        """
        report = self._store.set_features(namespace, entry_ids, features, projector_version=projector_version)
        if report.updated:
            row_of = {entry_id: row for row, entry_id in enumerate(entry_ids)}
            rows = np.asarray(features, dtype=np.float32)[[row_of[i] for i in report.updated]]
            self._indexes.remove({namespace: report.updated})  # an entry's previous vector leaves with it
            self._indexes.add(namespace, report.updated, rows, report.lengths)
        return report

    def delete(self, namespace: str, entry_ids: Iterable[int]) -> int:
        """Delete entries from the store and the index; returns how many existed.

        Raises:
            ConfigError: an id that is not a valid entry id (nothing is deleted).
            NamespaceNotFoundError: no such namespace.
        """
        ids = list(entry_ids)
        deleted = self._store.delete(namespace, ids)
        self._indexes.remove({namespace: ids})
        return deleted

    def compact(self) -> CompactReport:
        """Compact the store, then rebuild every index from the live entries."""
        report = self._store.compact()
        self.rebuild_indexes()
        return report

    def rebuild_indexes(self) -> None:
        """Rebuild every namespace's index from the stored feature vectors."""
        self._indexes.rebuild()

    def close(self) -> None:
        """Stop following the store's log, close the store (flushes hit counters). Idempotent."""
        if self._follower is not None:
            self._follower.stop()
        self._store.close()

    def __enter__(self) -> AttnStoreService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------

    def _gate_of(self, info: NamespaceInfo) -> FidelityGate | None:
        if info.projector is None:
            return None
        cached = self._gates.get(info.name)
        if cached is not None and cached[0] == info.projector:
            return cached[1]
        gate = gate_from_projector(info.projector)
        self._gates[info.name] = (info.projector, gate)
        return gate

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


def _length_of(entry: NewEntry) -> int:
    """An entry's token length: its maps' (an entry with a feature has maps), else its outputs'."""
    array = entry.maps if entry.maps is not None else entry.outputs
    assert array is not None  # the store refused an entry with neither
    return int(array.shape[-1] if entry.maps is not None else array.shape[0])
