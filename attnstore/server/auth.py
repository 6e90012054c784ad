"""Bearer tokens: the token file, and the interceptor that checks every call.

Token file: one ``role token`` pair per line, role ``read``, ``write`` or
``admin``; blank lines and ``#`` comments are ignored. An admin token may make
every call; a write token every call but the admin ones (:data:`ADMIN_METHODS`):
lookups plus write-back (:data:`WRITE_METHODS`), for inference nodes whose
computed rows every node will trust; a read token every call but those two kinds. Health and
reflection need no token: they reveal liveness and the service schema only, so
load balancers can probe the daemon and stock reflection clients (grpcurl) list
its services without an interceptor. Tokens are compared in constant time and
never logged; refused calls are reported (``on_refused``) so metrics count them.
"""

from __future__ import annotations

import hmac
import logging
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import grpc

from attnstore.errors import ConfigError
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.server.reflection import REFLECTION_SERVICES

log = logging.getLogger(__name__)

Role = Literal["read", "write", "admin"]
ROLES: tuple[Role, ...] = get_args(Role)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AttnStore"].full_name
# Calls that change the store or cost a walk over all of it. Stats is cheap and
# read-only, so a read token (a monitoring agent) may call it.
ADMIN_METHODS: frozenset[str] = frozenset(
    {"CreateNamespace", "Ingest", "Delete", "Compact", "Verify", "ListEntries", "SetFeatures"}
)
# Calls that add rows every node will be served, but cannot delete, compact, verify or administer
# namespaces: what an inference node running the namespace's model needs to write back.
WRITE_METHODS: frozenset[str] = frozenset({"WriteBack"})
# Each role's rank: a token may make the calls of its role and of every role below it.
_RANK: dict[Role, int] = {"read": 0, "write": 1, "admin": 2}
# Calls any client may make without a token: liveness and the schema, no data.
OPEN_SERVICES: frozenset[str] = frozenset({"grpc.health.v1.Health", *REFLECTION_SERVICES})
# Shorter tokens are guessable; refuse them rather than serve behind them.
MIN_TOKEN_CHARS = 16

_METHODS = {m.name for m in pb.DESCRIPTOR.services_by_name["AttnStore"].methods}
if not ADMIN_METHODS | WRITE_METHODS <= _METHODS:
    raise ImportError(f"auth names RPCs the proto lacks: {sorted((ADMIN_METHODS | WRITE_METHODS) - _METHODS)}")


@dataclass(frozen=True, slots=True)
class TokenTable:
    """The tokens a daemon accepts, with their roles."""

    tokens: tuple[tuple[Role, str], ...]  # (role, token) pairs
    source: str = ""  # where they came from, for logs

    def role_of(self, token: str) -> Role | None:
        """The role of ``token``, or None when it is unknown (constant time per token)."""
        found: Role | None = None
        candidate = token.encode()
        for role, known in self.tokens:
            if hmac.compare_digest(candidate, known.encode()):
                found = role
        return found

    def count(self, role: Role) -> int:
        """How many tokens have ``role``."""
        return sum(r == role for r, _ in self.tokens)


def parse_tokens(text: str, source: str = "<string>") -> TokenTable:
    """Parse token file contents (see the module docstring).

    Raises:
        ConfigError: a line is not ``role token``, a role is unknown, a token is
            shorter than ``MIN_TOKEN_CHARS`` or listed twice, or there is no token.
            Messages name the line, never the token.
    """
    pairs: list[tuple[Role, str]] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ConfigError(f"{source} line {number}: expected 'role token', got {len(fields)} fields")
        role, token = fields
        if role not in ROLES:
            raise ConfigError(f"{source} line {number}: role {role!r} is unknown; choose one of {ROLES}")
        if len(token) < MIN_TOKEN_CHARS:
            raise ConfigError(f"{source} line {number}: token is shorter than {MIN_TOKEN_CHARS} characters")
        if token in seen:
            raise ConfigError(f"{source} line {number}: token is listed twice")
        seen.add(token)
        pairs.append((role, token))
    if not pairs:
        raise ConfigError(f"{source} holds no token: nobody could connect (omit the token file to disable auth)")
    return TokenTable(tuple(pairs), source)


def load_tokens(path: str | Path) -> TokenTable:
    """Read and parse a token file; warn when others may read it.

    Raises:
        ConfigError: the file cannot be read or is malformed (see ``parse_tokens``).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path}: {exc.strerror or exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("event=token_file_permissions path=%s mode=%o hint='chmod 600'", path, stat.S_IMODE(mode))
    return parse_tokens(text, str(path))


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
            "event=tokens_loaded source=%s read=%d write=%d admin=%d", tokens.source, tokens.count("read"),
            tokens.count("write"), tokens.count("admin"),
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
            role = self._tokens.role_of(token)
        if role is None:
            return self._refuse(handler, method, "unknown_token", grpc.StatusCode.UNAUTHENTICATED, "unknown token")
        if _RANK[role] < _RANK[needed]:
            allowed = "an admin token" if needed == "admin" else "a write or admin token"
            return self._refuse(
                handler, method, f"needs_{needed}",
                grpc.StatusCode.PERMISSION_DENIED, f"{method} needs {allowed}; this is a {role} token",
            )
        return handler

    def _refuse(
        self, handler: grpc.RpcMethodHandler, method: str, reason: str, code: grpc.StatusCode, details: str
    ) -> grpc.RpcMethodHandler:
        log.info("event=auth_refused method=%s reason=%s", method, reason)
        self._on_refused(method.rsplit("/", 1)[-1], code.name)
        return _refusal(handler, code, details)
