"""Hand-rolled ASGI helpers shared by the router, the sidecar and the simulated pod.

- ``read_body``: the whole request body under a size limit and a deadline, with failures as
  ``APIError`` (413, 400, 408) so every service answers them the same way.
- ``wait_for_disconnect``: returns when the client goes away (for a watch that cancels work).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvcommon.errors import APIError, ClientDisconnected

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


def header(scope: MutableMapping[str, Any], name: bytes) -> str | None:
    """The first value of request header ``name`` (lower-case bytes), or None."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


async def read_body(scope: MutableMapping[str, Any], receive: Receive, limit: int,
                    timeout_s: float | None = None) -> bytes:
    """The request body of ``scope``, read from ``receive``.

    Raises ``APIError``: 413 when the declared Content-Length or the bytes actually received exceed
    ``limit``; 400 on a Content-Length that is not an integer; 408 when the whole body has not come
    within ``timeout_s`` (None or 0: no deadline); ``ClientDisconnected`` (a 400) when the client
    disconnects first.
    """
    if timeout_s:
        try:
            async with asyncio.timeout(timeout_s):  # no task of its own, unlike wait_for
                return await read_body(scope, receive, limit)
        except TimeoutError:
            raise APIError(408, f"request body not received within {timeout_s:g} s") from None
    declared = header(scope, b"content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise APIError(400, "invalid Content-Length") from None
        if size > limit:
            raise APIError(413, f"request body larger than the {limit}-byte limit")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body larger than the {limit}-byte limit")
        if chunk:
            chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when ``receive`` yields ``http.disconnect``; call it only once the body has been read."""
    while (await receive())["type"] != "http.disconnect":
        pass
