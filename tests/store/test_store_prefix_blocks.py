"""Prefix blocks in every store backend that keeps them (``store.prefixes``): one suite for all."""

from __future__ import annotations

import numpy as np
import pytest

from attnstore.errors import (
    ChecksumError,
    ConfigError,
    FingerprintMismatchError,
    MapShapeError,
    PrefixBlockError,
    PrefixBlockMissingError,
)
from attnstore.protocol.prefix import PrefixBlock, PrefixLayout, chain_hashes, usable_blocks
from attnstore.store import MapStoreBase
from attnstore.store.prefix import records as prefix_records
from tests.support.stores import small_layout

LAYOUT = PrefixLayout(block_size=4, layers=3, kv_heads=2, head_dim=5, hidden=6, dtype="float32")


@pytest.fixture
def store(make_store) -> MapStoreBase:
    """Every backend that stores prefix blocks (``make_store``, tests/store/conftest.py), with namespace ``ns``."""
    opened = make_store()
    if opened.prefixes is None:
        backend = type(getattr(opened, "inner", opened)).__name__
        pytest.skip(f"{backend} keeps no prefix blocks (store.prefixes is None)")
    opened.create_namespace("ns", model="tiny", fingerprint="f" * 64, layout=small_layout())
    return opened


def _chain(tokens: list[int], layout: PrefixLayout = LAYOUT, seed: int = 0) -> list[PrefixBlock]:
    rng = np.random.default_rng(seed)
    hashes = chain_hashes(tokens, layout.block_size)
    return [
        PrefixBlock(
            chain_hash,
            hashes[i - 1] if i else None,
            rng.standard_normal((layout.layers, *layout.layer_shape)).astype(layout.dtype),
            rng.standard_normal((layout.block_size, layout.hidden)).astype(layout.dtype),
        )
        for i, chain_hash in enumerate(hashes)
    ]


def test_chain_hashes_depend_on_every_earlier_token_and_on_the_block_size():
    a = chain_hashes(list(range(12)), 4)
    b = chain_hashes([99, *range(1, 12)], 4)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b, strict=True))
    assert chain_hashes(list(range(12)), 4)[:1] == chain_hashes(list(range(4)), 4)
    assert chain_hashes(list(range(12)), 2)[1] != a[0]
    assert usable_blocks(9, 4) == 2 and usable_blocks(8, 4) == 1 and usable_blocks(4, 4) == 0


def test_blocks_round_trip_keys_values_and_hidden_states_concatenated_over_the_chain(store):
    store.prefixes.set_layout("ns", LAYOUT)
    blocks = _chain(list(range(12)))
    assert store.prefixes.put("ns", blocks) == 3
    assert store.prefixes.put("ns", blocks) == 0  # stored once
    hashes = [b.chain_hash for b in blocks]
    for layer in range(LAYOUT.layers):
        expected = np.concatenate([b.kv[layer] for b in blocks], axis=2)  # (2, KVH, 12, d)
        assert np.array_equal(store.prefixes.read_layer("ns", hashes, layer), expected)
    assert np.array_equal(store.prefixes.read_hidden("ns", hashes[:2]), np.concatenate([b.hidden for b in blocks[:2]]))
    assert store.prefixes.layout("ns") == LAYOUT


def test_a_lookup_stops_at_the_first_block_not_stored(store):
    store.prefixes.set_layout("ns", LAYOUT)
    stored = _chain(list(range(8)))
    store.prefixes.put("ns", stored)
    longer = chain_hashes([*range(8), 50, 51, 52, 53], 4)
    assert store.prefixes.match("ns", longer) == 2
    assert store.prefixes.match("ns", chain_hashes([7, *range(1, 12)], 4)) == 0
    assert store.prefixes.match("ns", []) == 0


def test_a_block_whose_parent_is_not_stored_is_refused_and_nothing_of_the_call_is_written(store):
    store.prefixes.set_layout("ns", LAYOUT)
    blocks = _chain(list(range(12)))
    with pytest.raises(MapShapeError, match="parent"):
        store.prefixes.put("ns", [blocks[0], blocks[2]])
    assert store.prefixes.match("ns", [b.chain_hash for b in blocks]) == 0
    assert store.stats().prefix_blocks == 0


def test_a_failure_mid_ingest_leaves_no_block_of_the_call_visible(store, monkeypatch):
    store.prefixes.set_layout("ns", LAYOUT)
    blocks = _chain(list(range(16)))
    real = prefix_records.block_parts
    calls = []

    def failing(block):
        calls.append(block)
        if len(calls) == 3:
            raise OSError("disk gone mid-ingest")
        return real(block)

    monkeypatch.setattr("attnstore.store.lmdb.prefix_blocks.block_parts", failing)
    monkeypatch.setattr("attnstore.store.memory.prefix_blocks.block_parts", failing)
    with pytest.raises(OSError):
        store.prefixes.put("ns", blocks)
    assert store.prefixes.match("ns", [b.chain_hash for b in blocks]) == 0
    assert store.stats().prefix_blocks == 0


def test_another_block_size_or_shape_is_refused(store):
    store.prefixes.set_layout("ns", LAYOUT)
    other = PrefixLayout(8, LAYOUT.layers, LAYOUT.kv_heads, LAYOUT.head_dim, LAYOUT.hidden, LAYOUT.dtype)
    with pytest.raises(FingerprintMismatchError):
        store.prefixes.set_layout("ns", other)
    with pytest.raises(MapShapeError, match="kv must be"):
        store.prefixes.put("ns", _chain(list(range(8)), other))
    half = _chain(list(range(4)))[0]
    with pytest.raises(MapShapeError, match="float32"):
        store.prefixes.put("ns", [PrefixBlock(half.chain_hash, None, half.kv.astype(np.float16), half.hidden)])


