"""Every setting of ``attnstore serve`` in one commented, validated object."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attnstore.errors import ConfigError
from attnstore.store.redis.urls import is_redis_url, store_location

DEFAULT_LISTEN = "127.0.0.1:50051"
# Frames carry at most 4 MiB of data (attnstore.protocol.wire); 8 MiB leaves room for a
# frame's other fields, a Lookup of a few thousand 128-d queries and a projector.
DEFAULT_MAX_MESSAGE_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Sizes and counts the gRPC server enforces.

    Raises:
        ConfigError: a value is below 1, or messages too small for a frame.
    """

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # per gRPC message, both directions
    max_workers: int = 32  # RPC threads; each streaming call holds one for its duration
    max_concurrent_rpcs: int = 256  # calls admitted at once (queued for a thread); RESOURCE_EXHAUSTED past it
    max_queries: int = 4096  # queries per Lookup or Search call, ids per Fetch or Prefetch call
    max_ingest_bytes: int = 1 << 30  # array bytes one Ingest stream may stage before its commit
    max_ingest_streams: int = 4  # Ingest streams at once: staged memory stays under their product
    # An Ingest stream idle this long (seconds without a message) is ended: idle streams would hold the slots
    ingest_idle_seconds: int = 60

    def __post_init__(self) -> None:
        for name in ServerLimits.__slots__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ServerLimits.{name} must be an int >= 1, got {value!r}")
        if self.max_message_bytes < 5 << 20:
            raise ConfigError(
                f"ServerLimits.max_message_bytes must be at least 5 MiB to carry a 4 MiB frame,"
                f" got {self.max_message_bytes}"
            )


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """Settings of one daemon. Sizes are bytes, times seconds.

    Raises:
        ConfigError: a value is out of range, or TLS files are given without their pair.
    """

    store: Path | str  # map store directory, or a redis:// URL (see attnstore.store.redis.urls)
    listen: str = DEFAULT_LISTEN  # HOST:PORT; loopback by default, port 0 picks a free one
    create: bool = False  # create the store when it does not exist
    readonly: bool = False  # read-only store: admin writes fail; the index is built once, at start
    dram_bytes: int | None = None  # DRAM cache of decoded maps; None = the store's default (1 GiB)
    max_bytes: int | None = None  # cap on stored bytes; past it the least recently hit entries go
    map_size: int | None = None  # LMDB map size; None = the store's default (1 TiB of address space)
    token_file: Path | None = None  # "role token" lines; None disables auth (logged loudly)
    tls_cert: Path | None = None  # server certificate chain (PEM); with tls_key enables TLS
    tls_key: Path | None = None  # server private key (PEM)
    tls_client_ca: Path | None = None  # CA (PEM) that client certificates must chain to: mTLS
    metrics_port: int | None = None  # Prometheus /metrics port; None = off, 0 = any free port
    metrics_host: str = "127.0.0.1"  # metrics bind address
    limits: ServerLimits = ServerLimits()  # message sizes, threads and per-call limits
    grace_seconds: float = 10.0  # on SIGTERM, time for calls in flight to finish before they are cancelled
    ready_file: Path | None = None  # JSON {address, port, metrics_port, pid} written once SERVING
    # Exact-tier asks before a missed row is admitted for write-back; 1 admits every miss, 0 turns write-back off.
    admit_after: int = 2
    # Where the quarantine (objects nodes' audits found wrong) is kept across restarts; None: quarantine.json in an
    # LMDB store's folder, memory only for a Redis store (``service.quarantine``).
    quarantine_file: Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "store", store_location(self.store))  # a bad Redis URL fails here, named
        if is_redis_url(self.store) and self.map_size is not None:
            raise ConfigError(
                f"--map-size sizes an LMDB store; {self.store!r} is a Redis store (size Redis's maxmemory)"
            )
        split_host_port(self.listen)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("TLS needs both --tls-cert and --tls-key (got only one)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("--tls-client-ca (mTLS) needs TLS: give --tls-cert and --tls-key too")
        if self.readonly and self.create:
            raise ConfigError("a read-only daemon cannot create its store: drop --create or --readonly")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics port must be in 0..65535, got {self.metrics_port}")
        if self.admit_after < 0:
            raise ConfigError(f"--admit-after must be >= 0 (0 turns write-back off), got {self.admit_after}")
        if self.grace_seconds < 0:
            raise ConfigError(f"grace_seconds must be >= 0, got {self.grace_seconds}")
        for name in ("dram_bytes", "max_bytes", "map_size"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"DaemonConfig.{name} must be >= 0, got {value}")

    @property
    def quarantine_path(self) -> Path | None:
        """The file the quarantine is kept in: ``quarantine_file``, else ``quarantine.json`` in an LMDB store's
        folder; None (memory only) for a Redis store without one."""
        if self.quarantine_file is not None:
            return self.quarantine_file
        return None if is_redis_url(self.store) else Path(self.store) / "quarantine.json"

    @property
    def tls(self) -> bool:
        """True when the daemon serves TLS."""
        return self.tls_cert is not None


def split_host_port(address: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` for IPv6).

    Raises:
        ConfigError: no port, or a port outside 0..65535.
    """
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"listen address must be HOST:PORT with a port in 0..65535, got {address!r}")
    return host, int(port_text)
