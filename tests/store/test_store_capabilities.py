"""Capabilities: what each store declares it can do beyond the core, and how a store refuses what it cannot."""

from __future__ import annotations

import pytest
from store_helpers import small_layout

from attnstore.errors import ConfigError
from attnstore.protocol.chunks import ChunkLayout
from attnstore.protocol.prefix import PrefixLayout
from attnstore.store import MapStore, MapStoreBase, MemoryMapStore

CAPABILITIES = sorted(name for name in dir(MapStoreBase) if name.startswith("supports_"))


def test_the_interface_declares_each_optional_ability_as_a_capability():
    assert CAPABILITIES == [
        "supports_change_feed", "supports_chunks", "supports_compaction", "supports_outputs_only",
        "supports_prefix_blocks",
        "supports_shared_admission", "supports_writes",
    ]


def test_the_in_memory_twin_has_every_capability_the_lmdb_backend_has(tmp_path):
    with MapStore.open(tmp_path / "store", create=True) as lmdb_store:
        lmdb_has = {name for name in CAPABILITIES if getattr(lmdb_store, name)}
    twin_has = {name for name in CAPABILITIES if getattr(MemoryMapStore(), name)}
    assert lmdb_has <= twin_has
    assert {"supports_outputs_only", "supports_prefix_blocks", "supports_compaction"} <= lmdb_has


def test_a_read_only_store_declares_it_takes_no_writes(tmp_path):
    MapStore.open(tmp_path / "store", create=True).close()
    with MapStore.open(tmp_path / "store", readonly=True) as reader:
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
    if not store.supports_prefix_blocks:
        assert store.prefix_layout("ns") is None and store.match_prefix("ns", []) == 0
        with pytest.raises(ConfigError, match="supports_prefix_blocks"):
            store.set_prefix_layout("ns", PrefixLayout(4, 3, 2, 5, 6, "float32"))
    if not store.supports_chunks:
        assert store.chunk_layout("ns") is None and store.chunk_lengths("ns", [bytes(32)]) == [None]
        with pytest.raises(ConfigError, match="supports_chunks"):
            store.set_chunk_layout("ns", ChunkLayout(3, 2, 5, "float32"))
