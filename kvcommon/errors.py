"""OpenAI-style errors, one builder for every service: ``{"error": {"message", "type", "param", "code"}}``.

The router, the sidecar, the simulated pod and the guarded listener all answer failures in this
shape (vLLM >= 0.10.1 uses it too). ``type`` defaults to the name for the status in ``ERROR_TYPES``;
a service that must match another's exact names (the sidecar llm-d's, the simulated pod vLLM's)
passes ``err_type``.
"""

from __future__ import annotations

from typing import Any

import orjson

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowed", 408: "RequestTimeoutError", 409: "ConflictError",
               413: "RequestTooLargeError", 415: "UnsupportedMediaType", 422: "UnprocessableEntityError",
               429: "RateLimitError", 431: "RequestHeaderFieldsTooLarge", 500: "InternalServerError",
               501: "NotImplementedError", 502: "BadGatewayError", 503: "ServiceUnavailableError",
               504: "GatewayTimeoutError"}


class APIError(Exception):
    """A failure with an HTTP status and a message fit for the client."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


class ClientDisconnected(APIError):
    """The client went away before its request body was complete (a 400 nobody is left to read)."""

    def __init__(self, message: str = "client disconnected before the request body was complete"):
        super().__init__(400, message)


def error_payload(status: int, message: str, param: str | None = None, code: Any = None,
                  err_type: str | None = None) -> dict[str, Any]:
    """The error object; ``code`` defaults to the status, ``err_type`` to ``ERROR_TYPES[status]``."""
    return {"error": {"message": message, "type": err_type or ERROR_TYPES.get(status, "APIError"),
                      "param": param, "code": code if code is not None else status}}


def error_body(status: int, message: str, param: str | None = None, code: Any = None,
               err_type: str | None = None) -> bytes:
    """``error_payload`` as JSON bytes."""
    return orjson.dumps(error_payload(status, message, param, code, err_type))
