"""The change feed of a store that several processes share: what every process's indexes follow.

A store that other processes write to (the Redis backend: any number of
daemons; Redis's own maxmemory policy) logs each ingest and delete per
namespace. A process builds a namespace's vector index from
:meth:`ChangeFeed.index_state` (a snapshot plus the log after it) and then
applies :meth:`ChangeFeed.changes` in log order. Positions are opaque strings
the feed hands out; they only move forward. Applying a change twice is harmless
(ids are never reused), so a state read beside the log may overlap it.

Entries may also vanish without a logged delete (Redis evicted them): callers
ask :meth:`ChangeFeed.missing` before serving an entry the index proposes, and
the feed then logs the removal so every process forgets it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class IndexRows:
    """Entries as the vector index holds them: id, token length and feature, one row each."""

    ids: np.ndarray  # (n,) uint64
    lengths: np.ndarray  # (n,) int64
    features: np.ndarray  # (n, feature_dim) float32

    @classmethod
    def empty(cls, feature_dim: int) -> IndexRows:
        """No rows."""
        return cls(np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros((0, feature_dim), np.float32))

    @classmethod
    def from_dict(cls, rows: dict[int, tuple[int, np.ndarray]], feature_dim: int) -> IndexRows:
        """Rows of ``{id: (length, feature)}``, in id order."""
        if not rows:
            return cls.empty(feature_dim)
        ids = sorted(rows)
        return cls(
            np.array(ids, dtype=np.uint64),
            np.array([rows[i][0] for i in ids], dtype=np.int64),
            np.stack([rows[i][1] for i in ids]).astype(np.float32),
        )

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@dataclass(frozen=True, slots=True)
class IndexChange:
    """One logged change of a namespace: entries added (with their index rows), ids removed, or every
    feature dropped (``reset``: the projector was replaced; the index starts empty)."""

    added: IndexRows | None = None
    removed: tuple[int, ...] = ()
    reset: bool = False


@dataclass(frozen=True, slots=True)
class IndexState:
    """A namespace's index rows, including every change up to ``position`` in its log (and maybe some after)."""

    rows: IndexRows
    position: str


@dataclass(frozen=True, slots=True)
class ChangeBatch:
    """Changes logged after a position, in order, and the position after the last of them."""

    changes: list[IndexChange]
    position: str
    # The log no longer holds every change after the position asked for (it was trimmed past it, or a record
    # of it did not decode): the caller must rebuild from ``index_state`` instead of applying ``changes``.
    rebuild: bool = False
    skipped: int = 0  # records that did not decode (logged, never applied: the rebuild reads the keys instead)


class ChangeFeed(ABC):
    """A store's per-namespace log of index changes. Thread-safe."""

    @abstractmethod
    def index_state(self, namespace: str) -> IndexState:
        """The namespace's live index rows now, and the log position they include.

        Raises:
            NamespaceNotFoundError: no such namespace.
        """

    @abstractmethod
    def changes(self, namespace: str, position: str, *, limit: int = 1000) -> ChangeBatch:
        """Up to ``limit`` changes logged after ``position``, oldest first.

        Raises:
            NamespaceNotFoundError: no such namespace.
        """

    @abstractmethod
    def catalog_version(self) -> str:
        """A token that changes whenever a namespace is created, dropped or given a projector."""

    @abstractmethod
    def store_identity(self) -> str | None:
        """Read the store's identity again; None while the store is lost.

        It changes when the store was replaced under this process (its data lost, and the
        store made anew): ids may then be reused, so the store drops everything it cached of
        the old one, and the caller must rebuild its indexes from scratch.
        """

    @abstractmethod
    def missing(self, namespace: str, ids: Sequence[int]) -> list[int]:
        """The ids among ``ids`` no longer stored (one read for the lot).

        The store forgets them (they leave its own indexes, and their removal is
        logged, so every process following the feed drops them too).
        """
