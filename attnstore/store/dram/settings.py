"""The DRAM cache's and the hit buffer's defaults, and the checks of the settings every backend shares."""

from __future__ import annotations

from attnstore.errors import ConfigError
from attnstore.store.eviction import check_cap

DEFAULT_DRAM_BYTES = 1 << 30  # DRAM cache: 1 GiB of decoded maps (about 120 SmolLM2 entries of 128 tokens)
DEFAULT_HIT_FLUSH_COUNT = 4096
DEFAULT_HIT_FLUSH_SECONDS = 10.0
DEFAULT_PREFETCH_QUEUE = 4096  # entries waiting for prefetch at most; more are dropped


def check_store_settings(
    max_bytes: int | None, evict_low_water: float, hit_flush_count: int, hit_flush_seconds: float
) -> None:
    """Check the byte cap and hit-buffer settings every map store backend shares.

    Raises:
        ConfigError: a value out of range, named.
    """
    check_cap(max_bytes, evict_low_water)
    if hit_flush_count < 1 or hit_flush_seconds < 0:
        raise ConfigError(
            f"hit_flush_count must be >= 1 and hit_flush_seconds >= 0, got {hit_flush_count} and {hit_flush_seconds}"
        )
