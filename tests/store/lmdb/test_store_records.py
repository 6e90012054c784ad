"""Binary records and keys: round trips, key order, corruption detection."""

from __future__ import annotations

import numpy as np
import pytest

from attnstore.errors import ChecksumError
from attnstore.store.entry_record import EntryRecord
from attnstore.store.lmdb.records import (
    BucketRecord,
    HitRecord,
    entry_key,
    length_key,
    split_entry_key,
    split_length_key,
)


def _record(**changes) -> EntryRecord:
    fields = dict(
        id=2**40 + 5,
        slot=12,
        length=128,
        created=1.5e9,
        token_hash=bytes(range(32)),
        crcs=(1, 2**32 - 1, 0),
        nbytes=999,
        outputs_crc=77,
        feature=np.arange(4, dtype=np.float32),
    )
    fields.update(changes)
    return EntryRecord(**fields)


@pytest.mark.parametrize("changes", [
    {}, {"outputs_crc": None}, {"feature": None}, {"outputs_crc": 0},
    {"token_ids": np.arange(128, dtype=np.uint32) * 1000}, {"token_ids": np.arange(128), "feature": None},
])
def test_entry_records_round_trip(changes):
    record = _record(**changes)
    back = EntryRecord.from_bytes(record.to_bytes())
    assert back == record
    for name in ("feature", "token_ids"):
        mine, theirs = getattr(record, name), getattr(back, name)
        assert (theirs is None) == (mine is None)
        if mine is not None:
            assert np.array_equal(theirs, mine)


def test_a_flipped_bit_in_an_entry_record_raises_checksum_error():
    raw = bytearray(_record().to_bytes())
    raw[20] ^= 1
    with pytest.raises(ChecksumError, match="crc32c"):
        EntryRecord.from_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="truncated"):
        EntryRecord.from_bytes(b"ASE1")


def test_small_records_round_trip():
    assert BucketRecord.from_bytes(BucketRecord(3, 64, 2, 100, 200).to_bytes()) == BucketRecord(3, 64, 2, 100, 200)
    assert HitRecord.from_bytes(HitRecord(5, 2.5).to_bytes()) == HitRecord(5, 2.5)
    assert HitRecord.from_bytes(None) == HitRecord(0, 0.0)


def test_keys_split_back_and_sort_numerically_within_a_namespace():
    assert split_entry_key(entry_key("ns", 256)) == ("ns", 256)  # id bytes contain NUL
    assert split_length_key(length_key("ns", 7, 2**63)) == (7, 2**63)
    keys = [entry_key("a", i) for i in (1, 255, 256, 2**40)]
    assert sorted(keys) == keys
    assert max(keys) < entry_key("a.", 0)  # another namespace never interleaves
