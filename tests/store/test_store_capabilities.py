"""Capabilities and optional parts: what each store declares it can do beyond the core, and how a store refuses
what it cannot."""

from __future__ import annotations

import pytest

from attnstore.errors import ConfigError
from attnstore.store import LmdbMapStore, MapStoreBase, MemoryMapStore
from tests.support.stores import small_layout

CAPABILITIES = sorted(name for name in dir(MapStoreBase) if name.startswith("supports_"))
PARTS = ("prefixes", "chunks")  # optional parts: None where a backend lacks them


def test_the_interface_declares_each_optional_ability_as_a_capability():
    assert CAPABILITIES == [
        "supports_change_feed", "supports_compaction", "supports_outputs_only",
        "supports_shared_admission", "supports_writes",
    ]


def test_the_in_memory_twin_has_every_capability_the_lmdb_backend_has(tmp_path):
    with LmdbMapStore.open(tmp_path / "store", create=True) as lmdb_store:
        lmdb_has = {name for name in CAPABILITIES if getattr(lmdb_store, name)}
        lmdb_parts = {name for name in PARTS if getattr(lmdb_store, name) is not None}
    twin = MemoryMapStore()
    twin_has = {name for name in CAPABILITIES if getattr(twin, name)}
    assert lmdb_has <= twin_has
    assert {name for name in PARTS if getattr(twin, name) is not None} == lmdb_parts == set(PARTS)
    assert {"supports_outputs_only", "supports_compaction"} <= lmdb_has


def test_a_read_only_store_declares_it_takes_no_writes(tmp_path):
    LmdbMapStore.open(tmp_path / "store", create=True).close()
    with LmdbMapStore.open(tmp_path / "store", readonly=True) as reader:
        assert not reader.supports_writes


def test_a_store_refuses_the_calls_of_an_ability_it_lacks_naming_the_capability(make_store):
    store = make_store()
    store.create_namespace("ns", model="tiny", fingerprint="f" * 64, layout=small_layout())
    if not store.supports_change_feed:
        with pytest.raises(ConfigError, match="supports_change_feed"):
            store.change_feed()
    if not store.supports_shared_admission:
        with pytest.raises(ConfigError, match="supports_shared_admission"):
            store.admission_counts(None)  # type: ignore[arg-type]
    if store.prefixes is None:
        with pytest.raises(ConfigError, match=r"store.prefixes is None"):
            store.require_prefixes("prefixes.set_layout()")
    else:
        assert store.require_prefixes("prefixes.set_layout()") is store.prefixes
    if store.chunks is None:
        with pytest.raises(ConfigError, match=r"store.chunks is None"):
            store.require_chunks("chunks.set_layout()")
    else:
        assert store.require_chunks("chunks.set_layout()") is store.chunks
