"""Typed keys: one token hash and one block hash for the client, the daemon and every backend."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from attnstore.errors import ConfigError
from attnstore.protocol.keys import TOKEN_HASH_BYTES, chain_seed, hash_block_tokens, token_hash
from attnstore.protocol.prefix import chain_hashes


def test_the_token_hash_is_sha256_of_the_ids_as_int64_whatever_container_they_come_in():
    ids = [101, 7, 2000, 102]
    expected = hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).digest()
    assert token_hash(ids) == token_hash(np.array(ids, dtype=np.int32)) == token_hash(tuple(ids)) == expected
    assert len(expected) == TOKEN_HASH_BYTES


def test_a_token_hash_of_more_than_one_row_is_refused():
    with pytest.raises(ValueError, match="one row"):
        token_hash(np.zeros((2, 3), dtype=np.int64))


def test_extra_keys_give_other_keys_and_none_give_the_stored_ones():
    ids = [1, 2, 3]
    assert token_hash(ids, extra_keys=()) == token_hash(ids)
    keyed = {token_hash(ids, extra_keys=extra) for extra in (("lora-a",), ("lora-b",), (b"lora-a",), (7,), ("7",))}
    assert len(keyed) == 5 and token_hash(ids) not in keyed
    block = np.arange(4)
    assert hash_block_tokens(chain_seed(4), block, extra_keys=("salt",)) != hash_block_tokens(chain_seed(4), block)
    with pytest.raises(ConfigError, match="str, int or bytes"):
        token_hash(ids, extra_keys=(1.5,))  # type: ignore[arg-type]


def test_block_hashes_chain_from_a_seed_of_the_block_size_as_stores_hold_them():
    ids = list(range(8))
    seed = hashlib.sha256(b"attnstore-prefix/4").digest()
    first = hashlib.sha256(seed + np.asarray(ids[:4], dtype="<u4").tobytes()).digest()
    second = hashlib.sha256(first + np.asarray(ids[4:], dtype="<u4").tobytes()).digest()
    assert chain_hashes(ids, 4) == [first, second]
    assert chain_hashes(ids, 4, extra_keys=("adapter",)) != [first, second]
