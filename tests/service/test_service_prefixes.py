"""The service's prefix put: an admin's (trusted) put may record a namespace's prefix layout, a writer's may not;
every block is filed under the chain hash its token ids give, admitted by the rule, recorded with its writer and
removed with it (and the blocks chained after it); puts are all or nothing, need parents first and count
duplicates; another model or prefix layout, or an encoder namespace, is refused naming both (in-memory store)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from attnstore.errors import FingerprintMismatchError, MapShapeError, WriteBackOffError
from attnstore.index import ExactIndex
from attnstore.protocol.prefix import PrefixBlock, PrefixLayout, chain_hashes
from attnstore.service import AttnStoreService
from attnstore.service.admission import AdmissionConfig
from attnstore.service.put_rules import PutCaller
from attnstore.store import MemoryMapStore
from tests.support.stores import small_layout

FP = "f" * 64
LAYOUT = PrefixLayout(block_size=4, layers=3, kv_heads=1, head_dim=3, hidden=8, dtype="float32")
TOKENS = list(range(12))
HASHES = chain_hashes(TOKENS, LAYOUT.block_size)  # three blocks
WRITER = PutCaller(writer="node-a", trusted=False)


def _blocks(layout: PrefixLayout = LAYOUT, seed: int = 0, tokens: list[int] = TOKENS) -> list[PrefixBlock]:
    rng = np.random.default_rng(seed)
    hashes = chain_hashes(tokens, layout.block_size)
    size = layout.block_size
    return [PrefixBlock(h, hashes[i - 1] if i else None,
                        rng.standard_normal((layout.layers, *layout.layer_shape)).astype(layout.dtype),
                        rng.standard_normal((layout.block_size, layout.hidden)).astype(layout.dtype),
                        np.array(tokens[i * size : (i + 1) * size]))
            for i, h in enumerate(hashes)]


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
    bad = dataclasses.replace(blocks[1], kv=np.full_like(blocks[1].kv, np.nan))
    with pytest.raises(MapShapeError, match="not finite"):
        service.prefixes.put("ns", FP, LAYOUT, [blocks[0], bad])
    with pytest.raises(MapShapeError, match="hidden must be"):
        service.prefixes.put("ns", FP, LAYOUT, [dataclasses.replace(blocks[0], hidden=blocks[0].hidden[:2])])
    assert service.prefixes.layout("ns") is None  # nothing stored, not even the layout
    with pytest.raises(MapShapeError, match="parent .* is not stored"):
        service.prefixes.put("ns", FP, LAYOUT, blocks[1:])
    assert service.prefixes.matches("ns", FP, LAYOUT.block_size, [HASHES]) == [0]


def test_a_block_filed_under_a_hash_its_token_ids_do_not_give_or_without_ids_is_refused(service):
    service.prefixes.set_layout("ns", LAYOUT)
    blocks = _blocks()
    other = chain_hashes([9] * 4, LAYOUT.block_size)[0]
    with pytest.raises(MapShapeError, match=f"key {other.hex()} is not the one its token ids give"):
        service.prefixes.put("ns", FP, LAYOUT, [dataclasses.replace(blocks[0], chain_hash=other)])
    with pytest.raises(MapShapeError, match="carries no token ids"):
        service.prefixes.put("ns", FP, LAYOUT, [dataclasses.replace(blocks[0], token_ids=None)])
    # The ids of another block under this block's hash (the probe's poisoned second block): refused too.
    swapped = dataclasses.replace(blocks[1], token_ids=np.array([7, 7, 7, 7]))
    with pytest.raises(MapShapeError, match="not the one its token ids give"):
        service.prefixes.put("ns", FP, LAYOUT, [blocks[0], swapped])
    assert service.prefixes.matches("ns", FP, LAYOUT.block_size, [HASHES]) == [0]


def test_a_layout_is_the_models_a_writer_cannot_record_one_and_an_encoder_takes_none(service):
    made_up = PrefixLayout(block_size=1, layers=1, kv_heads=1, head_dim=1, hidden=1, dtype="float32")
    with pytest.raises(FingerprintMismatchError, match="records no prefix layout"):
        service.prefixes.put("ns", FP, LAYOUT, _blocks(), WRITER)
    with pytest.raises(FingerprintMismatchError, match="3 layers.*block_size=1, layers=1"):
        service.prefixes.put("ns", FP, made_up, _blocks(made_up))  # not even an admin's
    assert service.prefixes.layout("ns") is None
    service.create_namespace("enc", model="tiny", fingerprint=FP, layout=small_layout(causal=False))
    for put in (lambda: service.prefixes.set_layout("enc", LAYOUT),
                lambda: service.prefixes.put("enc", FP, LAYOUT, _blocks())):
        with pytest.raises(FingerprintMismatchError, match="bidirectional"):
            put()
    service.prefixes.set_layout("ns", LAYOUT)
    with pytest.raises(FingerprintMismatchError, match="dtype='float32'.*dtype='float16'"):
        service.prefixes.put("ns", FP, dataclasses.replace(LAYOUT, dtype="float16"), [], WRITER)


def test_a_writers_blocks_are_stored_only_once_admitted_and_their_chain_stops_at_the_first_skipped(service):
    service.prefixes.set_layout("ns", LAYOUT)
    with pytest.raises(WriteBackOffError, match="admit-after 0"):
        service.prefixes.put("ns", FP, LAYOUT, _blocks(), WRITER)
    service.use_admission(AdmissionConfig(admit_after=2))
    service.prefixes.matches("ns", FP, LAYOUT.block_size, [HASHES[:1]], caller="node-a")
    service.prefixes.matches("ns", FP, LAYOUT.block_size, [HASHES[:1]], caller="node-a")  # the same writer again
    result = service.prefixes.put("ns", FP, LAYOUT, _blocks(), WRITER)
    assert (result.stored, result.not_admitted) == (0, 3)
    service.prefixes.matches("ns", FP, LAYOUT.block_size, [HASHES[:2]], caller="node-b")
    service.prefixes.matches("ns", FP, LAYOUT.block_size, [HASHES], caller=None)  # a read token counts nothing
    result = service.prefixes.put("ns", FP, LAYOUT, _blocks(), WRITER)
    assert (result.stored, result.not_admitted) == (1, 2)  # block 1: asked by node-b alone; block 2 after it
    assert service.prefixes.matches("ns", FP, LAYOUT.block_size, [HASHES]) == [1]


def test_drop_writer_removes_its_blocks_and_every_block_chained_after_them_and_nothing_else(service):
    service.prefixes.set_layout("ns", LAYOUT)
    service.use_admission(AdmissionConfig(admit_after=1))
    blocks = _blocks()
    service.prefixes.put("ns", FP, LAYOUT, blocks[:1])  # an admin's first block
    service.prefixes.matches("ns", FP, LAYOUT.block_size, [HASHES], caller="node-a")
    assert service.prefixes.put("ns", FP, LAYOUT, blocks[:2], WRITER).stored == 1
    assert service.prefixes.put("ns", FP, LAYOUT, blocks, PutCaller(writer="node-b", trusted=False)).stored == 1
    other = _blocks(tokens=[5] * 8)
    service.prefixes.matches("ns", FP, LAYOUT.block_size, [[b.chain_hash for b in other]], caller="node-b")
    service.prefixes.put("ns", FP, LAYOUT, other, PutCaller(writer="node-b", trusted=False))
    assert service.prefixes.drop_writer("ns", "node-a", dry_run=True) == 2
    assert service.prefixes.drop_writer("ns", "node-a") == 2  # its block 1 and node-b's block 2 after it
    assert service.prefixes.matches("ns", FP, LAYOUT.block_size, [HASHES, [b.chain_hash for b in other]]) == [1, 2]
    assert service.prefixes.drop_writer("ns", "node-a") == 0
