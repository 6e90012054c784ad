"""The byte cap's rule, written once for every backend: what to evict, least recently used first, and how far.

A store over its cap (``max_bytes``) evicts entries and chunks, the least recently used
first (the later of storing and last hit or read), until it holds at most
``low_water * max_bytes``: evicting below the cap, not just to it, makes eviction (a walk
of everything stored) run once per many writes, not on each. Backends list what they hold
as candidates (their own storage's walk) and delete the victims (their own writes); the
order and the stopping point are decided here only.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from attnstore.errors import ConfigError

DEFAULT_LOW_WATER = 0.9  # the byte cap evicts down to this fraction of max_bytes


def check_cap(max_bytes: int | None, low_water: float) -> None:
    """Check a byte cap and its low-water mark, as every backend takes them.

    Raises:
        ConfigError: ``max_bytes`` below 1 (None is no cap), or ``low_water`` outside (0, 1].
    """
    if max_bytes is not None and max_bytes < 1:
        raise ConfigError(f"max_bytes must be positive or None, got {max_bytes}")
    if not 0.0 < low_water <= 1.0:
        raise ConfigError(f"evict_low_water must be in (0, 1], got {low_water}")


K = TypeVar("K", int, bytes)


@dataclass(frozen=True, slots=True)
class Candidate(Generic[K]):
    """Something stored the byte cap may evict: an entry (``key`` its id) or a chunk (``key`` its key)."""

    recency: float  # the later of its storing and its last hit or read (unix time): the least recent go first
    namespace: str
    key: K
    nbytes: int  # the stored bytes its eviction frees


class EntryCandidate(Candidate[int]):
    """A stored entry the byte cap may evict (``key``: its id)."""

    __slots__ = ()


class ChunkCandidate(Candidate[bytes]):
    """A stored chunk the byte cap may evict (``key``: its key)."""

    __slots__ = ()


C = TypeVar("C", bound="Candidate[Any]")


@dataclass(frozen=True, slots=True)
class EvictionPlan(Generic[C]):
    """What to evict, in order, and the bytes stored once it is gone."""

    victims: list[C]
    left: int


def plan_eviction(used: int, max_bytes: int | None, low_water: float, candidates: Iterable[C]) -> EvictionPlan[C]:
    """The candidates to evict, taken in the order given (least recent first), so that ``used`` bytes end at
    most at ``low_water * max_bytes``; nothing while ``used`` is within the cap.

    Args:
        used: bytes stored, including what a write is about to add.
        max_bytes: the cap (None: no cap, nothing evicted).
        low_water: the fraction of the cap evicted down to, in (0, 1].
        candidates: what may be evicted, least recent first (see :func:`least_recent_first`); read only as far
            as needed, so a backend may list them lazily.

    Returns:
        The victims and the bytes left; ``left`` is over the cap when the candidates ran out first.
    """
    if max_bytes is None or used <= max_bytes:
        return EvictionPlan([], used)
    target = int(max_bytes * low_water)
    victims: list[C] = []
    for candidate in candidates:
        if used <= target:
            break
        victims.append(candidate)
        used -= candidate.nbytes
    return EvictionPlan(victims, used)


def least_recent_first(
    chunks: Iterable[ChunkCandidate], *entries: Iterable[EntryCandidate]
) -> Iterator[EntryCandidate | ChunkCandidate]:
    """Entries and chunks merged in eviction order: by recency, then namespace; at a tie an entry before a chunk.

    Args:
        chunks: chunk candidates in any order (sorted here: :func:`by_recency`).
        entries: entry candidates, each iterable already in that order (one per namespace, read lazily; or one
            for every namespace, see :func:`by_recency`).
    """
    # heapq.merge breaks ties by the iterables' order: the entries' come before the chunks'.
    return heapq.merge(*entries, by_recency(chunks), key=_order)


def by_recency(candidates: Iterable[C]) -> list[C]:
    """Candidates sorted least recent first (ties: by namespace, then key)."""
    return sorted(candidates, key=lambda c: (c.recency, c.namespace, c.key))


def _order(candidate: Candidate[Any]) -> tuple[float, str]:
    return candidate.recency, candidate.namespace
