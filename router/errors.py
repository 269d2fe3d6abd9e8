"""OpenAI-style errors: every failure the router returns has this JSON shape."""

from __future__ import annotations

import orjson
from starlette.responses import Response

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
          404: "NotFoundError", 405: "MethodNotAllowed", 408: "RequestTimeoutError", 413: "RequestTooLargeError",
          415: "UnsupportedMediaType", 422: "UnprocessableEntityError", 429: "RateLimitError",
          500: "InternalServerError", 502: "BadGatewayError", 503: "ServiceUnavailableError",
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


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": _TYPES.get(status, "APIError"),
                                   "param": param, "code": code if code is not None else status}})


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status, message, param, code), status_code=status,
                    media_type="application/json", headers=headers)


def from_exc(exc: APIError, extra_headers: dict[str, str] | None = None) -> Response:
    return error_response(exc.status, exc.message, exc.param, exc.code, {**exc.headers, **(extra_headers or {})})
