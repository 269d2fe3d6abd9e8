"""OpenAI-style errors: every failure the router returns has this JSON shape.

``APIError`` and the JSON builder are kvcommon's (``kvcommon/errors.py``), shared with the sidecar
and the simulated pod; this adds the Starlette responses the router's app returns.
"""

from __future__ import annotations

from starlette.responses import Response

from kvcommon.errors import APIError, ClientDisconnected, error_body

__all__ = ["APIError", "ClientDisconnected", "error_body", "error_response", "from_exc"]


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status, message, param, code), status_code=status,
                    media_type="application/json", headers=headers)


def from_exc(exc: APIError, extra_headers: dict[str, str] | None = None) -> Response:
    return error_response(exc.status, exc.message, exc.param, exc.code, {**exc.headers, **(extra_headers or {})})
