"""Every tunable of a MapStore in one commented settings object."""

from __future__ import annotations

from dataclasses import dataclass

from attnstore.errors import ConfigError

DEFAULT_MAP_SIZE = 1 << 40  # LMDB address space reserved (1 TiB); the file grows only as used
DEFAULT_DRAM_BYTES = 1 << 30  # 1 GiB of decoded maps (about 120 SmolLM2 entries of 128 tokens)
DEFAULT_HIT_FLUSH_COUNT = 4096
DEFAULT_HIT_FLUSH_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """Settings of one open MapStore.

    Raises:
        ConfigError: a value is out of range.
    """

    map_size: int = DEFAULT_MAP_SIZE  # LMDB map size in bytes; a full map raises StoreFullError
    dram_bytes: int = DEFAULT_DRAM_BYTES  # DRAM tier capacity for decoded maps; 0 disables the tier
    max_bytes: int | None = None  # cap on live entries' stored bytes; past it, least recently hit go
    readonly: bool = False  # read-only: no writer lock, follows compactions of the writer
    evict_low_water: float = 0.9  # the byte cap evicts down to this fraction of max_bytes
    hit_flush_count: int = DEFAULT_HIT_FLUSH_COUNT  # distinct entries with buffered hits that trigger a flush
    hit_flush_seconds: float = DEFAULT_HIT_FLUSH_SECONDS  # buffered hits older than this flush on the next hit
    prefetch_queue: int = 4096  # entries waiting for prefetch at most; more are dropped
    compact_txn_bytes: int = 256 << 20  # bytes per write transaction while compacting

    def __post_init__(self) -> None:
        if self.map_size < 1 << 20:
            raise ConfigError(f"map_size must be at least 1 MiB, got {self.map_size}")
        check_tier_settings(self.dram_bytes, self.max_bytes, self.evict_low_water, self.hit_flush_count,
                            self.hit_flush_seconds)


def check_tier_settings(
    dram_bytes: int, max_bytes: int | None, evict_low_water: float, hit_flush_count: int, hit_flush_seconds: float
) -> None:
    """Check the DRAM tier, byte cap and hit-buffer settings every map store backend shares.

    Raises:
        ConfigError: a value out of range, named.
    """
    if dram_bytes < 0:
        raise ConfigError(f"dram_bytes must be >= 0, got {dram_bytes}")
    if max_bytes is not None and max_bytes < 1:
        raise ConfigError(f"max_bytes must be positive or None, got {max_bytes}")
    if not 0.0 < evict_low_water <= 1.0:
        raise ConfigError(f"evict_low_water must be in (0, 1], got {evict_low_water}")
    if hit_flush_count < 1 or hit_flush_seconds < 0:
        raise ConfigError(
            f"hit_flush_count must be >= 1 and hit_flush_seconds >= 0, got {hit_flush_count} and {hit_flush_seconds}"
        )
