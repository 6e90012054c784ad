"""Where a store lives: an LMDB folder, or a ``redis://`` URL (the Redis backend, loaded only when used).

Nothing here imports redis, so the daemon's configuration and the CLI can
tell the two apart and refuse a bad URL before any store is opened.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from attnstore.errors import ConfigError

if TYPE_CHECKING:
    from attnstore.store.redis.mapstore import RedisMapStore

REDIS_SCHEMES = ("redis://", "rediss://")


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
        from attnstore.store.redis.connection import RedisLocation

        RedisLocation.parse(str(text))
        return str(text)
    return Path(text)


def open_redis_store(
    url: str, *, create: bool = False, dram_bytes: int | None = None, max_bytes: int | None = None,
    map_size: int | None = None, readonly: bool = False,
) -> RedisMapStore:
    """Open the Redis store at ``url`` with the daemon's sizes (``map_size`` is LMDB's: refused here).

    Raises:
        ConfigError: a malformed URL, or ``map_size`` given.
        UnavailableError: Redis cannot be reached.
        StoreNotFoundError: no store under the URL's prefix and ``create`` is False.
    """
    if map_size is not None:
        raise ConfigError(f"--map-size sizes an LMDB store; {url!r} is a Redis store (size it with Redis's maxmemory)")
    from attnstore.store.lmdb.settings import DEFAULT_DRAM_BYTES
    from attnstore.store.redis.mapstore import RedisMapStore
    from attnstore.store.redis.settings import RedisSettings

    settings = RedisSettings(
        dram_bytes=DEFAULT_DRAM_BYTES if dram_bytes is None else dram_bytes, max_bytes=max_bytes, readonly=readonly
    )
    return RedisMapStore.open(url, create=create, settings=settings)
