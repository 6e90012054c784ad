"""The node-local exact tier: a byte-bounded LRU of fp16 outputs that keeps a key from its second offer on."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from attnstore.errors import ConfigError
from attnstore_client.call.rows import NamespaceView, Row
from attnstore_client.call.settings import CallSettings
from attnstore_client.call.sinks import RowStates
from attnstore_client.call.state import Call
from attnstore_client.tiers.base import TierContext
from attnstore_client.tiers.local_exact import LocalExactTier, LocalOutputs


def _outputs(rows: int, value: float = 1.0) -> np.ndarray:
    return np.full((rows, 4), value, dtype=np.float32)  # rows x 4 x 2 bytes as fp16


def test_outputs_come_back_as_fp16_under_their_key() -> None:
    tier = LocalOutputs(1024, admit_after=1)
    tier.put(b"a", _outputs(2, 0.5))
    got = tier.get(b"a")
    assert got is not None and got.dtype == np.float16 and got.shape == (2, 4) and float(got[0, 0]) == 0.5
    assert tier.get(b"b") is None
    stats = tier.stats()
    assert (stats.entries, stats.bytes, stats.hits, stats.misses) == (1, 16, 1, 1)


def test_the_least_recently_used_entry_leaves_when_the_bytes_would_pass_the_cap() -> None:
    tier = LocalOutputs(48, admit_after=1)  # three entries of 16 bytes
    for key in (b"a", b"b", b"c"):
        tier.put(key, _outputs(2))
    assert tier.get(b"a") is not None  # "b" is now the least recently used
    tier.put(b"d", _outputs(2))
    assert tier.get(b"b") is None and all(tier.get(k) is not None for k in (b"a", b"c", b"d"))
    assert (tier.stats().bytes, tier.stats().evictions) == (48, 1)


def test_a_replaced_entry_counts_its_bytes_once_and_an_entry_over_the_cap_is_not_kept() -> None:
    tier = LocalOutputs(64, admit_after=1)
    tier.put(b"a", _outputs(2))
    tier.put(b"a", _outputs(3))
    assert (tier.stats().entries, tier.stats().bytes) == (1, 24)
    tier.put(b"big", _outputs(100))
    assert tier.get(b"big") is None and tier.get(b"a") is not None


def test_a_zero_byte_tier_keeps_nothing_and_clear_empties_it() -> None:
    empty = LocalOutputs(0, admit_after=1)
    empty.put(b"a", _outputs(1))
    assert empty.get(b"a") is None
    tier = LocalOutputs(1024, admit_after=1)
    tier.put(b"a", _outputs(1))
    tier.clear()
    assert tier.get(b"a") is None and tier.stats().bytes == 0


@pytest.mark.parametrize("capacity", [-1, 1.5, True, "1GiB"])
def test_a_bad_capacity_is_a_config_error_naming_it(capacity: object) -> None:
    with pytest.raises(ConfigError, match="exact_cache_bytes must be an int >= 0"):
        LocalOutputs(capacity)  # type: ignore[arg-type]


def test_a_key_is_kept_the_second_time_it_is_offered_not_the_first() -> None:
    tier = LocalOutputs(1024)  # admit_after=2, the default
    tier.put(b"a" * 32, _outputs(2))
    assert tier.get(b"a" * 32) is None and tier.stats().declined == 1
    tier.put(b"a" * 32, _outputs(2))
    assert tier.get(b"a" * 32) is not None and (tier.stats().entries, tier.stats().declined) == (1, 1)
    tier.put(b"a" * 32, _outputs(3))  # an entry kept is replaced at once
    assert tier.get(b"a" * 32).shape == (3, 4)


def test_a_bulk_of_keys_offered_once_keeps_nothing() -> None:
    tier = LocalOutputs(1 << 20)
    keys = [hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(5000)]  # as token hashes are
    for key in keys:
        tier.put(key, _outputs(1))
    assert tier.stats().entries <= 100  # false positives of the doorkeeper only (about 1% at most)
    for key in keys[:10]:
        tier.put(key, _outputs(1))
    assert all(tier.get(key) is not None for key in keys[:10])


def test_admit_after_other_than_one_or_two_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="admit_after must be 1 or 2"):
        LocalOutputs(1024, admit_after=3)


class _Context:
    """What ``LocalExactTier`` takes of a ``TierContext``: the fingerprint, the device and its ``to_device``."""

    fingerprint = "f" * 64
    device = torch.device("cpu")
    to_device = TierContext.to_device


def test_a_served_row_changed_in_place_by_the_caller_leaves_the_tiers_entry_as_it_was() -> None:
    tier = LocalExactTier(_Context(), LocalOutputs(1024, admit_after=1))  # type: ignore[arg-type]
    row = Row(0, [5, 6], b"k" * 32)
    tier.outputs.put(tier.key(row), _outputs(2, 0.5))
    for _ in range(2):
        sink = RowStates(1)
        call = Call(CallSettings("ns", max_distance=None), NamespaceView(), sink, 1)
        assert tier.serve([row], call) == [] and call.kinds == ["exact"]
        (states,) = sink.result()
        assert torch.equal(states, torch.full((2, 4), 0.5))
        states.fill_(7.0)  # the caller reuses its result