def test_a_namespace_without_a_prefix_layout_matches_nothing_and_refuses_blocks(store):
    assert store.prefixes.layout("ns") is None
    assert store.prefixes.match("ns", chain_hashes(list(range(8)), 4)) == 0
    with pytest.raises(FingerprintMismatchError):
        store.prefixes.put("ns", _chain(list(range(4))))
    with pytest.raises(ConfigError):
        store.prefixes.set_layout("ns", {"block_size": 4})


def test_a_corrupt_block_fails_its_read_and_verify_names_it(store, make_store):
    store.prefixes.set_layout("ns", LAYOUT)
    blocks = _chain(list(range(12)))
    store.prefixes.put("ns", blocks)
    make_store.corrupt_prefix_part(store, "ns", blocks[1].chain_hash, 2)
    hashes = [b.chain_hash for b in blocks]
    with pytest.raises(ChecksumError, match=f"prefix block 1 of 3 in the chain \\({blocks[1].chain_hash.hex()}\\)"
                       ".*part 2 \\(layer 2\\)") as caught:
        store.prefixes.read_layer("ns", hashes, 2)
    assert isinstance(caught.value, PrefixBlockError)
    assert (caught.value.block, caught.value.chain_hash) == (1, blocks[1].chain_hash)
    assert store.prefixes.read_layer("ns", hashes, 1).shape == (2, 2, 12, 5)  # other layers are sound
    report = store.verify()
    assert not report.ok and report.prefix_blocks_checked == 3
    assert any(blocks[1].chain_hash.hex() in problem for problem in report.problems)


def test_stats_count_blocks_and_their_bytes_and_dropping_the_namespace_removes_them(store):
    store.prefixes.set_layout("ns", LAYOUT)
    store.prefixes.put("ns", _chain(list(range(12))))
    stats = store.stats()
    assert stats.prefix_blocks == 3 and stats.prefix_bytes == 3 * LAYOUT.block_bytes
    store.drop_namespace("ns")
    assert store.stats().prefix_blocks == 0
    store.create_namespace("ns", model="tiny", fingerprint="f" * 64, layout=small_layout())
    assert store.prefixes.layout("ns") is None


def test_a_chain_is_served_only_from_its_first_block_never_later_blocks_without_their_parents(store):
    store.prefixes.set_layout("ns", LAYOUT)
    blocks = _chain(list(range(12)))
    store.prefixes.put("ns", blocks)
    hashes = [b.chain_hash for b in blocks]
    assert store.prefixes.read_layer("ns", hashes[:2], 0).shape == (2, 2, 8, 5)
    for request, bad in ((hashes[1:], 0), ([hashes[0], hashes[2]], 1)):
        with pytest.raises(PrefixBlockMissingError, match=f"prefix block {bad} of 2 .*not the child") as caught:
            store.prefixes.read_layer("ns", request, 0)
        assert caught.value.block == bad


def test_a_blocks_writer_is_kept_and_drop_writer_removes_its_blocks_with_every_block_chained_after_them(store):
    import dataclasses

    store.prefixes.set_layout("ns", LAYOUT)
    first, second, third = _chain(list(range(12)))
    aside = _chain([7] * 8, seed=1)
    store.prefixes.put("ns", [first])  # a build's: no writer
    store.prefixes.put("ns", [dataclasses.replace(second, writer="node-a")])
    store.prefixes.put("ns", [dataclasses.replace(third, writer="node-b")])  # chained after node-a's block
    store.prefixes.put("ns", [dataclasses.replace(b, writer="node-b") for b in aside])
    with pytest.raises(ConfigError, match="non-empty"):
        store.prefixes.drop_writer("ns", "")
    assert store.prefixes.drop_writer("ns", "node-a", dry_run=True) == 2
    chain = [first.chain_hash, second.chain_hash, third.chain_hash]
    assert store.prefixes.match("ns", chain) == 3
    # What the quarantine reports of one block: stored, and its writer (None: an admin's build).
    assert [store.prefixes.writer_of("ns", h) for h in chain] == [(True, None), (True, "node-a"), (True, "node-b")]
    assert store.prefixes.drop_writer("ns", "node-a") == 2
    assert store.prefixes.match("ns", chain) == 1
    assert store.prefixes.writer_of("ns", chain[1]) == (False, None)
    assert store.prefixes.match("ns", [b.chain_hash for b in aside]) == 2
    assert store.prefixes.drop_writer("ns", "node-b") == 2
    assert store.prefixes.match("ns", [b.chain_hash for b in aside]) == 0
    np.testing.assert_array_equal(store.prefixes.read_layer("ns", chain[:1], 0), first.kv[0])


def test_a_record_written_before_writers_were_kept_decodes_with_no_writer():
    record = prefix_records.BlockRecord(1.0, None, (1, 2, 3), "node-a")
    assert prefix_records.BlockRecord.decode(record.encode()) == record
    old = prefix_records.BlockRecord(1.0, b"\1" * 32, (4,)).encode()
    assert prefix_records.BlockRecord.decode(old) == prefix_records.BlockRecord(1.0, b"\1" * 32, (4,), None)
