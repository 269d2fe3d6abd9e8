"""Hand-rolled ASGI helpers shared by the router, the sidecar and the simulated pod.

- ``read_body``: the whole request body under a size limit and a deadline, with failures as
  ``APIError`` (413, 400, 408) so every service answers them the same way.
- ``wait_for_disconnect``: returns when the client goes away (for a watch that cancels work).
- ``unless_disconnected``: awaits some work in the handler's own task and cancels it if the client
  goes away first. Under kvroute's listener (``kvcommon/listener.py``) the connection's loss
  cancels the task directly (a ``ClientWatch`` in the scope's extensions); elsewhere one task polls
  ``receive``. It replaced a task for the work, a task for the watch and an ``asyncio.wait`` on
  both, about 12 us of a small request's ~300 us of CPU (uvloop; 18 us on asyncio's loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

from kvcommon.errors import APIError, ClientDisconnected

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
T = TypeVar("T")

# scope["extensions"][WATCH_EXTENSION]["watch"]: the request's ClientWatch, put there by kvroute's
# listener (an ASGI extension's value is a dict)
WATCH_EXTENSION = "kvroute.client_watch"


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
    within ``timeout_s`` (None or 0: no deadline; none is set when kvroute's listener already
    holds the whole body, which the request's ``ClientWatch`` says); ``ClientDisconnected`` (a 400) when the client
    disconnects first.
    """
    if timeout_s and not _body_received(scope):
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


def client_watch(scope: MutableMapping[str, Any]) -> ClientWatch | None:
    """The request's ``ClientWatch`` when kvroute's listener serves it, else None."""
    extensions = scope.get("extensions")
    return extensions[WATCH_EXTENSION]["watch"] if extensions and WATCH_EXTENSION in extensions else None


def _body_received(scope: MutableMapping[str, Any]) -> bool:
    watch = client_watch(scope)
    return watch is not None and watch.received


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when ``receive`` yields ``http.disconnect``; call it only once the body has been read."""
    while (await receive())["type"] != "http.disconnect":
        pass


class ClientWatch:
    """Whether a request's client is still connected; ``lost()`` cancels the task armed on it.

    kvroute's listener makes one per request and calls ``lost()`` when the connection drops before
    the response is complete, so a handler can wait on its work alone instead of also on a task
    that waits for ``http.disconnect``. It also sets ``received`` once the whole request body is in
    (``read_body`` then needs no deadline: nothing it reads can be late), and ``protocol`` to the
    connection's protocol (``kvcommon.listener.write_whole`` answers through it in one write)."""

    __slots__ = ("gone", "task", "fired", "received", "protocol")

    def __init__(self) -> None:
        self.gone = False
        self.task: asyncio.Task[Any] | None = None
        self.fired = False  # lost() cancelled the armed task
        self.received = False  # the listener has the whole body: receive() answers without waiting
        self.protocol: Any = None  # the listener's protocol serving the request (None elsewhere)

    def lost(self) -> None:
        if not self.gone:
            self.gone = True
            if self.task is not None:
                self.fired = True
                self.task.cancel()


async def _watch_receive(receive: Receive, watch: ClientWatch) -> None:
    await wait_for_disconnect(receive)
    watch.lost()


async def unless_disconnected(scope: MutableMapping[str, Any], receive: Receive,
                              work: Awaitable[T]) -> T | None:
    """``await work`` in the calling task; None (``work`` cancelled) if the client disconnects first.

    Call it only once the request body has been read. A cancellation from anywhere else (a server
    shutting down) still propagates: only the watch's own is absorbed (``Task.uncancel``), with
    whatever the work raised as it was cancelled."""
    watch = client_watch(scope)
    poller = None
    if watch is None:  # not under kvroute's listener: a task waits for http.disconnect instead
        watch = ClientWatch()
        poller = asyncio.ensure_future(_watch_receive(receive, watch))
    task = asyncio.current_task()
    assert task is not None, "unless_disconnected runs in a task"
    try:
        if watch.gone:
            if asyncio.iscoroutine(work):
                work.close()  # never started: nothing to cancel, no "never awaited" warning
            return None
        watch.task = task
        try:
            result = await work
        except BaseException:
            # the watch's cancel, and nobody else's: however the work ended (the CancelledError, or
            # an error its clean-up raised on the way out), the client is gone and nothing is owed
            if watch.fired and task.uncancel() == 0:
                return None
            raise
        finally:
            watch.task = None
        if watch.fired:  # the work absorbed the cancel and finished: take the request back
            task.uncancel()
        return result
    finally:
        if poller is not None:
            poller.cancel()
