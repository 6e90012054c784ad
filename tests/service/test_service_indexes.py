"""Index upkeep: a rebuild (after a compaction or a projector replacement) keeps what was written meanwhile."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from attnstore.index import BucketedIndex, ExactIndex
from attnstore.protocol.records import NamespaceInfo
from attnstore.service import AttnStoreService, Query
from attnstore.service.indexes import NamespaceIndexes
from attnstore.store import LmdbMapStore, MemoryMapStore, NamespaceLayout, NewEntry

FP = "f" * 64
LAYOUT = NamespaceLayout(layers=1, heads=1, causal=False, hidden=4, feature_dim=2)


def _entry(seed: int, feature: tuple[float, float]) -> NewEntry:
    return NewEntry(maps=np.ones((1, 1, 1, 1), np.float32), token_hash=seed.to_bytes(32, "little"),
                    outputs=np.full((1, 4), seed, np.float32), feature=np.array(feature, np.float32))


def _nearest(service: AttnStoreService, feature: tuple[float, float]) -> int | None:
    (match,) = service.lookup("ns", FP, [Query(np.array(feature, np.float32), length=1)], max_distance=0.01)
    return match.entry_id


@pytest.fixture(params=["lmdb", "memory"])
def service(request: pytest.FixtureRequest, tmp_path: Path):
    store = LmdbMapStore.open(tmp_path / "store", create=True) if request.param == "lmdb" else MemoryMapStore()
    with AttnStoreService(store, make_index=ExactIndex) as service:
        service.create_namespace("ns", model="tiny", fingerprint=FP, layout=LAYOUT)
        yield service


def _write_during_builds(monkeypatch: pytest.MonkeyPatch, write) -> None:
    """Run ``write()`` once, inside the next index build, after the build has read the store."""
    build = NamespaceIndexes._build
    pending = [write]

    def build_then_write(self: NamespaceIndexes, info: NamespaceInfo) -> BucketedIndex:
        index = build(self, info)
        while pending:
            pending.pop()()
        return index

    monkeypatch.setattr(NamespaceIndexes, "_build", build_then_write)


def test_an_entry_ingested_while_a_compaction_rebuilds_the_indexes_stays_searchable(
    service: AttnStoreService, monkeypatch: pytest.MonkeyPatch
) -> None:
    (old,) = service.ingest("ns", FP, [_entry(1, (0.0, 0.0))]).entry_ids
    added: list[int] = []
    _write_during_builds(monkeypatch, lambda: added.extend(service.ingest("ns", FP, [_entry(2, (5.0, 5.0))]).entry_ids))
    service.compact()
    assert added and _nearest(service, (5.0, 5.0)) == added[0]
    assert _nearest(service, (0.0, 0.0)) == old


def test_an_entry_deleted_while_the_indexes_are_rebuilt_stays_out_of_them(
    service: AttnStoreService, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = service.ingest("ns", FP, [_entry(1, (0.0, 0.0)), _entry(2, (5.0, 5.0))]).entry_ids
    _write_during_builds(monkeypatch, lambda: service.delete("ns", [ids[1]]))
    service.rebuild_indexes()
    assert _nearest(service, (5.0, 5.0)) is None
    assert _nearest(service, (0.0, 0.0)) == ids[0]
