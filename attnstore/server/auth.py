"""Bearer tokens: the token file, the callers they stand for, and the interceptor that checks every call.

Token file: one ``role token [name=NAME] [namespaces=A,B]`` line per token, role
``read``, ``write`` or ``admin``; blank lines and ``#`` comments are ignored. An
admin token may make every call; a write token every call but the admin ones
(:data:`ADMIN_METHODS`): lookups plus write-back of rows, chunks and prefix blocks (:data:`WRITE_METHODS`), for
inference nodes whose computed rows every node will trust; a read token every
call but those two kinds. ``namespaces=`` limits a read or write token to those
namespaces: a call naming another one is PERMISSION_DENIED (admin tokens are
store-wide). ``name=`` names the token's holder: entries it writes back are
recorded with that name (``admin drop-writer`` removes them), and admission
counts it as one caller (default: ``token-`` and 8 hex digits of the token's
sha256, never the token itself). Health and reflection need no token: they
reveal liveness and the service schema only, so load balancers can probe the
daemon and stock reflection clients (grpcurl) list its services without an
interceptor. Tokens are compared in constant time and never logged; refused
calls are reported (``on_refused``) so metrics count them.

A *caller* is an identity, never an address (``Caller.key``, what admission counts
once): its token's name; without a token file, the common name of its client
certificate under mTLS (``cert:NAME``); with neither, its peer host
(``anonymous@HOST``: no identity exists then, and without tokens any client may
write anyway). One token is one caller from any number of hosts, addresses or
connections, and nodes sharing a token count once. A read token's asks are not
counted at all: only callers that may write admit a row (``Caller.key`` None).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

import grpc

from attnstore.errors import ConfigError, shown
from attnstore.protocol.records import is_namespace_name
from attnstore.protocol.secret_file import read_secret_file
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.server.reflection import REFLECTION_SERVICES

log = logging.getLogger(__name__)

Role = Literal["read", "write", "admin"]
ROLES: tuple[Role, ...] = get_args(Role)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AttnStore"].full_name
# Calls that change the store or cost a walk over all of it. Stats is cheap and
# read-only, so a read token (a monitoring agent) may call it.
ADMIN_METHODS: frozenset[str] = frozenset(
    {"CreateNamespace", "Ingest", "Delete", "Compact", "Verify", "ListEntries", "SetFeatures", "ListQuarantine",
     "ReleaseQuarantine", "DropWriter"}
)
# Calls that add rows every node will be served, but cannot delete, compact, verify or administer
# namespaces: what an inference node running the namespace's model needs to write back.
# ReportMismatch too: a node auditing what it is served quarantines what it found wrong (a read token cannot, or
# any holder of one could take every row out of service).
WRITE_METHODS: frozenset[str] = frozenset({"WriteBack", "PutChunks", "PutPrefix", "ReportMismatch"})
# Each role's rank: a token may make the calls of its role and of every role below it.
_RANK: dict[Role, int] = {"read": 0, "write": 1, "admin": 2}
# Calls any client may make without a token: liveness and the schema, no data.
OPEN_SERVICES: frozenset[str] = frozenset({"grpc.health.v1.Health", *REFLECTION_SERVICES})
# Shorter tokens are guessable; refuse them rather than serve behind them.
MIN_TOKEN_CHARS = 16
_NAME_RE = re.compile(r"^[A-Za-z0-9_.@\-]{1,64}$")
ANONYMOUS = "anonymous"  # the name of a caller without a token or a client certificate

_METHODS = {m.name for m in pb.DESCRIPTOR.services_by_name["AttnStore"].methods}
if not ADMIN_METHODS | WRITE_METHODS <= _METHODS:
    raise ImportError(f"auth names RPCs the proto lacks: {sorted((ADMIN_METHODS | WRITE_METHODS) - _METHODS)}")


def default_token_name(token: str) -> str:
    """The name of a token that the file names none: stable, and revealing nothing usable of the token."""
    return "token-" + hashlib.sha256(token.encode()).hexdigest()[:8]


@dataclass(frozen=True, slots=True)
class TokenEntry:
    """One accepted token: its role, its holder's name and the namespaces it may name."""

    role: Role
    token: str = field(repr=False)
    name: str = ""  # its holder (see the module docstring); "" takes ``default_token_name``
    namespaces: frozenset[str] | None = None  # the namespaces it may name; None: every one

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", default_token_name(self.token))


@dataclass(frozen=True, slots=True)
class TokenTable:
    """The tokens a daemon accepts, with their roles (``(role, token)`` pairs are taken as unnamed entries)."""

    tokens: tuple[TokenEntry, ...]
    source: str = ""  # where they came from, for logs

    def __post_init__(self) -> None:
        entries = tuple(t if isinstance(t, TokenEntry) else TokenEntry(*t) for t in self.tokens)
        object.__setattr__(self, "tokens", entries)

    def entry_of(self, token: str) -> TokenEntry | None:
        """The entry of ``token``, or None when it is unknown (constant time per token)."""
        found: TokenEntry | None = None
        candidate = token.encode()
        for entry in self.tokens:
            if hmac.compare_digest(candidate, entry.token.encode()):
                found = entry
        return found

    def role_of(self, token: str) -> Role | None:
        """The role of ``token``, or None when it is unknown."""
        entry = self.entry_of(token)
        return None if entry is None else entry.role

    def count(self, role: Role) -> int:
        """How many tokens have ``role``."""
        return sum(t.role == role for t in self.tokens)


