"""Every tunable of a RedisMapStore in one commented settings object."""

from __future__ import annotations

from dataclasses import dataclass

from attnstore.errors import ConfigError
from attnstore.store.dram.settings import (
    DEFAULT_DRAM_BYTES,
    DEFAULT_HIT_FLUSH_COUNT,
    DEFAULT_HIT_FLUSH_SECONDS,
    DEFAULT_PREFETCH_QUEUE,
    check_tier_settings,
)

# Entries carry a TTL this long (100 years: they never expire in practice) so that Redis's volatile-*
# maxmemory policies may evict entries, and never the index keys, logs and catalog, which have none.
ENTRY_TTL_SECONDS = 100 * 365 * 24 * 3600


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """Settings of one open RedisMapStore.

    Raises:
        ConfigError: a value is out of range.
    """

    dram_bytes: int = DEFAULT_DRAM_BYTES  # DRAM tier of decoded maps in this process; 0 disables it
    max_bytes: int | None = None  # cap on live entries' stored bytes (all daemons together); None: Redis's maxmemory
    readonly: bool = False  # refuse every write (ReadOnlyStoreError)
    evict_low_water: float = 0.9  # the byte cap evicts down to this fraction of max_bytes
    hit_flush_count: int = DEFAULT_HIT_FLUSH_COUNT  # distinct entries with buffered hits that trigger a flush
    hit_flush_seconds: float = DEFAULT_HIT_FLUSH_SECONDS  # buffered hits older than this flush on the next hit
    prefetch_queue: int = DEFAULT_PREFETCH_QUEUE  # entries waiting for prefetch at most; more are dropped
    entry_ttl_seconds: int = ENTRY_TTL_SECONDS  # see ENTRY_TTL_SECONDS
    # Each namespace's log keeps about this many changes: a daemon further behind rebuilds its index from the keys.
    log_max_events: int = 100_000
    # A failed Redis call is sent again for this long: a replica's takeover of a dead master costs latency, not
    # errors. Past it the call raises UnavailableError, and later calls fail at once until Redis answers again.
    # None: 20 s for a Redis Cluster, 2 s for one server (it has no replica to wait for).
    failover_seconds: float | None = None
    orphan_grace_seconds: float = 300.0  # compaction leaves unindexed entries younger than this (ingests in flight)

    def __post_init__(self) -> None:
        check_tier_settings(self.dram_bytes, self.max_bytes, self.evict_low_water, self.hit_flush_count,
                            self.hit_flush_seconds)
        for name in ("entry_ttl_seconds", "log_max_events"):
            if getattr(self, name) < 1:
                raise ConfigError(f"RedisSettings.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("orphan_grace_seconds", "failover_seconds"):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(f"RedisSettings.{name} must be >= 0, got {getattr(self, name)}")
