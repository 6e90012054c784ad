"""One mapping from AttnStore errors to gRPC status codes, and back on the client."""

from __future__ import annotations

import grpc
import pytest

from attnstore import errors
from attnstore.protocol.status_codes import ERROR_CLASS_KEY, error_from_rpc, status_for


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (errors.NamespaceNotFoundError("no namespace 'x'"), grpc.StatusCode.NOT_FOUND),
        (errors.EntryNotFoundError("no entry 7"), grpc.StatusCode.NOT_FOUND),
        (errors.NamespaceExistsError("exists"), grpc.StatusCode.ALREADY_EXISTS),
        (errors.FingerprintMismatchError("other model"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.MapShapeError("bad shape"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.WireFormatError("bad frame"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.VectorIndexError("NaN"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.ConfigError("bad layout"), grpc.StatusCode.INVALID_ARGUMENT),
        (ValueError("plain"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.StoreFullError("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.RequestLimitError("too many"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.ChecksumError("crc"), grpc.StatusCode.DATA_LOSS),
        (errors.ReadOnlyStoreError("ro"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.UnavailableError("loading"), grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_each_error_maps_to_its_status_code_with_its_message(exc: Exception, code: grpc.StatusCode) -> None:
    assert status_for(exc) == (code, exc.args[0])


def test_unexpected_exceptions_are_internal_without_their_message() -> None:
    code, details = status_for(RuntimeError("secret internals"))
    assert code is grpc.StatusCode.INTERNAL and "secret" not in details and "RuntimeError" in details


class _FakeRpcError(grpc.RpcError, grpc.Call):
    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple = ()) -> None:
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._trailing

    def initial_metadata(self) -> tuple:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: object) -> bool:
        return False


def test_client_gets_the_named_error_class_back() -> None:
    failed = _FakeRpcError(grpc.StatusCode.NOT_FOUND, "no entry 7", ((ERROR_CLASS_KEY, "EntryNotFoundError"),))
    exc = error_from_rpc(failed)
    assert isinstance(exc, errors.EntryNotFoundError) and "NOT_FOUND: no entry 7" in str(exc)


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.UNAUTHENTICATED, errors.AuthError),
        (grpc.StatusCode.PERMISSION_DENIED, errors.AuthError),
        (grpc.StatusCode.UNAVAILABLE, errors.UnavailableError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.UnavailableError),
        (grpc.StatusCode.INTERNAL, errors.RemoteError),
    ],
)
def test_client_falls_back_to_the_status_code(code: grpc.StatusCode, cls: type) -> None:
    assert type(error_from_rpc(_FakeRpcError(code, "x"))) is cls


def test_a_class_name_that_is_not_an_attnstore_error_is_ignored() -> None:
    exc = error_from_rpc(_FakeRpcError(grpc.StatusCode.INTERNAL, "x", ((ERROR_CLASS_KEY, "SystemExit"),)))
    assert type(exc) is errors.RemoteError


def test_a_client_only_error_class_in_the_metadata_falls_back_to_the_code_without_raising() -> None:
    # MapsUnavailableError needs a row and a cause: it must never be rebuilt from a message.
    failed = _FakeRpcError(grpc.StatusCode.UNAVAILABLE, "x", ((ERROR_CLASS_KEY, "MapsUnavailableError"),))
    assert type(error_from_rpc(failed)) is errors.UnavailableError


def test_failed_precondition_without_a_class_is_not_taken_for_a_fingerprint_mismatch() -> None:
    exc = error_from_rpc(_FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "store is read-only"))
    assert type(exc) is errors.RemoteError and "FAILED_PRECONDITION: store is read-only" in str(exc)


@pytest.mark.parametrize("name", ["FingerprintMismatchError", "NamespaceNotReadyError", "ReadOnlyStoreError"])
def test_failed_precondition_with_its_class_comes_back_as_that_class(name: str) -> None:
    exc = error_from_rpc(_FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "x", ((ERROR_CLASS_KEY, name),)))
    assert type(exc) is getattr(errors, name)
