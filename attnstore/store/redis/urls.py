"""Opening a store: where it lives (an LMDB folder, or a ``redis://`` URL) and a Redis store's settings.

Nothing here imports redis, so the daemon's configuration and the CLI can
tell the two apart and refuse a bad URL before any store is opened.

``redis://HOST:PORT`` is one Redis server; ``redis://HOST:PORT/?cluster=1`` a
Redis Cluster (any node: the client discovers the others and follows
failovers). ``rediss://`` uses TLS. ``prefix=NAME`` names the store within the
server (default ``attnstore``), so several stores may share one Redis. Other
query parameters are redis-py's connection options (``socket_timeout=...``).
Every tunable of a RedisMapStore is in one commented settings object, ``RedisSettings``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from attnstore.errors import ConfigError
from attnstore.store.dram.settings import DEFAULT_HIT_FLUSH_COUNT, DEFAULT_HIT_FLUSH_SECONDS, check_store_settings
from attnstore.store.eviction import DEFAULT_LOW_WATER

REDIS_SCHEMES = ("redis://", "rediss://")
DEFAULT_PREFIX = "attnstore"
_PREFIX_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


def is_redis_url(location: object) -> bool:
    """True for a ``redis://`` or ``rediss://`` store location."""
    return isinstance(location, str) and location.startswith(REDIS_SCHEMES)


def shown_location(location: str | Path) -> str:
    """A store location for logs and messages: a URL without its user and password."""
    if not is_redis_url(location):
        return str(location)
    parts = urlsplit(str(location))
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


def store_location(text: str | Path) -> str | Path:
    """A store location as given on the command line: a checked Redis URL (str), or a folder (Path).

    Raises:
        ConfigError: a Redis URL that does not parse (it names the URL and what is wrong).
    """
    if isinstance(text, str) and "://" in text and not is_redis_url(text):
        raise ConfigError(f"store {text!r}: a store is a folder or a URL starting with one of {list(REDIS_SCHEMES)}")
    if is_redis_url(text):
        RedisLocation.parse(str(text))
        return str(text)
    return Path(text)


@dataclass(frozen=True, slots=True)
class RedisLocation:
    """A parsed store URL."""

    url: str  # as given
    client_url: str  # the URL redis-py opens: ours, less the store's own parameters
    cluster: bool
    prefix: str
    options: dict[str, str] = field(default_factory=dict, compare=False)  # redis-py's query parameters

    @classmethod
    def parse(cls, url: str) -> RedisLocation:
        """Parse ``url``.

        Raises:
            ConfigError: another scheme, no host, a bad ``cluster`` or ``prefix`` value, or a database
                number with ``cluster=1`` (a cluster has database 0 only).
        """
        if not is_redis_url(url):
            raise ConfigError(f"a Redis store URL starts with one of {list(REDIS_SCHEMES)}, got {url!r}")
        parts = urlsplit(url)
        if not parts.hostname:
            raise ConfigError(f"Redis store URL {url!r} needs a host, e.g. redis://127.0.0.1:6379/?cluster=1")
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        cluster_text = query.pop("cluster", "0").lower()
        if cluster_text not in ("0", "1", "true", "false", "yes", "no"):
            raise ConfigError(f"Redis store URL {url!r}: cluster must be 1 or 0, got {cluster_text!r}")
        cluster = cluster_text in ("1", "true", "yes")
        prefix = query.pop("prefix", DEFAULT_PREFIX)
        if not _PREFIX_RE.fullmatch(prefix):
            raise ConfigError(
                f"Redis store URL {url!r}: prefix must be 1-64 letters, digits, '_', '.' or '-', got {prefix!r}"
            )
        if cluster and parts.path.strip("/") not in ("", "0"):
            raise ConfigError(f"Redis store URL {url!r}: a Redis Cluster has database 0 only")
        client_url = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), ""))
        return cls(url=url, client_url=client_url, cluster=cluster, prefix=prefix, options=query)

    @property
    def display(self) -> str:
        """The URL without its password, for logs and stats."""
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


# Entries carry a TTL this long (100 years: they never expire in practice) so that Redis's volatile-*
# maxmemory policies may evict entries, and never the index keys, logs and catalog, which have none.
ENTRY_TTL_SECONDS = 100 * 365 * 24 * 3600


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """Settings of one open RedisMapStore.

    Raises:
        ConfigError: a value is out of range.
    """

    max_bytes: int | None = None  # cap on live entries' stored bytes (all daemons together); None: Redis's maxmemory
    readonly: bool = False  # refuse every write (ReadOnlyStoreError)
    evict_low_water: float = DEFAULT_LOW_WATER  # the byte cap evicts down to this fraction of max_bytes
    hit_flush_count: int = DEFAULT_HIT_FLUSH_COUNT  # distinct entries with buffered hits that trigger a flush
    hit_flush_seconds: float = DEFAULT_HIT_FLUSH_SECONDS  # buffered hits older than this flush on the next hit
    entry_ttl_seconds: int = ENTRY_TTL_SECONDS  # see ENTRY_TTL_SECONDS
    # Each namespace's log keeps about this many changes: a daemon further behind rebuilds its index from the keys.
    log_max_events: int = 100_000
    # A failed Redis call is sent again for this long: a replica's takeover of a dead master costs latency, not
    # errors. Past it the call raises UnavailableError, and later calls fail at once until Redis answers again.
    # None: 20 s for a Redis Cluster, 2 s for one server (it has no replica to wait for).
    failover_seconds: float | None = None
    orphan_grace_seconds: float = 300.0  # compaction leaves unindexed entries younger than this (ingests in flight)

    def __post_init__(self) -> None:
        check_store_settings(self.max_bytes, self.evict_low_water, self.hit_flush_count,
                            self.hit_flush_seconds)
        for name in ("entry_ttl_seconds", "log_max_events"):
            if getattr(self, name) < 1:
                raise ConfigError(f"RedisSettings.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("orphan_grace_seconds", "failover_seconds"):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(f"RedisSettings.{name} must be >= 0, got {getattr(self, name)}")
