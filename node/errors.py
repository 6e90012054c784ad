"""The node's answers to a request it will not serve: an HTTP status and an OpenAI-style JSON error body.

OpenAI's API (and the servers that copy it: vLLM, TEI's OpenAI route, Infinity)
answer ``{"error": {"message", "type", "code", "param"}}``; clients such as the
``openai`` package read ``message`` and ``code`` from it and raise by status
(400 ``BadRequestError``, 401 ``AuthenticationError``, 404 ``NotFoundError``...).
"""

from __future__ import annotations

from typing import Literal

from attnstore.errors import AttnStoreError

ErrorType = Literal["invalid_request_error", "server_error", "unavailable_error"]


class ApiError(AttnStoreError, ValueError):
    """A request the node answers with ``status`` and an OpenAI-style error body.

    Args:
        status: the HTTP status (4xx: the request's fault; 5xx: the node's).
        message: what was wrong, naming the bad value and what is accepted.
        code: a stable machine-readable reason (``"too_many_inputs"``, ``"invalid_api_key"``...).
        type: OpenAI's error type.
        param: the request field at fault, if any.
    """

    def __init__(
        self, status: int, message: str, code: str, *, type: ErrorType = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.type = type
        self.param = param

    def body(self) -> dict[str, dict[str, str | None]]:
        """The JSON body: ``{"error": {"message", "type", "code", "param"}}``."""
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def bad_request(message: str, code: str, param: str | None = None) -> ApiError:
    """A 400: the request's content is invalid."""
    return ApiError(400, message, code, param=param)
