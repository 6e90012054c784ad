"""The service's quarantine: a reported row is a miss for every lookup (exact and map tiers) until released or
dropped; what cannot be quarantined is refused, naming why."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from attnstore.errors import ConfigError, EntryNotFoundError, FingerprintMismatchError, StorageError
from attnstore.protocol.chunks import ChunkLayout, StoredChunk
from attnstore.protocol.prefix import PrefixBlock, PrefixLayout, chain_hashes
from attnstore.service import Query
from tests.support.server_fixtures import FP, LAYOUT, memory_service
from tests.support.stores import make_entry


def _query(entry, *, exact: bool = True) -> Query:
    return Query(feature=entry.feature, length=entry.outputs.shape[0], token_hash=entry.token_hash if exact else None)


def test_a_reported_row_is_a_miss_for_both_tiers_until_released_and_gone_once_dropped() -> None:
    service = memory_service()
    entry = dataclasses.replace(make_entry(LAYOUT, 6, seed=1), writer="node-a")
    (entry_id,) = service.ingest("ns", FP, [entry]).entry_ids
    assert service.lookup("ns", FP, [_query(entry)], max_distance=1e9)[0].kind == "exact"
    assert service.lookup("ns", FP, [_query(entry, exact=False)], max_distance=1e9)[0].kind == "map"

    item, quarantined = service.report_mismatch("ns", FP, "row", entry.token_hash, reporter="node-b", detail="x")
    assert (quarantined, item.writer, item.entry_id, item.reporter) == (True, "node-a", entry_id, "node-b")
    assert service.report_mismatch("ns", FP, "row", entry.token_hash, reporter="node-c")[1] is False  # once
    assert service.lookup("ns", FP, [_query(entry)], max_distance=1e9)[0].kind == "miss"
    assert service.lookup("ns", FP, [_query(entry, exact=False)], max_distance=1e9)[0].kind == "miss"  # no replay

    service.release_quarantined("ns", "row", entry.token_hash)
    assert service.lookup("ns", FP, [_query(entry)], max_distance=1e9)[0].kind == "exact"
    service.report_mismatch("ns", FP, "row", entry.token_hash, reporter="node-b")
    service.release_quarantined("ns", "row", entry.token_hash, drop=True)
    assert service.quarantine.items() == []
    assert service.store.find_by_hash("ns", entry.token_hash) is None


def test_what_cannot_be_quarantined_is_refused_or_not_found() -> None:
    service = memory_service()
    entry = make_entry(LAYOUT, 6, seed=2)
    assert service.report_mismatch("ns", FP, "row", entry.token_hash, reporter="node-b") is None  # nothing stored
    with pytest.raises(ConfigError, match="choose one of"):
        service.report_mismatch("ns", FP, "entry", entry.token_hash, reporter="node-b")
    with pytest.raises(ConfigError, match="32 bytes"):
        service.report_mismatch("ns", FP, "row", b"short", reporter="node-b")
    with pytest.raises(FingerprintMismatchError):
        service.report_mismatch("ns", "other", "row", entry.token_hash, reporter="node-b")
    with pytest.raises(EntryNotFoundError, match="no quarantined row"):
        service.release_quarantined("ns", "row", entry.token_hash)


def test_a_reported_prefix_block_or_chunk_names_the_writer_its_record_keeps_and_an_unstored_one_is_not_found(
) -> None:
    service = memory_service()
    prefix_layout = PrefixLayout(block_size=4, layers=3, kv_heads=2, head_dim=5, hidden=8, dtype="float32")
    chunk_layout = ChunkLayout(layers=3, kv_heads=2, head_dim=4, dtype="float32")
    rng = np.random.default_rng(4)
    first, second = chain_hashes(list(range(8)), 4)
    blocks = [PrefixBlock(h, parent, rng.standard_normal((3, *prefix_layout.layer_shape)).astype("float32"),
                          rng.standard_normal((4, 8)).astype("float32"), writer=writer)
              for h, parent, writer in ((first, None, None), (second, first, "node-a"))]
    service.store.require_prefixes("test").set_layout("ns", prefix_layout)
    service.store.require_prefixes("test").put("ns", blocks)
    chunk = StoredChunk(b"\x07" * 32, rng.standard_normal((3, *chunk_layout.layer_shape(5))).astype("float32"),
                        writer="node-a")
    service.store.require_chunks("test").set_layout("ns", chunk_layout)
    service.store.require_chunks("test").put("ns", [chunk])

    for kind, key, writer in (("prefix", second, "node-a"), ("prefix", first, None), ("chunk", chunk.key, "node-a")):
        item, quarantined = service.report_mismatch("ns", FP, kind, key, reporter="node-b")
        assert (quarantined, item.kind, item.writer, item.entry_id, item.reporter) == (True, kind, writer, None,
                                                                                       "node-b")
    for kind in ("prefix", "chunk"):  # nothing stored under the key: nothing to quarantine
        assert service.report_mismatch("ns", FP, kind, b"\x09" * 32, reporter="node-b") is None


def test_a_quarantine_kept_in_a_file_survives_a_new_service_and_a_bad_file_is_refused_by_name(tmp_path) -> None:
    service = memory_service()
    entry = dataclasses.replace(make_entry(LAYOUT, 6, seed=3), writer="node-a")
    service.ingest("ns", FP, [entry])
    path = tmp_path / "quarantine.json"
    service.keep_quarantine_in(path)
    service.report_mismatch("ns", FP, "row", entry.token_hash, reporter="node-b", detail="min_cosine=0.1")
    again = service.keep_quarantine_in(path)  # a restarted daemon reads it back
    (item,) = again.items()
    assert (item.key, item.writer, item.reporter, item.detail) == (entry.token_hash, "node-a", "node-b",
                                                                   "min_cosine=0.1")
    assert service.lookup("ns", FP, [_query(entry)], max_distance=1e9)[0].kind == "miss"
    service.release_quarantined("ns", "row", entry.token_hash)
    assert service.keep_quarantine_in(path).items() == []
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(StorageError, match="quarantine file .* cannot be read"):
        service.keep_quarantine_in(path)
