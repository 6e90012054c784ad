"""Opening a service: a failure while its indexes are built leaves nothing open behind."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from attnstore.index import ExactIndex
from attnstore.service import AttnStoreService
from attnstore.service.indexes import NamespaceIndexes
from attnstore.store import LmdbMapStore, NamespaceLayout, NewEntry

FP = "f" * 64
LAYOUT = NamespaceLayout(layers=1, heads=1, causal=False, hidden=4, feature_dim=2)


def _store_with_one_entry(path: Path) -> None:
    with AttnStoreService(LmdbMapStore.open(path, create=True), make_index=ExactIndex) as service:
        service.create_namespace("ns", model="tiny", fingerprint=FP, layout=LAYOUT)
        service.ingest("ns", FP, [NewEntry(maps=np.ones((1, 1, 1, 1), np.float32), token_hash=bytes(32),
                                           outputs=np.ones((1, 4), np.float32), feature=np.zeros(2, np.float32))])


def _prefetch_threads() -> int:
    return sum(t.name == "attnstore-prefetch" for t in threading.enumerate())


def test_a_failed_index_build_closes_the_store_so_a_retry_in_the_same_process_opens_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _store_with_one_entry(tmp_path / "store")
    threads = _prefetch_threads()

    def broken(self: NamespaceIndexes, info: object) -> None:
        raise MemoryError("the index did not fit")

    with monkeypatch.context() as patched:
        patched.setattr(NamespaceIndexes, "_build", broken)
        with pytest.raises(MemoryError, match="did not fit"):
            AttnStoreService.open(tmp_path / "store")
    # The environment and the writer lock were released: the retry opens the store (not "open elsewhere").
    with AttnStoreService.open(tmp_path / "store") as service:
        assert [info.name for info in service.list_namespaces()] == ["ns"]
        assert service.store.wait_prefetch(5)
    assert _prefetch_threads() == threads
