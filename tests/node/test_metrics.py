"""The node's row counts: a ``tier`` label for every kind of row the client tallies, in the published values."""

from __future__ import annotations

from types import MappingProxyType

from attnstore_client.call.rows import ROW_KINDS
from attnstore_client.stats import CacheStats
from attnstore_node.metrics import ROW_LABELS, TIERS, NodeMetrics


def test_every_row_kind_has_a_tier_label_and_the_published_values_stay() -> None:
    assert set(ROW_LABELS) == set(ROW_KINDS)
    assert TIERS == ("local_exact", "store_exact", "prefix", "chunk", "map", "computed", "fallback", "deduplicated")


def test_a_call_counts_each_row_under_the_label_of_its_kind() -> None:
    metrics = NodeMetrics()
    stats = CacheStats(rows=30, deduplicated=2, exact_hits=5, local_hits=2, prefix_hits=3, chunk_hits=4, map_hits=6,
                       misses=7, fallbacks=MappingProxyType({"timeout": 1, "unavailable": 2}))
    metrics.record_call(stats, requests=1, tokens=100, seconds=0.1)
    counted = {tier: metrics.registry.get_sample_value("attnstore_node_rows_total", {"tier": tier}) for tier in TIERS}
    assert counted == {"local_exact": 2, "store_exact": 3, "prefix": 3, "chunk": 4, "map": 6, "computed": 7,
                       "fallback": 3, "deduplicated": 2}
