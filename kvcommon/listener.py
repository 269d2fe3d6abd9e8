"""Bounds on what a client may hold open on a listener: uvicorn's httptools protocol with timeouts for
the request head and body, a size limit on the head, and HTTP/1.0 framing checks. Used by the
router (``kvroute serve``) and the sidecar (``kvroute sidecar``).

uvicorn bounds only the idle time *after* a response (``timeout_keep_alive``): a connection that
never sends a request, or sends its headers one byte a second, or its body one byte a second to a
route that does not read it, stays open for ever. Here:

- ``header_timeout_s``: from the connection (or from the first byte of a following request) to the
  end of the request's headers; past it the connection is closed.
- ``body_timeout_s``: from the end of the headers to the end of the body, whether the app reads it
  or not; past it the connection is closed (apps that read bodies answer 408 first, on their own
  deadline, which should be a little shorter).
- ``max_header_bytes``: request line plus headers; past it a 431 and the connection is closed.
- HTTP/1.0 with ``Transfer-Encoding``: a 400 and close (RFC 9112 6.1: the framing is faulty).

Each request's scope also carries a ``ClientWatch`` (``kvcommon.asgi``) that the connection's loss
fires, so a handler waiting on a pod is cancelled without a task of its own polling ``receive``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import time
from typing import Any

from kvcommon.asgi import WATCH_EXTENSION, ClientWatch, client_watch
from kvcommon.errors import error_body
from kvcommon.sse import EventFramer

log = logging.getLogger("kvroute.listener")

try:
    from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE, HttpToolsProtocol
except ImportError:  # pragma: no cover - httptools is a dependency; without it uvicorn's h11 limits apply
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

# connections the guard closed, by reason: header_timeout, body_timeout, header_too_large, bad_framing
# (one process; each worker process of ``--workers N`` counts its own)
CLOSED: collections.Counter[str] = collections.Counter()
_last_log = 0.0


def _closed(reason: str, detail: str) -> None:
    """Counts a close and logs it, at most once per 10 s (a slowloris flood must not flood the log)."""
    global _last_log
    CLOSED[reason] += 1
    now = time.monotonic()
    if now - _last_log >= 10.0:
        _last_log = now
        log.warning("closed a client connection: %s (%s; %d closed so far for this reason)",
                    reason.replace("_", " "), detail, CLOSED[reason])


class ListenerCollector:
    """``<prefix>_connections_closed_total{reason}`` at scrape time, from ``CLOSED``."""

    def __init__(self, prefix: str) -> None:
        self.name = f"{prefix}_connections_closed"

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(self.name, "Client connections the listener closed on its own bounds "
                                     "(request head or body too slow, head too large, bad framing)",
                                     labels=["reason"])
        for reason in ("header_timeout", "body_timeout", "header_too_large", "bad_framing"):
            family.add_metric([reason], CLOSED[reason])
        yield family


_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


def _raw_error(status: int, message: str) -> bytes:
    body = error_body(status, message)
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, _REASONS[status], len(body))) + body


def _error_app(status: int, message: str):
    body = error_body(status, message)

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return app


_ENV = "KVROUTE_LISTENER_BOUNDS"  # carries the bounds to uvicorn's spawned workers (workers > 1)


def guarded_protocol(header_timeout_s: float, body_timeout_s: float | None, max_header_bytes: int) -> Any:
    """The uvicorn ``http`` protocol class with these bounds (``"h11"`` when httptools is missing).
    The class is module-level, so uvicorn can hand it to spawned worker processes: the bounds travel
    in an environment variable and are read again at import there."""
    if HttpToolsProtocol is None:  # pragma: no cover
        log.warning("httptools is not installed: header timeouts and limits are uvicorn's h11 defaults")
        return "h11"
    bounds = {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s,
              "max_header_bytes": max_header_bytes}
    os.environ[_ENV] = json.dumps(bounds)
    _configure(bounds)
    return GuardedHttpToolsProtocol


def _configure(bounds: dict[str, Any]) -> None:
    GuardedHttpToolsProtocol.header_timeout_s = bounds["header_timeout_s"]
    GuardedHttpToolsProtocol.body_timeout_s = bounds["body_timeout_s"]
    GuardedHttpToolsProtocol.max_header_bytes = bounds["max_header_bytes"]


class _UnparsedRequests(logging.Filter):
    """Drops uvicorn's per-request warning for a request it cannot parse: the guarded listener counts
    and logs those itself, throttled (``GuardedHttpToolsProtocol.send_400_response``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "Invalid HTTP request received."


if HttpToolsProtocol is not None:
    logging.getLogger("uvicorn.error").addFilter(_UnparsedRequests())

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        header_timeout_s: float = 10.0
        body_timeout_s: float | None = 32.0
        max_header_bytes: int = 64 * 1024

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            # one lazy timer per connection: arming a bound sets a deadline, and the timer, when it
            # fires, closes the connection if that deadline has passed or waits on for the rest; so
            # a request costs two attribute writes rather than two timers scheduled and cancelled
            self._guard: asyncio.TimerHandle | None = None
            self._guard_at = 0.0
            self._deadline: float | None = None
            self._in_head = True
            self._head_bytes = 0
            self._watch = ClientWatch()  # the current request's, made at the end of its headers
            self._arm(self.header_timeout_s)  # the first request's headers must come within this

        def _arm(self, delay: float | None) -> None:
            if not delay:
                self._deadline = None
                return
            now = self.loop.time()
            self._armed_at = now
            deadline = self._deadline = now + delay
            if self._guard is None or self._guard_at > deadline:  # no timer, or one that fires too late
                self._schedule(deadline)

        def _schedule(self, when: float) -> None:
            if self._guard is not None:
                self._guard.cancel()
            self._guard_at = when
            self._guard = self.loop.call_at(when, self._check)

        def _disarm(self) -> None:
            self._deadline = None  # the timer finds nothing to do when it fires

        def _check(self) -> None:
            self._guard = None
            deadline = self._deadline
            if deadline is None:
                return
            if self.loop.time() < deadline:  # re-armed since this timer was set: wait for the rest
                self._schedule(deadline)
                return
            self._deadline = None
            if not self.transport.is_closing():
                reason = "header_timeout" if self._in_head else "body_timeout"
                waited = self.loop.time() - self._armed_at
                _closed(reason, f"waited {waited:.1f} s, {self._head_bytes} bytes of the request head received")
                self.transport.close()

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._guard is not None:
                self._guard.cancel()
                self._guard = None
            super().connection_lost(exc)
            self._watch.protocol = None  # the only cycle of references a request leaves: break it now
            cycle = self.cycle  # the request uvicorn marks disconnected is the one whose watch fires
            if cycle is not None and not cycle.response_complete:
                watch = cycle.scope.get("extensions", {}).get(WATCH_EXTENSION, {}).get("watch")
                if isinstance(watch, ClientWatch):
                    watch.lost()

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a request httptools cannot parse (a NUL or control byte in a header,
            two Content-Lengths, a bad chunk size): the OpenAI error JSON rather than plain text,
            counted as ``bad_framing`` and logged at most once per 10 s (``_UnparsedRequests`` drops
            uvicorn's own line, which a client could repeat as fast as it sends)."""
            _closed("bad_framing", "the request could not be parsed")
            self.transport.write(_raw_error(400, "Invalid HTTP request received."))
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            limit = self.max_header_bytes
            if self._in_head and self._head_bytes > limit and not self.transport.is_closing():
                _closed("header_too_large", f"{self._head_bytes} bytes")
                self.transport.write(_raw_error(431, f"request line and headers exceed {limit} bytes"))
                self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if not self._in_head:  # a following request on a kept-alive connection
                self._in_head = True
                self._head_bytes = 0
                self._arm(self.header_timeout_s)

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._head_bytes = 0
            self._arm(self.body_timeout_s)
            size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
            problem = None
            if size > self.max_header_bytes:
                problem = (431, f"request line and headers exceed {self.max_header_bytes} bytes")
            elif self.parser.get_http_version() == "1.0" and any(n == b"transfer-encoding" for n, _ in self.headers):
                problem = (400, "Transfer-Encoding is not allowed in an HTTP/1.0 request")
            # for kvcommon.asgi.unless_disconnected and read_body
            watch = self._watch = ClientWatch()
            self.scope["extensions"] = {WATCH_EXTENSION: {"watch": watch}}
            if problem is None:
                super().on_headers_complete()
                watch.protocol = self  # for write_whole
                return
            _closed("header_too_large" if problem[0] == 431 else "bad_framing", problem[1])
            real = self.app  # answer from here instead of the app, and close the connection after
            self.app = _error_app(*problem)
            try:
                super().on_headers_complete()
            finally:
                self.app = real
            if self.cycle is not None:
                self.cycle.keep_alive = False

        def on_message_complete(self) -> None:
            self._disarm()
            self._watch.received = True  # the app's read_body needs no deadline of its own now
            super().on_message_complete()

    if os.environ.get(_ENV):
        _configure(json.loads(os.environ[_ENV]))


def write_whole(scope: Any, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
    """Answer the request of ``scope`` with ``status``, ``headers`` (lower-case names, without
    Content-Length, Connection or Transfer-Encoding) and ``body`` in one write, as uvicorn would
    answer the two ASGI messages ``http.response.start`` and ``http.response.body`` in two.

    Head and body then leave in one TCP segment rather than two, with one system call, and none of
    the per-header work of uvicorn's ``send``: its two regular expressions run once over all the
    names and once over all the values. False (nothing done) when the request is not served by this
    listener or when uvicorn's own ``send`` must decide: a response already begun, writes paused for
    flow control, a HEAD request, the access log on, a header uvicorn would refuse or a status it
    has no line for. The caller then sends the two messages itself."""
    watch = client_watch(scope)
    proto = watch.protocol if watch is not None else None
    cycle = proto.cycle if proto is not None else None
    if (cycle is None or cycle.scope is not scope or cycle.response_started or cycle.flow.write_paused
            or cycle.access_log or scope["method"] == "HEAD" or status not in STATUS_LINE):
        return False
    if cycle.disconnected:
        return True  # as uvicorn's send: nothing to write to, and not an error
    if (HEADER_RE.search(b"".join([name for name, _ in headers]))
            or HEADER_VALUE_RE.search(b"".join([value for _, value in headers]))):
        return False  # uvicorn's send raises its own error for it
    out = [STATUS_LINE[status]]
    for name, value in cycle.default_headers:
        out += (name, b": ", value, b"\r\n")
    for name, value in headers:
        out += (name, b": ", value, b"\r\n")
    out.append(b"content-length: %d\r\n" % len(body))
    if not cycle.keep_alive:
        out.append(b"connection: close\r\n")
    out += (b"\r\n", body)
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    cycle.chunked_encoding = False
    cycle.expected_content_length = 0
    cycle.transport.write(b"".join(out))
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    cycle.on_response()
    return True


class ChunkWriter(EventFramer):
    """Writes a relayed event stream's whole events to the client's transport as body chunks, as
    uvicorn's ``send`` does for each ``http.response.body`` message with ``more_body``, but called as a
    plain function: a relayed stream's chunks go from the pod's connection to the client's with no
    task step, ASGI message or coroutine between (``router.upstream.UpstreamResponse.relay_to``). The
    start of an event waits for its end (``kvcommon.sse``; the caller calls ``flush`` at the stream's
    end). The response is begun, and is ended, through uvicorn's ``send`` as usual."""

    __slots__ = ("cycle", "transport", "flow")

    def __init__(self, cycle: Any):
        super().__init__()
        self.cycle = cycle
        self.transport = cycle.transport
        self.flow = cycle.flow

    def __call__(self, data: bytes) -> bool:
        """Write the whole events of ``data`` as one chunk; True when the client's side is backed up
        (writes paused)."""
        cycle = self.cycle
        if cycle.disconnected or cycle.response_complete or not data:
            return False  # as uvicorn's send: nothing to write to, and not an error
        # the common case first, a chunk that ends an event with "\n\n" (a slice's comparison costs less
        # than an ``endswith``); anything else, the start of an event kept for its end among them, is framed
        if self.held or data[-2:] != b"\n\n":
            data = self.whole(data)
            if not data:
                return False
        self.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return self.flow.write_paused

    def flush(self) -> bool:
        """At the stream's normal end, write what is held (a last event without its blank line) as it
        is; True when the client's side is backed up."""
        held = self.rest()
        cycle = self.cycle
        if not held or cycle.disconnected or cycle.response_complete:
            return False
        self.transport.write(b"%x\r\n%b\r\n" % (len(held), held))
        return self.flow.write_paused

    async def drain(self) -> None:
        if self.flow.write_paused and not self.cycle.disconnected:
            await self.flow.drain()


def chunk_writer(scope: Any) -> ChunkWriter | None:
    """A ``ChunkWriter`` for the response of ``scope`` once its head went out chunked, or None when
    the request is not served by this listener, or the response is not (yet) a chunked one that is
    still open (then the caller goes on with ``send``)."""
    watch = client_watch(scope)
    proto = watch.protocol if watch is not None else None
    cycle = proto.cycle if proto is not None else None
    if (cycle is None or cycle.scope is not scope or not cycle.response_started or cycle.response_complete
            or not cycle.chunked_encoding or scope["method"] == "HEAD"):
        return None
    return ChunkWriter(cycle)


class RedactQuery(logging.Filter):
    """Drops the query string from uvicorn's access-log lines: clients put keys there
    (``?api_key=...``, ``?token=...``), and a log is no place for them. The path is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?<redacted>", *args[3:])
        return True
