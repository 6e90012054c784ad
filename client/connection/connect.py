"""``connect(url)``: the store connection a URL names, a daemon (``remote``) or an embedded store (``local``).

Apart from ``base`` so that the interface does not import its implementations (they import it).
"""

from __future__ import annotations

from pathlib import Path

from attnstore.errors import ConfigError
from attnstore_client.connection.base import URL_SCHEMES, StoreConnection


def connect(
    url: str,
    *,
    token: str | None = None,
    tls_ca: str | Path | None = None,
    client_cert: str | Path | None = None,
    client_key: str | Path | None = None,
    max_message_bytes: int | None = None,
) -> StoreConnection:
    """Open a connection to the store at ``url``.

    Args:
        url: ``grpc://HOST:PORT`` (a daemon), ``grpcs://HOST:PORT`` (a daemon with
            TLS; ``tls_ca`` names its CA, else the system roots), or ``local:PATH``
            (the store at PATH in this process, opened read-only). Several daemons on one
            shared (Redis) store: ``grpc://IP:PORT,IP:PORT`` or ``grpc://dns:///NAME:PORT``;
            calls are spread over them (round_robin), one refused by a daemon going away
            is retried on another, and a read-only stream (Lookup, FetchMaps, FetchPrefix)
            broken mid-way by one is sent again, whole, to another.
        token: bearer token for the daemon (a read token suffices).
        tls_ca: CA certificate (PEM file) of a ``grpcs://`` daemon.
        client_cert, client_key: this client's certificate chain and key (PEM files), for
            a ``grpcs://`` daemon that requires client certificates (mTLS).
        max_message_bytes: gRPC message cap; must match the daemon's (default 8 MiB).

    Raises:
        ConfigError: a URL of another form, or TLS options on a non-TLS URL.
        StoreNotFoundError: no store at a ``local:`` path.
    """
    if url.startswith(("grpc://", "grpcs://")):
        tls = url.startswith("grpcs://")
        target = url.split("://", 1)[1]
        if not target or ":" not in target:
            raise ConfigError(f"store URL {url!r} needs HOST:PORT after the scheme, e.g. grpc://127.0.0.1:50051")
        if (tls_ca, client_cert, client_key) != (None, None, None) and not tls:
            raise ConfigError(f"TLS files are given but {url!r} is not a grpcs:// URL")
        from attnstore_client.connection.remote import RemoteConnection

        return RemoteConnection(url, target, token=token, tls=tls, tls_ca=tls_ca, client_cert=client_cert,
                                client_key=client_key, max_message_bytes=max_message_bytes)
    if url.startswith("local:"):
        path = url[len("local:"):]
        if not path:
            raise ConfigError(f"store URL {url!r} needs a path after 'local:', e.g. local:./stores/stsb")
        if (token, tls_ca, client_cert, client_key) != (None, None, None, None):
            raise ConfigError("token and TLS files apply to grpc:// stores; an embedded (local:) store has none")
        # Imported here: the embedded store pulls in faiss, lmdb and zarr, which remote clients never need.
        from attnstore_client.connection.local import LocalConnection

        return LocalConnection(url, Path(path).expanduser())
    raise ConfigError(f"store URL {url!r} must start with one of {list(URL_SCHEMES)}")
