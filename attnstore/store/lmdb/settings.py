"""Every tunable of an LmdbMapStore in one commented settings object."""

from __future__ import annotations

from dataclasses import dataclass

from attnstore.errors import ConfigError
from attnstore.store.dram.settings import DEFAULT_HIT_FLUSH_COUNT, DEFAULT_HIT_FLUSH_SECONDS, check_store_settings
from attnstore.store.eviction import DEFAULT_LOW_WATER

DEFAULT_MAP_SIZE = 1 << 40  # LMDB address space reserved (1 TiB); the file grows only as used


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """Settings of one open LmdbMapStore.

    Raises:
        ConfigError: a value is out of range.
    """

    map_size: int = DEFAULT_MAP_SIZE  # LMDB map size in bytes; a full map raises StoreFullError
    max_bytes: int | None = None  # cap on live entries' stored bytes; past it, least recently hit go
    readonly: bool = False  # read-only: no writer lock, follows compactions of the writer
    evict_low_water: float = DEFAULT_LOW_WATER  # the byte cap evicts down to this fraction of max_bytes
    hit_flush_count: int = DEFAULT_HIT_FLUSH_COUNT  # distinct entries with buffered hits that trigger a flush
    hit_flush_seconds: float = DEFAULT_HIT_FLUSH_SECONDS  # buffered hits older than this flush on the next hit
    compact_txn_bytes: int = 256 << 20  # bytes per write transaction while compacting

    def __post_init__(self) -> None:
        if self.map_size < 1 << 20:
            raise ConfigError(f"map_size must be at least 1 MiB, got {self.map_size}")
        check_store_settings(self.max_bytes, self.evict_low_water, self.hit_flush_count,
                            self.hit_flush_seconds)
