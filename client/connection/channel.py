"""A gRPC channel to one daemon or several: address forms, TLS, message sizes, keepalive, load balancing.

The same for every client and command that names a daemon (``AttnCache(store=...)``, ``admin --target``,
``bench load --target``). Light: grpc and the wire stubs, never faiss, lmdb, zarr or the service.
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import grpc

from attnstore.errors import ConfigError
from attnstore.protocol.v1 import attnstore_pb2 as pb

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_MAX_MESSAGE_BYTES = 8 << 20  # the daemon's default; frames are at most 4 MiB
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AttnStore"].full_name


# A call in flight pings its daemon this often, and gives the connection up when a ping is not answered
# within the timeout: a daemon that stopped answering (SIGSTOP, a host gone, a half-open TCP connection)
# then fails the call in about 30 s even without a deadline (``timeout=None``). The daemon accepts pings
# this often (``server.KEEPALIVE_MIN_PING_MS``).
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """gRPC channel options with explicit message sizes (match the daemon's) and keepalive pings during calls."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),  # gRPC's own bound on a ping's answer (else 60 s)
        ("grpc.keepalive_permit_without_calls", 0),  # an idle channel costs the daemon nothing
        ("grpc.http2.max_pings_without_data", 0),  # a long wait for maps sends no data, and must be pinged
    ]


def _pem(value: bytes | str | Path | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    try:
        return Path(value).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read PEM file {value}: {exc.strerror or exc}") from None


# Daemon address forms, the same for every client and command: grpc:// is plaintext,
# grpcs:// is TLS, and a bare HOST:PORT is TLS only when TLS options are given.
TARGET_FORMS = "grpc://HOST:PORT, grpcs://HOST:PORT or HOST:PORT"


def split_target(target: str) -> tuple[str, bool | None]:
    """``(HOST:PORT, tls)`` of a daemon address: tls True for grpcs://, False for grpc://, None when bare.

    Raises:
        ConfigError: another scheme (``http://``...), or nothing after the scheme.
    """
    scheme, sep, address = target.partition("://")
    if not sep:
        return target, None
    if scheme not in ("grpc", "grpcs") or not address:
        raise ConfigError(f"daemon address {target!r} is not one of {TARGET_FORMS}")
    return address, scheme == "grpcs"


# Several daemons: gRPC's round_robin spreads calls over every address that answers, and a call that
# meets a daemon going away (UNAVAILABLE) before any reply is sent again, to another one. Writes included:
# an Ingest resent finds what it had stored as duplicates; one of more than gRPC's 256 KiB retry buffer
# is not resent.
_SEVERAL_RETRIES = {
    "methodConfig": [{
        "name": [{"service": SERVICE_NAME}],
        "retryPolicy": {
            "maxAttempts": 5, "initialBackoff": "0.05s", "maxBackoff": "1s", "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }],
}
ADDRESS_FORMS = "HOST:PORT, IP:PORT,IP:PORT,... (several daemons) or dns:///NAME:PORT (every address NAME resolves to)"

def several_daemons(target: str) -> bool:
    """Whether ``target`` names several daemons (a list, or a DNS name): calls are balanced over them."""
    return bool(grpc_target(split_target(target)[0])[1])


def grpc_target(address: str) -> tuple[str, list[tuple[str, str | int]]]:
    """The gRPC target and extra channel options of a daemon address (the part after ``grpc://``).

    ``HOST:PORT`` is one daemon (the first address HOST resolves to). A
    comma-separated list of ``IP:PORT`` becomes gRPC's ``ipv4:``/``ipv6:`` target, and
    ``dns:///NAME:PORT`` stays a DNS target; both get round_robin load balancing over every address
    and retries of calls a daemon refused while going away.

    Raises:
        ConfigError: a list with an empty item, an item without a port, a host name in a list (gRPC
            resolves names only one at a time: give one DNS name), or IPv4 and IPv6 mixed.
    """
    several: list[tuple[str, str | int]] = [("grpc.lb_policy_name", "round_robin"), ("grpc.enable_retries", 1),
               ("grpc.service_config", json.dumps(_SEVERAL_RETRIES))]
    if address.startswith("dns:"):
        return address, several
    if "," not in address:
        return address, []  # one daemon: gRPC's defaults, as before
    families = set()
    for item in address.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"daemon address {address!r}: {item!r} is not IP:PORT; the forms are {ADDRESS_FORMS}")
        try:
            families.add(ipaddress.ip_address(host.strip("[]")).version)
        except ValueError:
            raise ConfigError(
                f"daemon address {address!r}: {host!r} is not an IP address; a list takes IP:PORT items, and"
                f" several daemons behind one name are dns:///NAME:PORT (the forms are {ADDRESS_FORMS})"
            ) from None
    if len(families) > 1:
        raise ConfigError(f"daemon address {address!r} mixes IPv4 and IPv6 addresses: gRPC takes one family per list")
    scheme = "ipv4" if families == {4} else "ipv6"
    return f"{scheme}:{','.join(item.strip() for item in address.split(','))}", several


def open_channel(
    target: str,
    *,
    tls: bool = False,
    tls_ca: bytes | str | Path | None = None,
    client_cert: bytes | str | Path | None = None,
    client_key: bytes | str | Path | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> grpc.Channel:
    """A channel to the daemon at ``target`` (``grpc://HOST:PORT``, ``grpcs://HOST:PORT`` or ``HOST:PORT``).

    Args:
        target: daemon address; grpcs:// implies ``tls``, grpc:// refuses the TLS arguments.
        tls: use TLS (implied by any of the PEM arguments); system roots when no ``tls_ca``.
        tls_ca: CA certificate(s) that signed the daemon's certificate (PEM bytes or path).
        client_cert: this client's certificate chain, for mTLS.
        client_key: this client's private key, for mTLS.
        max_message_bytes: message size limit both ways.

    Raises:
        ConfigError: a PEM file cannot be read, only one of client cert and key is given, the
            address is malformed, or TLS arguments come with a grpc:// (plaintext) address.
    """
    if (client_cert is None) != (client_key is None):
        raise ConfigError("mTLS needs both a client certificate and its key")
    address, scheme_tls = split_target(target)
    grpc_address, balancing = grpc_target(address)
    options: list[tuple[str, str | int]] = [*channel_options(max_message_bytes), *balancing]
    wants_tls = bool(tls or tls_ca or client_cert)
    if scheme_tls is False and wants_tls:
        raise ConfigError(f"TLS options are given but {target!r} is plaintext: use grpcs://{address}")
    if not (wants_tls or scheme_tls):
        return grpc.insecure_channel(grpc_address, options=options)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_pem(tls_ca), private_key=_pem(client_key), certificate_chain=_pem(client_cert)
    )
    return grpc.secure_channel(grpc_address, credentials, options=options)
