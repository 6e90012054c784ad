"""A damaged stored object or record is never served: reads raise ChecksumError, verify lists the entry."""

from __future__ import annotations

import struct
from pathlib import Path

import crc32c
import lmdb
import numpy as np
import pytest
from numcodecs.zstd import Zstd

from attnstore.errors import ChecksumError, StoreDamagedError
from attnstore.protocol.records import NamespaceLayout
from attnstore.store import LmdbMapStore
from attnstore.store.codecs import ZSTD_LEVEL
from attnstore.store.dram.cache import DramCache
from attnstore.store.lmdb.env import DATA_FILE, read_current
from attnstore.store.lmdb.records import entry_key
from tests.support.stores import make_entry, projector_blob, small_layout


def _flip_byte_on_disk(root: Path, needle: bytes) -> None:
    """Flip one byte in the middle of every copy of ``needle`` in the data file.

    Copy-on-write can leave stale copies of a page in free pages; all are hit.
    """
    data_file = root / read_current(root) / DATA_FILE
    data = bytearray(data_file.read_bytes())
    offset = data.find(needle)
    assert offset >= 0, "the needle is not in the data file"
    while offset >= 0:
        data[offset + len(needle) // 2] ^= 0x10
        offset = data.find(needle, offset + 1)
    data_file.write_bytes(bytes(data))


@pytest.mark.parametrize("codec", ["fp16", "zstd"])
def test_a_flipped_byte_in_a_stored_object_raises_on_read_and_verify_reports_the_entry(tmp_path, codec):
    layout = small_layout(codec)
    entries = [make_entry(layout, 40, seed=s) for s in range(3)]
    with LmdbMapStore.open(tmp_path / "s", create=True) as store:
        store.create_namespace("ns", model="tiny", fingerprint="fp", layout=layout)
        ids = store.ingest("ns", entries).entry_ids
    layer_1 = np.ascontiguousarray(entries[1].maps[1].astype(np.float16))  # (heads, L, L)
    stored = layer_1.tobytes() if codec == "fp16" else Zstd(level=ZSTD_LEVEL).encode(layer_1)
    _flip_byte_on_disk(tmp_path / "s", stored[: min(len(stored), 4096)])

    with DramCache(LmdbMapStore.open(tmp_path / "s"), dram_bytes=1 << 30) as store:
        with pytest.raises(ChecksumError, match=f"entry {ids[1]} .*layer 1 maps fail their crc32c"):
            store.read_maps("ns", ids[1])
        with pytest.raises(ChecksumError):
            store.read_layer("ns", ids[1], 1)
        assert store.read_layer("ns", ids[1], 0).shape == (2, 40, 40)  # other layers are intact
        assert store.read_maps("ns", ids[0]).shape == (3, 2, 40, 40)
        assert store.stats().dram.entries == 1  # the corrupt entry never reached the DRAM cache
        report = store.verify()
        assert not report.ok
        assert report.corrupt_ids("ns") == [ids[1]]
        assert "layer 1 maps: crc32c mismatch" in report.corrupt[0].reason
        assert store.delete("ns", [ids[1]]) == 1
        assert store.verify().ok


@pytest.mark.parametrize("layer", [0, 3])
def test_a_flipped_byte_in_a_large_entry_raises_from_either_reading_thread(tmp_path, layer):
    # 4 layers x 8 heads x 128^2 fp16 = 1 MiB: read by two threads, layers 0-1 and 2-3.
    layout = NamespaceLayout(layers=4, heads=8, causal=True, hidden=8, feature_dim=16)
    entry = make_entry(layout, 128, seed=5)
    with LmdbMapStore.open(tmp_path / "s", create=True) as store:
        store.create_namespace("ns", model="tiny", fingerprint="fp", layout=layout)
        [entry_id] = store.ingest("ns", [entry]).entry_ids
        np.testing.assert_array_equal(store.read_maps("ns", entry_id), entry.maps.astype(np.float16))
    stored = np.ascontiguousarray(entry.maps[layer].astype(np.float16)).tobytes()
    _flip_byte_on_disk(tmp_path / "s", stored[:4096])
    with LmdbMapStore.open(tmp_path / "s") as store:
        with pytest.raises(ChecksumError, match=f"layer {layer} maps fail their crc32c"):
            store.read_maps("ns", entry_id)


def test_a_flipped_byte_in_an_entry_record_is_detected(tmp_path):
    layout = small_layout()
    entry = make_entry(layout, 8, seed=1)
    with LmdbMapStore.open(tmp_path / "s", create=True) as store:
        store.create_namespace("ns", model="tiny", fingerprint="fp", layout=layout)
        (entry_id,) = store.ingest("ns", [entry]).entry_ids
    _flip_byte_on_disk(tmp_path / "s", entry.feature.tobytes())
    with LmdbMapStore.open(tmp_path / "s") as store:
        with pytest.raises(ChecksumError, match="record crc32c"):
            store.read_maps("ns", entry_id)
        assert store.verify().corrupt_ids("ns") == [entry_id]


def test_outputs_corruption_and_missing_objects_are_reported(tmp_path):
    layout = small_layout()
    entry = make_entry(layout, 8, seed=1)
    with LmdbMapStore.open(tmp_path / "s", create=True) as store:
        store.create_namespace("ns", model="tiny", fingerprint="fp", layout=layout)
        a, b = store.ingest("ns", [entry, make_entry(layout, 8, seed=2)]).entry_ids
        with store._live.write() as (gen, txn):  # white-box: remove one stored object of b behind the store's back
            assert txn.delete(b"ns/maps/L8/c/1/2/0/0/0", db=gen.db.zarr)
    _flip_byte_on_disk(tmp_path / "s", entry.outputs.astype(np.float16).tobytes())
    with LmdbMapStore.open(tmp_path / "s") as store:
        with pytest.raises(ChecksumError, match="outputs"):
            store.read_outputs("ns", a)
        with pytest.raises(ChecksumError, match="layer 2 maps are missing"):
            store.read_maps("ns", b)
        reasons = {c.id: c.reason for c in store.verify().corrupt}
        assert "outputs" in reasons[a] and "layer 2 maps are missing" in reasons[b]


def test_orphan_objects_are_invisible_counted_by_verify_and_dropped_by_compaction(tmp_path):
    layout = small_layout()
    with LmdbMapStore.open(tmp_path / "s", create=True) as store:
        store.create_namespace("ns", model="tiny", fingerprint="fp", layout=layout)
        (entry_id,) = store.ingest("ns", [make_entry(layout, 8, seed=1)]).entry_ids
        with store._live.write() as (gen, txn):  # white-box: a staged object whose record never committed
            txn.put(b"ns/maps/L8/c/7/0/0/0/0", b"\x00" * 256, db=gen.db.zarr)
        report = store.verify()
        assert report.ok and report.orphan_objects == 1
        assert [e.id for e in store.entries("ns")] == [entry_id]
        assert store.compact().orphan_objects_dropped == 1
        assert store.verify().orphan_objects == 0


def test_verify_counts_every_stored_object(tmp_path):
    with LmdbMapStore.open(tmp_path / "s", create=True) as store:
        store.create_namespace("ns", model="tiny", fingerprint="fp", layout=small_layout("q8"))
        store.ingest("ns", [make_entry(small_layout("q8"), 8, seed=s) for s in range(2)])
        report = store.verify()
    assert (report.entries_checked, report.objects_checked) == (2, 2 * (3 * 2 + 1))
    assert report.to_dict()["ok"] is True


def test_the_index_sub_database_name_is_left_free_for_the_vector_index(tmp_path):
    with LmdbMapStore.open(tmp_path / "s", create=True) as store:
        store.create_namespace("ns", model="tiny", fingerprint="fp", layout=small_layout())
        store.ingest("ns", [make_entry(small_layout(), 8, seed=1)])
        assert store.verify().ok
    env = lmdb.open(str(tmp_path / "s" / read_current(tmp_path / "s")), max_dbs=16, readonly=True)
    assert "index" not in {bytes(k).decode() for k in env.begin().cursor().iternext(values=False)}
    env.close()


# ---- issue 18: damage beyond one entry's checksums --------------------------------------------

_PAGE = 4096  # LMDB's page size here (the OS page size)
_P_BRANCH = 0x01


def _branch_pages_of(data: bytes, key_size: int) -> list[int]:
    """Offsets of branch pages whose second node's key has ``key_size`` bytes (the first node's key is empty)."""
    found = []
    for offset in range(2 * _PAGE, len(data), _PAGE):
        flags, lower = struct.unpack_from("<HH", data, offset + 10)
        nodes = (lower - 16) // 2
        if flags != _P_BRANCH or nodes < 3:
            continue
        (second,) = struct.unpack_from("<H", data, offset + 16 + 2)
        (size,) = struct.unpack_from("<H", data, offset + second + 6)
        if size == key_size:
            found.append(offset)
    return found


def _point_last_child_at_the_first(root: Path, key_size: int) -> None:
    """Damage every branch page of one sub-database: its last child pointer is made the first one's.

    The last child's subtree becomes unreachable and the first is walked twice: what one flipped
    branch-page byte does, while every count LMDB keeps still says the keys are there.
    """
    data_file = root / read_current(root) / DATA_FILE
    data = bytearray(data_file.read_bytes())
    pages = _branch_pages_of(bytes(data), key_size)
    assert pages, "no branch page: ingest more entries"
    for offset in pages:
        (lower,) = struct.unpack_from("<H", data, offset + 12)
        first, last = (struct.unpack_from("<H", data, offset + 16 + 2 * i)[0] for i in (0, (lower - 16) // 2 - 1))
        data[offset + last : offset + last + 6] = data[offset + first : offset + first + 6]  # mn_lo, mn_hi, mn_flags
    data_file.write_bytes(bytes(data))


def test_verify_finds_entries_a_damaged_branch_page_made_unreachable(tmp_path):
    layout = small_layout()
    with LmdbMapStore.open(tmp_path / "s", create=True) as store:
        store.create_namespace("ns", model="tiny", fingerprint="fp", layout=layout)
        for start in range(0, 300, 50):
            store.ingest("ns", [make_entry(layout, 8, seed=s) for s in range(start, start + 50)])
    _point_last_child_at_the_first(tmp_path / "s", key_size=len(entry_key("ns", 1)))
    with LmdbMapStore.open(tmp_path / "s") as store:
        report = store.verify()
    assert not report.ok and not report.corrupt  # no single entry fails its checksums: the structure does
    assert any("sub-database 'entries'" in p for p in report.problems), report.problems
    assert any("namespace 'ns'" in p and "its buckets count 300" in p for p in report.problems), report.problems


def test_a_damaged_projector_is_refused_on_load_reported_by_verify_and_can_be_replaced(tmp_path):
    blob = projector_blob("weights-" + "w" * 64)
    with LmdbMapStore.open(tmp_path / "s", create=True) as store:
        store.create_namespace("ns", model="tiny", fingerprint="fp", layout=small_layout())
        assert store.set_projector("ns", blob).projector_crc32c == crc32c.crc32c(blob)
    _flip_byte_on_disk(tmp_path / "s", b"weights-" + b"w" * 64)
    with LmdbMapStore.open(tmp_path / "s") as store:
        with pytest.raises(ChecksumError, match="projector of namespace 'ns' fails its crc32c"):
            store.get_namespace("ns")
        report = store.verify()
        assert not report.ok and any("projector of namespace 'ns'" in p for p in report.problems)
        assert [info.name for info in store.list_namespaces()] == ["ns"]  # listings carry no projector
        store.set_projector("ns", blob, replace=True)  # the remedy the message names
        assert store.get_namespace("ns").projector == blob and store.verify().ok


def test_a_damaged_free_page_list_makes_writes_data_loss_a_lasting_fault_and_a_verify_problem(tmp_path):
    root = tmp_path / "s"
    with LmdbMapStore.open(root, create=True) as store:
        store.create_namespace("ns", model="tiny", fingerprint="fp", layout=small_layout())
        ids = store.ingest("ns", [make_entry(small_layout(), 16, seed=s) for s in range(200)]).entry_ids
        store.delete("ns", ids[:100])  # pages go to the free-page list
        store.ingest("ns", [make_entry(small_layout(), 16, seed=999)])
    data_file = root / read_current(root) / DATA_FILE
    data = bytearray(data_file.read_bytes())
    # The newer of the two meta pages names the free-page database's root page (MDB_meta.mm_dbs[0].md_root).
    _, free_root = max(struct.unpack_from("<Q", data, page * _PAGE + 144) + struct.unpack_from(
        "<Q", data, page * _PAGE + 80) for page in (0, 1))
    data[free_root * _PAGE + 16] ^= 0xFF  # its first node pointer
    data_file.write_bytes(bytes(data))
    with LmdbMapStore.open(root) as store:
        assert store.read_maps("ns", ids[150]).shape == (3, 2, 16, 16)  # reads do not touch the list
        with pytest.raises(StoreDamagedError, match="database is damaged"):  # before: StorageError (INTERNAL)
            for seed in range(2000, 2030):
                store.ingest("ns", [make_entry(small_layout(), 16, seed=seed)])
        assert "damaged" in store.storage_fault()  # the daemon turns health NOT_SERVING on it
        report = store.verify()
        assert not report.ok and any("damaged" in p for p in report.problems)