def _options(fields: list[str], where: str, role: str) -> tuple[str, frozenset[str] | None]:
    """The ``name=`` and ``namespaces=`` options of a token line."""
    name, namespaces = "", None
    for field_text in fields:
        key, sep, value = field_text.partition("=")
        if not sep or key not in ("name", "namespaces"):
            raise ConfigError(f"{where}: option {shown(key, 24)} is unknown; a token line takes name=NAME and"
                              " namespaces=A,B after the token")
        if key == "name":
            if not _NAME_RE.fullmatch(value):
                raise ConfigError(f"{where}: name {shown(value, 24)} must be 1-64 letters, digits, '_', '.', '@', '-'")
            name = value
            continue
        if role == "admin":
            raise ConfigError(f"{where}: an admin token is store-wide: namespaces= applies to read and write tokens")
        listed = [n for n in value.split(",") if n]
        bad = [n for n in listed if not is_namespace_name(n)]
        if bad or not listed:
            raise ConfigError(f"{where}: namespaces= needs a comma list of namespace names, got {shown(value, 40)}")
        namespaces = frozenset(listed)
    return name, namespaces


def parse_tokens(text: str, source: str = "<string>") -> TokenTable:
    """Parse token file contents (see the module docstring).

    Raises:
        ConfigError: a line is not ``role token [name=NAME] [namespaces=A,B]``, a role or option is
            unknown, a token is shorter than ``MIN_TOKEN_CHARS`` or listed twice, an admin token is
            given namespaces, or there is no token. Messages name the line, never the token.
    """
    entries: list[TokenEntry] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        where = f"{source} line {number}"
        if len(fields) < 2:
            raise ConfigError(f"{where}: expected 'role token [name=NAME] [namespaces=A,B]', got {len(fields)} field")
        role, token = fields[0], fields[1]
        if role not in ROLES:
            raise ConfigError(f"{where}: role {role!r} is unknown; choose one of {ROLES}")
        if len(token) < MIN_TOKEN_CHARS:
            raise ConfigError(f"{where}: token is shorter than {MIN_TOKEN_CHARS} characters")
        if token in seen:
            raise ConfigError(f"{where}: token is listed twice")
        seen.add(token)
        name, namespaces = _options(fields[2:], where, role)
        entries.append(TokenEntry(role, token, name, namespaces))
    if not entries:
        raise ConfigError(f"{source} holds no token: nobody could connect (omit the token file to disable auth)")
    return TokenTable(tuple(entries), source)


