"""The compute tier (``tiers.compute``): what it does around its forwards."""

from __future__ import annotations

import pytest

from attnstore.index import ExactIndex
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore
from attnstore_client.cache import AttnCache
from attnstore_client.connection.local import LocalConnection
from attnstore_client.heap import HeapBound
from tests.support.caches import fill_namespace, sentences, tiny_loaded


class _CountingBound(HeapBound):
    """A heap bound that counts its checks (and trims as the real one does)."""

    checks = 0

    def check(self) -> bool:
        type(self).checks += 1
        return super().check()


def test_each_window_the_compute_tier_serves_checks_the_heap_bound_before_and_after_its_forwards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("attnstore_client.tiers.compute.HeapBound", _CountingBound)
    loaded = tiny_loaded("bert")
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    texts = sentences(42, seed=3)
    fill_namespace(service, loaded, texts[:2])
    with AttnCache(loaded, LocalConnection("local:memory", service), maps=False) as cache:
        cache.encode(texts[2:], batch_size=2)  # 40 rows, 2 a batch: 2 windows of 16 batches
        assert cache.last_stats.misses == 40
    assert _CountingBound.checks == 2 * 2
