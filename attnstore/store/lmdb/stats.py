"""Per-namespace, per-length-bucket statistics from the bucket records."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnstore.store.lmdb.catalog import NamespaceState
from attnstore.store.lmdb.env import items_with_prefix
from attnstore.store.lmdb.records import BucketRecord, ns_prefix
from attnstore.store.reports import BucketStats, NamespaceStats

if TYPE_CHECKING:
    from attnstore.store.lmdb.env import Databases


def namespace_stats(txn, db: Databases, states: dict[str, NamespaceState]) -> tuple[NamespaceStats, ...]:
    """Entries and bytes of every namespace, per bucket with live entries (no record scan)."""
    result = []
    for name, state in states.items():
        buckets = []
        with txn.cursor(db=db.buckets) as cursor:
            for key, value in items_with_prefix(cursor, ns_prefix(name)):
                bucket = BucketRecord.from_bytes(value)
                if bucket.live:
                    length = int.from_bytes(key[-4:], "big")
                    buckets.append(
                        BucketStats(length, bucket.live, bucket.stored_bytes, bucket.raw_bytes, bucket.capacity)
                    )
        result.append(
            NamespaceStats(
                name=name,
                codec=state.layout.codec,
                entries=sum(b.entries for b in buckets),
                stored_bytes=sum(b.stored_bytes for b in buckets),
                raw_bytes=sum(b.raw_bytes for b in buckets),
                buckets=tuple(buckets),
            )
        )
    return tuple(result)


def live_lengths(txn, db: Databases, namespace: str) -> list[int]:
    """Token lengths of ``namespace`` with at least one live entry, ascending."""
    with txn.cursor(db=db.buckets) as cursor:
        return [
            int.from_bytes(key[-4:], "big")
            for key, value in items_with_prefix(cursor, ns_prefix(namespace))
            if BucketRecord.from_bytes(value).live > 0
        ]
