"""``FaissIndex``: exact faiss search while a bucket is small, HNSW (as in the paper) past a size."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import faiss
import numpy as np

from attnstore.errors import ConfigError, VectorIndexError
from attnstore.index.base import (
    VectorIndex,
    check_dim,
    check_ids,
    check_k,
    check_vectors,
    empty_result,
)

logger = logging.getLogger(__name__)

# IndexIDMap2's reverse map (an unordered_map node per id); a Python set's slot and int per id; HNSW's links
# above level 0 (a 1/M share of the vectors per level, M links each) as a factor on level 0's 2M.
_REVERSE_MAP_ENTRY_BYTES = 40
_SET_ENTRY_BYTES = 60
_HNSW_LEVELS_FACTOR = 1.05


@dataclass(frozen=True, slots=True)
class FaissIndexConfig:
    """Settings of a ``FaissIndex``; stored with its bytes."""

    # Below this many vectors a flat scan is exact and already fast (10K x 128
    # floats is ~0.3 ms per query); at and above it the index switches to HNSW.
    hnsw_threshold: int = 10_000
    # HNSW graph degree: 32 is the usual choice for 128-d vectors (recall vs memory).
    hnsw_m: int = 32
    # Build-time beam width: higher builds a better graph, more slowly.
    ef_construction: int = 64
    # Query-time beam width: the recall/latency knob (64 keeps p50 well under 0.5 ms at 100K).
    ef_search: int = 64
    # HNSW cannot delete in place: deleted ids are masked at search time, and the
    # graph is rebuilt once this share of its vectors is deleted.
    rebuild_fraction: float = 0.2

    def __post_init__(self) -> None:
        for name in ("hnsw_threshold", "hnsw_m", "ef_construction", "ef_search"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"FaissIndexConfig: {name} must be an int >= 1, got {value!r}")
        if not 0.0 < self.rebuild_fraction <= 1.0:
            raise ConfigError(f"FaissIndexConfig: rebuild_fraction must be in (0, 1], got {self.rebuild_fraction!r}")


class FaissIndex(VectorIndex):
    """faiss ``IndexIDMap2`` over ``IndexFlatL2`` (exact) or ``IndexHNSWFlat`` (approximate).

    Entry ids (uint64 below 2**63) are used as faiss's int64 labels unchanged. The
    backend switches from flat to HNSW when an ``add`` reaches
    ``config.hnsw_threshold`` vectors, and back to flat when a rebuild finds fewer
    than half that many.
    """

    kind: ClassVar[str] = "faiss"

    def __init__(self, dim: int, config: FaissIndexConfig | None = None) -> None:
        """Create an empty (flat) index of ``dim``-dimensional vectors."""
        self.dim = check_dim(dim)
        self.config = config or FaissIndexConfig()
        self._hnsw = False
        self._index = self._new_index(hnsw=False)
        self._live: set[int] = set()
        # Ids deleted from the HNSW graph but still in it, masked at search time.
        self._dead: set[int] = set()
        self._params: faiss.SearchParameters | None = None
        self._selector_refs: tuple[object, ...] = ()

    @property
    def is_hnsw(self) -> bool:
        """Whether searches are approximate (HNSW) rather than exact (flat)."""
        return self._hnsw

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """See ``VectorIndex.add``; may switch the backend to HNSW."""
        vectors = check_vectors("FaissIndex.add()", vectors, self.dim)
        ids = check_ids("FaissIndex.add()", ids, vectors.shape[0])
        present = [int(i) for i in ids if int(i) in self._live]
        if present:
            raise VectorIndexError(f"FaissIndex.add(): ids already present: {present[:5]}")
        if ids.size == 0:
            return
        if self._dead.intersection(int(i) for i in ids):
            # A masked copy of a re-added id would hide the new one: drop the masks first.
            self.rebuild()
        total = len(self._live) + ids.shape[0]
        if not self.is_hnsw and total >= self.config.hnsw_threshold:
            old_ids, old_vectors = self._live_arrays()
            self._rebuild_from(np.concatenate([old_ids, ids]), np.concatenate([old_vectors, vectors]), hnsw=True)
        else:
            self._index.add_with_ids(vectors, ids.astype(np.int64))
        self._live.update(int(i) for i in ids)

    def remove(self, ids: np.ndarray) -> int:
        """See ``VectorIndex.remove``; HNSW masks deleted ids and rebuilds past ``rebuild_fraction``."""
        gone = [int(i) for i in check_ids("FaissIndex.remove()", ids) if int(i) in self._live]
        if not gone:
            return 0
        self._live.difference_update(gone)
        if self.is_hnsw:
            self._dead.update(gone)
            self._params = None
            if len(self._dead) >= self.config.rebuild_fraction * self._index.ntotal:
                self.rebuild()
        else:
            self._index.remove_ids(faiss.IDSelectorBatch(np.asarray(gone, dtype=np.int64)))
        return len(gone)

    def rebuild(self) -> None:
        """Rebuild densely from the live vectors, dropping masked ids; picks flat or HNSW by size."""
        ids, vectors = self._live_arrays()
        # Hysteresis: a graph shrinks back to flat only at half the threshold, so a
        # bucket hovering around the threshold does not flip on every rebuild.
        floor = self.config.hnsw_threshold // 2 if self.is_hnsw else self.config.hnsw_threshold
        self._rebuild_from(ids, vectors, hnsw=ids.shape[0] >= floor)

    def search(self, queries: np.ndarray, k: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """See ``VectorIndex.search``; exact while flat, approximate once HNSW."""
        queries = check_vectors("FaissIndex.search()", queries, self.dim)
        k = check_k("FaissIndex.search()", k)
        if not self._live or queries.shape[0] == 0:
            return empty_result(queries.shape[0], k)
        squared, labels = self._index.search(queries, k, params=self._search_params())
        missing = labels < 0
        # faiss's BLAS path (batches of 20+) can round a zero distance slightly negative.
        distances = np.sqrt(np.maximum(squared, 0.0)).astype(np.float32)
        distances[missing] = np.inf
        labels[missing] = -1
        return distances, labels.astype(np.int64, copy=False)

    def __len__(self) -> int:
        """Number of live vectors."""
        return len(self._live)

    @property
    def nbytes(self) -> int:
        """See ``VectorIndex.nbytes``: per vector in faiss, its floats, its id and the id map's reverse entry,
        and in HNSW its links (``2 * hnsw_m`` at level 0, a few more above); per live id, this wrapper's set."""
        total = self._index.ntotal
        per_vector = 4 * self.dim + 8 + _REVERSE_MAP_ENTRY_BYTES
        if self.is_hnsw:
            per_vector += int(4 * 2 * self.config.hnsw_m * _HNSW_LEVELS_FACTOR)
        return total * per_vector + _SET_ENTRY_BYTES * (len(self._live) + len(self._dead))

    def _new_index(self, *, hnsw: bool) -> faiss.IndexIDMap2:
        inner: faiss.Index
        if hnsw:
            graph = faiss.IndexHNSWFlat(self.dim, self.config.hnsw_m)
            graph.hnsw.efConstruction = self.config.ef_construction
            graph.hnsw.efSearch = self.config.ef_search
            inner = graph
        else:
            inner = faiss.IndexFlatL2(self.dim)
        # faiss's Python wrapper keeps ``inner`` alive as long as the IDMap.
        return faiss.IndexIDMap2(inner)

    def _rebuild_from(self, ids: np.ndarray, vectors: np.ndarray, *, hnsw: bool) -> None:
        logger.debug("FaissIndex: rebuilding %s vectors as %s", ids.shape[0], "HNSW" if hnsw else "flat")
        index = self._new_index(hnsw=hnsw)
        if ids.size:
            index.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), ids.astype(np.int64))
        self._index, self._hnsw = index, hnsw
        self._dead = set()
        self._params = None

    def _live_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Live ids (uint64) and their vectors (n, dim), read back from faiss's storage."""
        labels = faiss.vector_to_array(self._index.id_map)
        inner = faiss.downcast_index(self._index.index)
        storage = faiss.downcast_index(inner.storage) if isinstance(inner, faiss.IndexHNSW) else inner
        assert isinstance(storage, faiss.IndexFlat)  # _new_index stores the vectors flat either way
        vectors = faiss.rev_swig_ptr(storage.get_xb(), labels.shape[0] * self.dim).reshape(-1, self.dim).copy()
        if self._dead:
            keep = ~np.isin(labels, np.fromiter(self._dead, dtype=np.int64, count=len(self._dead)))
            labels, vectors = labels[keep], vectors[keep]
        return labels.astype(np.uint64), vectors

    def _search_params(self) -> faiss.SearchParameters | None:
        if not self.is_hnsw:
            return None
        if self._params is None:
            params = faiss.SearchParametersHNSW()  # type: ignore[attr-defined]  # missing from faiss's stubs
            params.efSearch = self.config.ef_search
            refs: tuple[object, ...] = ()
            if self._dead:
                batch = faiss.IDSelectorBatch(np.fromiter(self._dead, dtype=np.int64, count=len(self._dead)))
                selector = faiss.IDSelectorNot(batch)
                params.sel = selector
                # faiss keeps raw pointers: the selectors must outlive the params.
                refs = (batch, selector)
            self._params, self._selector_refs = params, refs
        return self._params

    def _meta(self) -> tuple[dict[str, object], dict[str, bytes]]:
        dead = np.fromiter(self._dead, dtype=np.uint64, count=len(self._dead))
        meta: dict[str, object] = {"config": dataclasses.asdict(self.config)}
        return meta, {
            "faiss": faiss.serialize_index(self._index).tobytes(),
            "dead": np.sort(dead).astype("<u8").tobytes(),
        }

    @classmethod
    def _from_meta(cls, dim: int, meta: dict[str, Any], sections: dict[str, bytes]) -> FaissIndex:
        config = FaissIndexConfig(**meta["config"])
        try:
            raw = faiss.deserialize_index(np.frombuffer(sections["faiss"], dtype=np.uint8))
        except RuntimeError as exc:
            raise VectorIndexError(f"FaissIndex.from_bytes(): faiss could not read the index: {exc}") from exc
        index = faiss.downcast_index(raw)
        # The downcast proxy must own the C++ object, or it dies with ``raw``. ``this`` is
        # the SWIG proxy's handle on the C++ object, which faiss's stubs do not declare.
        index.this.own(raw.this.own())  # type: ignore[attr-defined]
        raw.this.disown()  # type: ignore[attr-defined]
        if not isinstance(index, faiss.IndexIDMap2) or index.d != dim:
            raise VectorIndexError(
                f"FaissIndex.from_bytes(): expected an IndexIDMap2 of dim {dim}, got {type(index).__name__}"
            )
        inner = faiss.downcast_index(index.index)
        if isinstance(inner, faiss.IndexHNSW):
            inner.hnsw.efSearch = config.ef_search
        result = cls(dim, config)
        result._index, result._hnsw = index, isinstance(inner, faiss.IndexHNSW)
        dead = np.frombuffer(sections["dead"], dtype="<u8")
        result._dead = {int(i) for i in dead}
        result._live = {int(i) for i in faiss.vector_to_array(index.id_map)} - result._dead
        return result