@dataclass(frozen=True, slots=True)
class Caller:
    """Who makes a call: a token's holder (or a client certificate's), and the host it calls from."""

    name: str  # the token's name; without tokens "cert:" and its certificate's common name, or "anonymous"
    host: str  # the peer's address without its port: for logs, and an identity only when there is none
    namespaces: frozenset[str] | None = None  # what its token may name; None: every namespace
    role: Role = "admin"  # what its token may do; without tokens every caller may make every call
    identified: bool = True  # False: no token and no client certificate, so admission falls back to the host

    @property
    def key(self) -> str | None:
        """What admission counts as one caller; None for a caller whose asks do not count (a read token's)."""
        if self.role == "read":
            return None
        return self.name if self.identified else f"{self.name}@{self.host}"

    def allows(self, namespace: str) -> bool:
        """Whether the caller's token may name ``namespace``."""
        return self.namespaces is None or namespace in self.namespaces


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (``ipv4:10.0.0.5:41234``, ``ipv6:[::1]:41234``, ``unix:/path``)."""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return address.rpartition(":")[0] or address
    return peer


def certificate_name(context: grpc.ServicerContext) -> str | None:
    """``cert:`` and the common name of the peer's client certificate (mTLS), or its SHA-256 when it names none;
    None without one."""
    auth = context.auth_context() or {}
    pem = b"".join(auth.get("x509_pem_cert", ()))
    if not pem:
        return None
    common = b"".join(auth.get("x509_common_name", ())).decode("utf-8", "replace")
    return f"cert:{common}" if common else "cert:sha256-" + hashlib.sha256(pem).hexdigest()[:16]


def anonymous_caller(context: grpc.ServicerContext) -> Caller:
    """The caller of a daemon without tokens: its client certificate under mTLS, else anonymous on its host."""
    certificate = certificate_name(context)
    host = peer_host(context.peer())
    return Caller(certificate, host) if certificate else Caller(ANONYMOUS, host, identified=False)


def load_tokens(path: str | Path) -> TokenTable:
    """Read and parse a token file; warn when others may read it.

    Raises:
        ConfigError: the file cannot be read or is malformed (see ``parse_tokens``).
    """
    text = read_secret_file(path, "token file", "token_file_permissions", log)
    return parse_tokens(text, str(path))


def named_namespace(request: object) -> str | None:
    """The namespace a request names (its ``namespace`` field, or ``name`` for the namespace calls); None if none."""
    fields = getattr(getattr(request, "DESCRIPTOR", None), "fields_by_name", {})
    for name in ("namespace", "name"):
        if name in fields:
            return str(getattr(request, name))
    return None


def required_role(method: str) -> Role | None:
    """The role a full method name (``/package.Service/Method``) needs; None if open."""
    service, _, name = method.lstrip("/").partition("/")
    if service in OPEN_SERVICES:
        return None
    if service == SERVICE_NAME and name in ADMIN_METHODS:
        return "admin"
    if service == SERVICE_NAME and name in WRITE_METHODS:
        return "write"
    return "read"


def bearer_token(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` metadata entry, or None."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as ``handler`` that only aborts."""

    def refuse(_request: object, context: grpc.ServicerContext) -> None:
        context.abort(code, details)

    if handler.request_streaming and handler.response_streaming:
        factory: Callable[..., grpc.RpcMethodHandler] = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        factory = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        factory = grpc.unary_stream_rpc_method_handler
    else:
        factory = grpc.unary_unary_rpc_method_handler
    return factory(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Checks the bearer token of every call against a :class:`TokenTable`.

    ``replace_tokens`` swaps the table while serving (token rotation on SIGHUP).

    Args:
        tokens: the accepted tokens.
        on_refused: called with the method's short name and the status code name
            (UNAUTHENTICATED, PERMISSION_DENIED) of each refused call.
    """

    def __init__(self, tokens: TokenTable, on_refused: Callable[[str, str], None] = lambda method, code: None) -> None:
        self._tokens = tokens
        self._lock = threading.Lock()
        self._on_refused = on_refused

    def replace_tokens(self, tokens: TokenTable) -> None:
        """Accept ``tokens`` from now on; calls in flight are unaffected."""
        with self._lock:
            self._tokens = tokens
        log.info(
            "event=tokens_loaded source=%s read=%d write=%d admin=%d scoped=%d", tokens.source, tokens.count("read"),
            tokens.count("write"), tokens.count("admin"), sum(t.namespaces is not None for t in tokens.tokens),
        )

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        needed = required_role(method)
        if handler is None or needed is None:
            return handler
        token = bearer_token(handler_call_details.invocation_metadata)
        if token is None:
            return self._refuse(
                handler, method, "no_token",
                grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <token>' metadata",
            )
        with self._lock:
            entry = self._tokens.entry_of(token)
        if entry is None:
            return self._refuse(handler, method, "unknown_token", grpc.StatusCode.UNAUTHENTICATED, "unknown token")
        role = entry.role
        if _RANK[role] < _RANK[needed]:
            allowed = "an admin token" if needed == "admin" else "a write or admin token"
            return self._refuse(
                handler, method, f"needs_{needed}",
                grpc.StatusCode.PERMISSION_DENIED, f"{method} needs {allowed}; this is a {role} token",
            )
        if entry.namespaces is not None and not handler.request_streaming:
            return self._scoped(handler, method, entry.namespaces)
        return handler

    def caller(self, context: grpc.ServicerContext) -> Caller:
        """The caller of a call this interceptor let through: its token's name and scope, on its host."""
        token = bearer_token(context.invocation_metadata()) or ""
        with self._lock:
            entry = self._tokens.entry_of(token)
        host = peer_host(context.peer())
        if entry is None:  # the tokens were replaced since the call was let in
            return Caller("unknown", host, frozenset(), "read")
        return Caller(entry.name, host, entry.namespaces, entry.role)

    def _scoped(self, handler: grpc.RpcMethodHandler, method: str, allowed: frozenset[str]) -> grpc.RpcMethodHandler:
        """``handler``, refusing a request that names a namespace outside ``allowed`` (PERMISSION_DENIED)."""
        inner = handler.unary_stream if handler.response_streaming else handler.unary_unary

        def behaviour(request: object, context: grpc.ServicerContext) -> object:
            namespace = named_namespace(request)
            if namespace is not None and namespace not in allowed:
                log.info("event=auth_refused method=%s reason=out_of_scope", method)
                self._on_refused(method.rsplit("/", 1)[-1], grpc.StatusCode.PERMISSION_DENIED.name)
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              f"{method} names namespace {shown(namespace)}; this token may name only"
                              f" {shown(sorted(allowed), 256)}")
            return inner(request, context)

        factory = grpc.unary_stream_rpc_method_handler if handler.response_streaming else \
            grpc.unary_unary_rpc_method_handler
        return factory(behaviour, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)

    def _refuse(
        self, handler: grpc.RpcMethodHandler, method: str, reason: str, code: grpc.StatusCode, details: str
    ) -> grpc.RpcMethodHandler:
        log.info("event=auth_refused method=%s reason=%s", method, reason)
        self._on_refused(method.rsplit("/", 1)[-1], code.name)
        return _refusal(handler, code, details)
