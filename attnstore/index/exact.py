"""``ExactIndex``: brute-force numpy search, the in-memory reference backend for tests."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from attnstore.errors import VectorIndexError
from attnstore.index.base import (
    VectorIndex,
    check_dim,
    check_ids,
    check_k,
    check_vectors,
    empty_result,
)

# A Python dict's int -> int item: its slot and the two int objects.
_DICT_ROW_BYTES = 100


class ExactIndex(VectorIndex):
    """Exact L2 search over all stored vectors.

    Distances are computed in float64 so that an exact duplicate comes back at
    distance 0 whatever the vectors' norms; ties keep storage order.
    """

    kind: ClassVar[str] = "exact"

    def __init__(self, dim: int) -> None:
        """Create an empty index of ``dim``-dimensional vectors."""
        self.dim = check_dim(dim)
        self._vectors = np.empty((0, self.dim), dtype=np.float32)  # (capacity, dim)
        self._ids = np.empty(0, dtype=np.uint64)
        self._rows: dict[int, int] = {}

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """See ``VectorIndex.add``."""
        vectors = check_vectors("ExactIndex.add()", vectors, self.dim)
        ids = check_ids("ExactIndex.add()", ids, vectors.shape[0])
        present = [int(i) for i in ids if int(i) in self._rows]
        if present:
            raise VectorIndexError(f"ExactIndex.add(): ids already present: {present[:5]}")
        n = len(self._rows)
        need = n + ids.shape[0]
        if need > self._vectors.shape[0]:
            capacity = max(need, 2 * self._vectors.shape[0], 16)
            grown = np.empty((capacity, self.dim), dtype=np.float32)
            grown[:n] = self._vectors[:n]
            grown_ids = np.empty(capacity, dtype=np.uint64)
            grown_ids[:n] = self._ids[:n]
            self._vectors, self._ids = grown, grown_ids
        self._vectors[n:need] = vectors
        self._ids[n:need] = ids
        self._rows.update((int(i), n + row) for row, i in enumerate(ids))

    def remove(self, ids: np.ndarray) -> int:
        """See ``VectorIndex.remove``; the last row moves into each hole."""
        removed = 0
        for entry in check_ids("ExactIndex.remove()", ids):
            row = self._rows.pop(int(entry), None)
            if row is None:
                continue
            last = len(self._rows)
            if row != last:
                self._vectors[row] = self._vectors[last]
                self._ids[row] = self._ids[last]
                self._rows[int(self._ids[row])] = row
            removed += 1
        return removed

    def search(self, queries: np.ndarray, k: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """See ``VectorIndex.search``."""
        queries = check_vectors("ExactIndex.search()", queries, self.dim)
        k = check_k("ExactIndex.search()", k)
        n = len(self._rows)
        distances, ids = empty_result(queries.shape[0], k)
        if n == 0 or queries.shape[0] == 0:
            return distances, ids
        stored = self._vectors[:n].astype(np.float64)  # (n, dim)
        q = queries.astype(np.float64)  # (q, dim)
        squared = (q * q).sum(1)[:, None] + (stored * stored).sum(1)[None, :] - 2.0 * q @ stored.T  # (q, n)
        np.maximum(squared, 0.0, out=squared)
        take = min(k, n)
        order = np.argsort(squared, axis=1, kind="stable")[:, :take]  # (q, take)
        distances[:, :take] = np.sqrt(np.take_along_axis(squared, order, axis=1))
        ids[:, :take] = self._ids[order].astype(np.int64)
        return distances, ids

    def __len__(self) -> int:
        """Number of live vectors."""
        return len(self._rows)

    @property
    def nbytes(self) -> int:
        """See ``VectorIndex.nbytes``: the arrays' capacity and the id -> row dict (about 100 bytes a row)."""
        return self._vectors.nbytes + self._ids.nbytes + _DICT_ROW_BYTES * len(self._rows)

    def _meta(self) -> tuple[dict[str, object], dict[str, bytes]]:
        n = len(self._rows)
        return {"count": n}, {
            "ids": self._ids[:n].astype("<u8").tobytes(),
            "vectors": self._vectors[:n].astype("<f4").tobytes(),
        }

    @classmethod
    def _from_meta(cls, dim: int, meta: dict[str, Any], sections: dict[str, bytes]) -> ExactIndex:
        count = int(meta["count"])
        ids = np.frombuffer(sections["ids"], dtype="<u8")
        vectors = np.frombuffer(sections["vectors"], dtype="<f4")
        if ids.shape[0] != count or vectors.size != count * dim:
            raise VectorIndexError(f"ExactIndex.from_bytes(): sections do not hold {count} vectors of dim {dim}")
        index = cls(dim)
        index.add(ids, vectors.reshape(count, dim))
        return index
