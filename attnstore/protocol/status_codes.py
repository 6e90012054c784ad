"""The one place where AttnStore errors become gRPC status codes, and back.

The daemon calls :func:`abort` with whatever a servicer method raised; the
client side calls :func:`error_from_rpc` on a ``grpc.RpcError`` to get the
AttnStore error back. The error's class name travels in the trailing metadata
(``attnstore-error``) so a NOT_FOUND comes back as the right one of
NamespaceNotFoundError and EntryNotFoundError. Light: imports grpc and
``attnstore.errors`` only, so the client library may use it.
"""

from __future__ import annotations

import logging
from typing import NoReturn

import grpc

from attnstore.errors import (
    AttnStoreError,
    AuthError,
    ChecksumError,
    ConfigError,
    CorpusError,
    EntryNotFoundError,
    FeatureSourceError,
    FingerprintMismatchError,
    FormatVersionError,
    MapShapeError,
    NamespaceExistsError,
    NamespaceNotFoundError,
    NamespaceNotReadyError,
    ProjectorChangedError,
    ReadOnlyStoreError,
    RemoteError,
    RequestLimitError,
    StorageError,
    StoreDamagedError,
    StoreFullError,
    StoreNotFoundError,
    StoreOpenError,
    StoreUnsafeError,
    UnavailableError,
    UnsupportedModelError,
    VectorIndexError,
    WireFormatError,
    WriteBackOffError,
)

log = logging.getLogger(__name__)

# Trailing metadata key naming the AttnStore error class of a failed call.
ERROR_CLASS_KEY = "attnstore-error"
# Most characters of details a client is sent: they travel in the trailers, whose size gRPC caps
# (a longer status would reach the client as RESOURCE_EXHAUSTED about metadata). Messages clip
# echoed input themselves (``errors.shown``); this is the backstop.
MAX_DETAILS_CHARS = 1024

# Most specific first: the first class an exception is an instance of decides.
# Plain ValueError last: a bad argument that no AttnStore check caught.
_STATUS_OF: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (NamespaceNotFoundError, grpc.StatusCode.NOT_FOUND),
    (EntryNotFoundError, grpc.StatusCode.NOT_FOUND),
    (NamespaceExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (FingerprintMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (FormatVersionError, grpc.StatusCode.FAILED_PRECONDITION),
    (NamespaceNotReadyError, grpc.StatusCode.FAILED_PRECONDITION),
    (WriteBackOffError, grpc.StatusCode.FAILED_PRECONDITION),
    (ProjectorChangedError, grpc.StatusCode.FAILED_PRECONDITION),
    (ReadOnlyStoreError, grpc.StatusCode.FAILED_PRECONDITION),
    (StoreUnsafeError, grpc.StatusCode.FAILED_PRECONDITION),
    (RequestLimitError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StoreFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ChecksumError, grpc.StatusCode.DATA_LOSS),
    (StoreDamagedError, grpc.StatusCode.DATA_LOSS),
    (AuthError, grpc.StatusCode.PERMISSION_DENIED),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (StoreOpenError, grpc.StatusCode.UNAVAILABLE),
    (MapShapeError, grpc.StatusCode.INVALID_ARGUMENT),
    (WireFormatError, grpc.StatusCode.INVALID_ARGUMENT),
    (VectorIndexError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (FeatureSourceError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnsupportedModelError, grpc.StatusCode.INVALID_ARGUMENT),
    (CorpusError, grpc.StatusCode.INVALID_ARGUMENT),
    # At run time only a store directory removed under the daemon: writes wait for a restart.
    (StoreNotFoundError, grpc.StatusCode.FAILED_PRECONDITION),
    (StorageError, grpc.StatusCode.INTERNAL),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)

# Client side: the classes a daemon may name in the trailing metadata, each rebuilt from its
# message alone (errors raised only inside a client, such as MapsUnavailableError, never travel).
_WIRE_ERRORS: dict[str, type[AttnStoreError]] = {
    cls.__name__: cls for cls, _ in _STATUS_OF if issubclass(cls, AttnStoreError)
}

# Client side: codes whose error class is clear without the trailing metadata. FAILED_PRECONDITION
# is not one of them: a fingerprint mismatch, a changed projector, an unknown format version, a
# namespace not ready, a read-only store and a removed store directory all use it.
_ERROR_OF_CODE: dict[grpc.StatusCode, type[AttnStoreError]] = {
    grpc.StatusCode.UNAUTHENTICATED: AuthError,
    grpc.StatusCode.PERMISSION_DENIED: AuthError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: UnavailableError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: RequestLimitError,
    grpc.StatusCode.DATA_LOSS: ChecksumError,
    grpc.StatusCode.INVALID_ARGUMENT: WireFormatError,
}


def _message(exc: BaseException) -> str:
    """The error's message; KeyError subclasses would otherwise come out quoted."""
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        return exc.args[0]
    return str(exc)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and details a client sees for ``exc``.

    Known errors keep their message; anything else is INTERNAL with a generic
    message (the traceback goes to the daemon log, not to the client).
    """
    for cls, code in _STATUS_OF:
        if isinstance(exc, cls):
            details = _message(exc) or cls.__name__
            if len(details) > MAX_DETAILS_CHARS:
                details = f"{details[: MAX_DETAILS_CHARS - 40]}... ({len(details)} characters in all)"
            return code, details
    return grpc.StatusCode.INTERNAL, f"internal error in the daemon ({type(exc).__name__}); see its log"


def abort(context: grpc.ServicerContext, exc: BaseException, method: str) -> NoReturn:
    """End the call with the status of ``exc``; log unexpected exceptions with their traceback.

    A call no longer active (cancelled by the client or the drain) ends CANCELLED.

    Args:
        context: the call's servicer context.
        exc: what the servicer method raised.
        method: RPC name, for the log.

    Raises:
        Exception: always (``context.abort`` ends the call by raising).
    """
    if not context.is_active():
        # The client went away or the drain cancelled the call: whatever failed next is no fault.
        log.info("event=rpc_cancelled method=%s error=%r", method, exc)
        context.abort(grpc.StatusCode.CANCELLED, "call cancelled")
        raise AssertionError("grpc.ServicerContext.abort() returned")  # abort always raises
    code, details = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("event=rpc_failed method=%s code=%s error=%r", method, code.name, exc, exc_info=exc)
    else:
        log.info("event=rpc_refused method=%s code=%s details=%s", method, code.name, details)
    if isinstance(exc, AttnStoreError):
        context.set_trailing_metadata(((ERROR_CLASS_KEY, type(exc).__name__),))
    context.abort(code, details)
    raise AssertionError("grpc.ServicerContext.abort() returned")  # abort always raises


def error_from_rpc(exc: grpc.RpcError) -> AttnStoreError:
    """The AttnStore error a failed call stands for (client side).

    The class named in the trailing metadata wins when it is one a daemon sends;
    otherwise the status code decides, and ``RemoteError`` covers the rest.
    The message names the status code and the daemon's details.
    """
    code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (exc.details() if isinstance(exc, grpc.Call) else None) or str(exc)
    cls: type[AttnStoreError] | None = None
    if isinstance(exc, grpc.Call):
        for key, value in exc.trailing_metadata() or ():
            if key == ERROR_CLASS_KEY:
                cls = _WIRE_ERRORS.get(str(value))
    if cls is None:
        cls = _ERROR_OF_CODE.get(code, RemoteError)
    return cls(f"{code.name}: {details}")
