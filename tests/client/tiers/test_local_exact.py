"""The node-local exact tier: a byte-bounded LRU of fp16 outputs."""

from __future__ import annotations

import numpy as np
import pytest

from attnstore.errors import ConfigError
from attnstore_client.tiers.local_exact import LocalExactTier


def _outputs(rows: int, value: float = 1.0) -> np.ndarray:
    return np.full((rows, 4), value, dtype=np.float32)  # rows x 4 x 2 bytes as fp16


def test_outputs_come_back_as_fp16_under_their_key() -> None:
    tier = LocalExactTier(1024)
    tier.put(b"a", _outputs(2, 0.5))
    got = tier.get(b"a")
    assert got is not None and got.dtype == np.float16 and got.shape == (2, 4) and float(got[0, 0]) == 0.5
    assert tier.get(b"b") is None
    stats = tier.stats()
    assert (stats.entries, stats.bytes, stats.hits, stats.misses) == (1, 16, 1, 1)


def test_the_least_recently_used_entry_leaves_when_the_bytes_would_pass_the_cap() -> None:
    tier = LocalExactTier(48)  # three entries of 16 bytes
    for key in (b"a", b"b", b"c"):
        tier.put(key, _outputs(2))
    assert tier.get(b"a") is not None  # "b" is now the least recently used
    tier.put(b"d", _outputs(2))
    assert tier.get(b"b") is None and all(tier.get(k) is not None for k in (b"a", b"c", b"d"))
    assert (tier.stats().bytes, tier.stats().evictions) == (48, 1)


def test_a_replaced_entry_counts_its_bytes_once_and_an_entry_over_the_cap_is_not_kept() -> None:
    tier = LocalExactTier(64)
    tier.put(b"a", _outputs(2))
    tier.put(b"a", _outputs(3))
    assert (tier.stats().entries, tier.stats().bytes) == (1, 24)
    tier.put(b"big", _outputs(100))
    assert tier.get(b"big") is None and tier.get(b"a") is not None


def test_a_zero_byte_tier_keeps_nothing_and_clear_empties_it() -> None:
    empty = LocalExactTier(0)
    empty.put(b"a", _outputs(1))
    assert empty.get(b"a") is None
    tier = LocalExactTier(1024)
    tier.put(b"a", _outputs(1))
    tier.clear()
    assert tier.get(b"a") is None and tier.stats().bytes == 0


@pytest.mark.parametrize("capacity", [-1, 1.5, True, "1GiB"])
def test_a_bad_capacity_is_a_config_error_naming_it(capacity: object) -> None:
    with pytest.raises(ConfigError, match="exact_cache_bytes must be an int >= 0"):
        LocalExactTier(capacity)  # type: ignore[arg-type]
