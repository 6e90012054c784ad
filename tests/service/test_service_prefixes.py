"""The service's prefix put: it gives a namespace its prefix layout, is all or nothing, needs parents first and
counts duplicates; another model or prefix layout is refused naming both (in-memory store)."""

from __future__ import annotations

import numpy as np
import pytest

from attnstore.errors import FingerprintMismatchError, MapShapeError
from attnstore.index import ExactIndex
from attnstore.protocol.prefix import PrefixBlock, PrefixLayout, chain_hashes
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore
from tests.support.stores import small_layout

FP = "f" * 64
LAYOUT = PrefixLayout(block_size=4, layers=2, kv_heads=1, head_dim=3, hidden=5, dtype="float32")
HASHES = chain_hashes(list(range(12)), LAYOUT.block_size)  # three blocks


def _blocks(layout: PrefixLayout = LAYOUT, seed: int = 0) -> list[PrefixBlock]:
    rng = np.random.default_rng(seed)
    return [PrefixBlock(h, HASHES[i - 1] if i else None,
                        rng.standard_normal((layout.layers, *layout.layer_shape)).astype(layout.dtype),
                        rng.standard_normal((layout.block_size, layout.hidden)).astype(layout.dtype))
            for i, h in enumerate(HASHES)]


@pytest.fixture
def service() -> AttnStoreService:
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    service.create_namespace("ns", model="tiny", fingerprint=FP, layout=small_layout())
    return service


def test_a_put_sets_the_layout_stores_new_blocks_and_counts_the_rest_as_duplicates(service):
    assert service.prefixes.layout("ns") is None
    blocks = _blocks()
    result = service.prefixes.put("ns", FP, LAYOUT, blocks[:2])
    assert (result.stored, result.duplicates, result.bytes) == (2, 0, 2 * LAYOUT.block_bytes)
    assert service.prefixes.layout("ns") == LAYOUT
    result = service.prefixes.put("ns", FP, LAYOUT, blocks)
    assert (result.stored, result.duplicates, result.bytes) == (1, 2, LAYOUT.block_bytes)
    assert service.prefixes.matches("ns", FP, LAYOUT.block_size, [HASHES]) == [3]
    layer = service.prefixes.read("ns", LAYOUT.block_size, HASHES, 1)  # (2, KVH, 12, d)
    np.testing.assert_array_equal(layer, np.concatenate([b.kv[1] for b in blocks], axis=2))


def test_a_block_not_finite_unlike_the_layout_or_without_its_parent_refuses_the_whole_put(service):
    blocks = _blocks()
    bad = PrefixBlock(HASHES[1], HASHES[0], np.full_like(blocks[1].kv, np.nan), blocks[1].hidden)
    with pytest.raises(MapShapeError, match="not finite"):
        service.prefixes.put("ns", FP, LAYOUT, [blocks[0], bad])
    with pytest.raises(MapShapeError, match="hidden must be"):
        service.prefixes.put("ns", FP, LAYOUT, [PrefixBlock(HASHES[0], None, blocks[0].kv, blocks[0].hidden[:2])])
    assert service.prefixes.layout("ns") is None  # nothing stored, not even the layout
    with pytest.raises(MapShapeError, match="parent .* is not stored"):
        service.prefixes.put("ns", FP, LAYOUT, blocks[1:])
    assert service.prefixes.matches("ns", FP, LAYOUT.block_size, [HASHES]) == [0]


def test_another_model_or_prefix_layout_is_refused_naming_both(service):
    service.prefixes.put("ns", FP, LAYOUT, _blocks()[:1])
    with pytest.raises(FingerprintMismatchError, match="fingerprint"):
        service.prefixes.put("ns", "e" * 64, LAYOUT, _blocks())
    other = PrefixLayout(block_size=4, layers=2, kv_heads=1, head_dim=3, hidden=5, dtype="float16")
    with pytest.raises(FingerprintMismatchError, match="dtype='float32'.*dtype='float16'"):
        service.prefixes.put("ns", FP, other, _blocks(other))
