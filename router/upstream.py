"""The router's HTTP/1.1 client for requests to pods: asyncio protocols and httptools' parser.

Why not aiohttp: under 32 connections of small chats, aiohttp's client was the largest single part
of the router's CPU time (24 % of the event loop's samples, more than tokenizing); this client does
the one thing the router needs (POST a body it already holds, relay the answer) with a keep-alive
pool and no per-request machinery. ``bench/overhead.py`` measures both in bare proxies.

What it does, and the bounds it keeps:

- one pool of keep-alive connections per pod (scheme, host, port), with an optional limit in all
  and per pod; a request that finds the pool full waits at most the connect timeout for a slot
  (a connection coming free wakes the oldest waiter it serves; under the limit in all, an idle
  connection to another pod is closed to make room);
- connect timeout; a read timeout between chunks (none by default: a prefill may take long);
- a connection idle for ``idle_s`` is closed rather than reused: a pod's server closes idle
  connections after its own keep-alive (vLLM's uvicorn: 5 s), and a request written on a
  connection the pod is closing is lost. The one case left (the pod closed a reused connection
  as the request was written, before a byte of answer, within ``STALE_CLOSE_S``) is retried once
  on a new connection; a later close is not: the pod may have started on the request;
- the answer's head is bounded (64 KiB, interim 1xx answers and an unfinished header included), a
  whole answer by ``max_response_bytes``, and a stream buffers at most ``max_buffer_bytes`` before
  it stops reading the socket;
- a body ends at its Content-Length, at its last chunk (trailer fields are dropped, not merged
  into the head) or, with neither, at the close; bytes past the answer (a second answer in the
  same read included) are never part of it, and the connection is then closed, not reused;
- every failure of the pod's side raises ``PodIOError`` (a ``ConnectionError``), so callers can
  tell it from the client's socket failing; cancelling a request closes its connection, which
  is how a pod learns that the client has gone and aborts the request.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

import httptools

MAX_HEADER_BYTES = 64 * 1024
# a reused connection that the pod closes without a byte of answer is retried on a new one only if the
# close came this soon after the request was written: the pod was closing it as idle. Later, the pod
# may have read the request and worked on it, and a retry would run it twice
STALE_CLOSE_S = 0.5


class PodIOError(ConnectionError):
    """The pod's connection failed, timed out, closed early or sent an answer we cannot read."""


class PoolBusy(Exception):
    """No connection to the pod came free within the connect timeout (the pod is not at fault)."""


@lru_cache(maxsize=4096)
def split_url(url: str) -> tuple[tuple[str, str, int], str, str]:
    """(pool key, Host header, request target) of an http(s) URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (parts.scheme, host, port), f"{shown}:{port}", target


def request_head(target: str, host: str, headers: Mapping[str, str], length: int, method: str = "POST") -> bytes:
    """The request line and headers. Names and values must already be free of CR, LF and NUL
    (``router.dispatch.upstream_headers`` drops a client header that is not)."""
    lines = [f"{method} {target} HTTP/1.1\r\nhost: {host}\r\ncontent-length: {length}\r\n"]
    lines += [f"{k}: {v}\r\n" for k, v in headers.items()]
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


class Headers(Mapping[str, str]):
    """An answer's headers by lower-case name (repeated names joined by ", "). ``raw``: as sent, in
    order, as (lower-case name, value) bytes, which is what a relay writes back out; the mapping is
    built only when read (the router reads it for P/D answers alone)."""

    __slots__ = ("raw", "_by_name")

    def __init__(self, raw: list[tuple[bytes, bytes]]):
        self.raw = raw
        self._by_name: dict[str, str] | None = None

    def first(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower-case bytes), or None; no mapping is built."""
        for k, v in self.raw:
            if k == name:
                return v
        return None

    def _mapping(self) -> dict[str, str]:
        by_name = self._by_name
        if by_name is None:
            by_name = self._by_name = {}
            for k, v in self.raw:
                name, value = k.decode("latin-1"), v.decode("latin-1")
                by_name[name] = f"{by_name[name]}, {value}" if name in by_name else value
        return by_name

    def __getitem__(self, name: str) -> str:
        return self._mapping()[name.lower()]

    def __iter__(self) -> Iterator[str]:
        return iter(self._mapping())

    def __len__(self) -> int:
        return len(self._mapping())


class _Connection(asyncio.Protocol):
    """One keep-alive connection; it parses one answer at a time."""

    def __init__(self, client: UpstreamClient, key: tuple[str, str, int]):
        self.client = client
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.forgotten = False  # its pool slot freed (``UpstreamClient._forget``)
        self.uses = 0
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []  # (lower-case name, value)
        self._header_bytes = 0
        self._head_bytes = 0  # bytes received while the head was still incomplete (interim answers too)
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.received = False
        self.error: BaseException | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self._paused = False
        # ``UpstreamResponse.relay_to``: body bytes go to ``sink`` from data_received itself, with no
        # task woken per chunk; ``sink_paused`` when the sink asked to stop reading until it drains
        self.sink: Callable[[bytes], bool] | None = None
        self.sink_paused = False
        self.last_data = 0.0

    # ---- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        if self.complete or self.error is not None:  # bytes past the answer: the connection is unusable,
            self._unusable()  # but an answer already whole stands
            return
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:  # the second is no subclass
            if not self.complete:
                self._fail(PodIOError(f"malformed answer from the pod: {exc}"))
                return
            self._unusable()  # bytes past a whole answer in the same read (``on_headers_complete``)
        if not self.headers_done:
            # the head is still coming: ``on_header`` sees a header only once it has ended, and until
            # then httptools holds it whole, so a head that never ends is bounded here
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEADER_BYTES:
                self._fail(PodIOError(f"malformed answer from the pod: a head larger than {MAX_HEADER_BYTES} bytes"))
            return
        sink = self.sink
        if sink is not None:
            if self.chunks:
                if self.client.read_timeout_s:
                    self.last_data = time.monotonic()
                try:
                    full = sink(self.take())
                except Exception as exc:  # the client's side failed: end the relay with it
                    self.error = self.error or exc
                    self.close()
                    self._wake()
                    return
                if full and not self.complete and self.transport is not None and not self.closed:
                    self.sink_paused = True
                    self.transport.pause_reading()
                    self._wake()
            return
        if self.buffered > self.client.max_buffer_bytes and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            if self.headers_done and self._eof_delimited():
                self.complete = True
                self.keep_alive = False
            else:
                self.error = PodIOError("the pod closed the connection" + (f" ({exc})" if exc else ""))
        self._wake()
        self.client._forget(self)

    # ---- httptools callbacks ---------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > MAX_HEADER_BYTES:
            raise httptools.HttpParserError(f"headers larger than {MAX_HEADER_BYTES} bytes")
        if not self.headers_done:  # else a chunked answer's trailer (dropped: RFC 9110 6.5.1 forbids
            self.raw_headers.append((name.lower(), value))  # merging it into the head) or bytes past the answer

    def on_headers_complete(self) -> None:
        if self.headers_done:  # a second answer behind the first, in the same read: nothing was asked
            raise httptools.HttpParserError("the pod sent bytes after its answer")
        status = self._parser.get_status_code()
        if status == 101 or not 100 <= status <= 599:
            # httptools takes any three digits; a status no client can be given (and a switch of
            # protocols nobody asked for) is a malformed answer, a 502, not a crash in the handler
            raise httptools.HttpParserError(f"status {status}")
        if 100 <= status < 200:  # an interim answer (we never send Expect): wait for the real one
            self.raw_headers = []
            self._header_bytes = 0
            return
        self.status = status
        self.keep_alive = self._parser.should_keep_alive()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.headers_done:
            self.chunks.append(body)
            self.buffered += len(body)
            if self.sink is None:  # a sink gets the bytes at the end of data_received, no wake-up
                self._wake()

    def on_message_complete(self) -> None:
        if self.headers_done:
            self.complete = True
            self._wake()

    # ---- helpers ---------------------------------------------------------------------------
    def _eof_delimited(self) -> bool:
        """Whether the answer's body ends where the connection does (RFC 9112 6.3): no Content-Length,
        and no Transfer-Encoding whose last coding is chunked."""
        coding = None
        for k, v in self.raw_headers:
            if k == b"content-length":
                return False
            if k == b"transfer-encoding":
                coding = v.rsplit(b",", 1)[-1].strip().lower()
        return coding != b"chunked"

    def _unusable(self) -> None:
        """The pod sent bytes past its answer: close the connection, never reuse it, keep the answer."""
        self.keep_alive = False
        self.close()

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.close()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()

    def start(self, data: list[bytes]) -> None:
        self._reset()
        self.uses += 1
        assert self.transport is not None
        self.transport.writelines(data)

    def take(self) -> bytes:
        data = b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]
        self.chunks.clear()
        self.buffered = 0
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def wait(self, timeout: float | None) -> None:
        """Until something happens on the connection, at most ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        handle = loop.call_later(timeout, _expire, waiter) if timeout else None
        try:
            await waiter
        finally:
            self._waiter = None
            if handle is not None:
                handle.cancel()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(PodIOError("the pod sent nothing within the read timeout"))


class UpstreamResponse:
    """An answer whose status and headers are in. The caller must ``release`` or ``close`` it."""

    def __init__(self, conn: _Connection):
        self._conn: _Connection | None = conn
        self.status = conn.status
        self.headers = Headers(conn.raw_headers)

    @property
    def complete(self) -> bool:
        """The whole answer is in (or failed): reading the rest waits for nothing."""
        conn = self._conn
        return conn is None or conn.complete or conn.error is not None

    async def readany(self) -> bytes:
        """The body bytes that have come since the last call; b"" once the answer is complete."""
        conn = self._conn
        if conn is None:
            return b""
        while True:
            if conn.chunks:
                return conn.take()
            if conn.error is not None:
                raise conn.error
            if conn.complete:
                return b""
            try:
                await conn.wait(conn.client.read_timeout_s)
            except PodIOError:
                conn.close()
                raise

    async def relay_to(self, sink: Callable[[bytes], bool], drain: Callable[[], Awaitable[None]]) -> None:
        """The rest of the body, handed to ``sink`` as it arrives, until the answer is complete.

        ``readany`` in a loop wakes the caller's task for every network chunk: a future, a task step
        and the coroutines between, per token of a streamed answer. Here the connection calls
        ``sink`` itself at the end of each ``data_received`` and the caller's task wakes only when
        the answer ends or fails, or when ``sink`` returns True (its reader is behind): reading
        stops then until ``drain`` returns. The read timeout still bounds each wait for bytes."""
        conn = self._conn
        if conn is None:
            return
        if conn.chunks and sink(conn.take()):
            await drain()
        timeout = conn.client.read_timeout_s
        conn.last_data = time.monotonic()
        conn.sink = sink
        try:
            while True:
                if conn.error is not None:
                    raise conn.error
                if conn.complete:
                    return
                if conn.sink_paused:
                    await drain()
                    conn.sink_paused = False
                    conn.last_data = time.monotonic()
                    if conn.transport is not None and not conn.closed:
                        conn.transport.resume_reading()
                    continue
                if timeout is None:
                    await conn.wait(None)
                    continue
                left = timeout - (time.monotonic() - conn.last_data)
                if left <= 0:
                    conn.close()
                    raise PodIOError("the pod sent nothing within the read timeout")
                try:
                    await conn.wait(left)
                except PodIOError:
                    pass  # the loop looks at when bytes last came
        finally:
            conn.sink = None

    async def read(self) -> bytes:
        """The whole body, at most the client's ``max_response_bytes``."""
        parts: list[bytes] = []
        size = 0
        limit = self._conn.client.max_response_bytes if self._conn is not None else 0
        while chunk := await self.readany():
            size += len(chunk)
            if size > limit:
                self.close()
                raise PodIOError(f"the pod's answer is larger than {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Give the connection back for reuse if its answer was read to the end, else close it."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.client._put_back(conn)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class UpstreamClient:
    def __init__(self, connect_timeout_s: float = 3.0, read_timeout_s: float | None = None,
                 max_connections: int = 0, max_connections_per_pod: int = 0,
                 max_response_bytes: int = 64 * 1024 * 1024, max_buffer_bytes: int = 1024 * 1024,
                 idle_s: float = 4.0):
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s or None
        self.max_connections = max_connections
        self.max_connections_per_pod = max_connections_per_pod
        self.max_response_bytes = max_response_bytes
        self.max_buffer_bytes = max_buffer_bytes
        self.idle_s = idle_s
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._count: dict[tuple[str, str, int], int] = {}
        self._total = 0
        # requests waiting for a connection, oldest first: (pool key, future set when one may go on)
        self._slot_waiters: deque[tuple[tuple[str, str, int], asyncio.Future[None]]] = deque()
        self._ssl: ssl.SSLContext | None = None
        self._closing = False

    # ---- pool ------------------------------------------------------------------------------
    def _has_room(self, key: tuple[str, str, int]) -> bool:
        return ((not self.max_connections or self._total < self.max_connections)
                and (not self.max_connections_per_pod or self._count.get(key, 0) < self.max_connections_per_pod))

    def _pop_idle(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.idle_s:
                return conn
            conn.close()
        return None

    def _evict_for(self, key: tuple[str, str, int]) -> bool:
        """Only the limit in all stands in the way of a new connection to ``key``: close the longest
        idle connection to another pod, if there is one, to make room (True when it did)."""
        if self.max_connections_per_pod and self._count.get(key, 0) >= self.max_connections_per_pod:
            return False
        oldest: _Connection | None = None
        for other, idle in self._idle.items():
            if other != key and idle and (oldest is None or idle[0].idle_since < oldest.idle_since):
                oldest = idle[0]
        if oldest is None:
            return False
        oldest.close()
        self._forget(oldest, wake=False)  # now, not when the loop reports the close: the caller takes the slot
        return True

    def _can_go_on(self, key: tuple[str, str, int]) -> bool:
        """Whether a request waiting for a connection to ``key`` would find one now."""
        if self._idle.get(key) or self._has_room(key):
            return True
        if self.max_connections_per_pod and self._count.get(key, 0) >= self.max_connections_per_pod:
            return False
        return any(idle for other, idle in self._idle.items() if other != key)

    async def _acquire(self, key: tuple[str, str, int], deadline: float) -> _Connection:
        loop = asyncio.get_running_loop()
        while True:
            conn = self._pop_idle(key)
            if conn is not None:
                return conn
            if self._has_room(key) or self._evict_for(key):
                return await self._connect(key, deadline)
            left = deadline - loop.time()
            if left <= 0:
                raise PoolBusy(f"no free connection to {key[1]}:{key[2]} within {self.connect_timeout_s:g} s")
            waiter: asyncio.Future[None] = loop.create_future()
            entry = (key, waiter)
            self._slot_waiters.append(entry)
            handle = loop.call_later(left, _wake, waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    # woken, then cancelled before it ran: the connection or slot it was woken for
                    # goes to the next waiter, not to nobody until that one's deadline
                    self._remove_waiter(entry)
                    self._wake_one()
                raise
            finally:
                handle.cancel()
                self._remove_waiter(entry)

    def _remove_waiter(self, entry: tuple[tuple[str, str, int], asyncio.Future[None]]) -> None:
        try:
            self._slot_waiters.remove(entry)
        except ValueError:
            pass

    async def _connect(self, key: tuple[str, str, int], deadline: float) -> _Connection:
        loop = asyncio.get_running_loop()
        scheme, host, port = key
        conn = _Connection(self, key)
        self._total += 1
        self._count[key] = self._count.get(key, 0) + 1
        tls: dict[str, Any] = {}
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = {"ssl": self._ssl, "server_hostname": host}
        try:
            await asyncio.wait_for(loop.create_connection(lambda: conn, host, port, **tls),
                                   max(deadline - loop.time(), 0.001))
        except BaseException as exc:
            conn.closed = True
            self._forget(conn)
            if isinstance(exc, (OSError, TimeoutError, ssl.SSLError)):
                raise PodIOError(f"connect to {host}:{port}: {type(exc).__name__}") from exc
            raise
        return conn

    def _forget(self, conn: _Connection, wake: bool = True) -> None:
        """A connection closed: free its slot (once), and wake a waiter it lets go on (``wake``)."""
        if conn.forgotten:
            return
        conn.forgotten = True
        self._total -= 1
        left = self._count.get(conn.key, 1) - 1
        if left > 0:
            self._count[conn.key] = left
        else:
            self._count.pop(conn.key, None)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
            if not idle:  # a pod's key goes with its last connection (pods churn, each with a new address)
                del self._idle[conn.key]
        if wake:
            self._wake_one()

    def drop(self, url: str) -> None:
        """A pod left the fleet: close its idle connections now (a peer that never closes them, a lost
        node, would hold them for ever) and forget its address."""
        key = split_url(url)[0]
        for conn in self._idle.pop(key, []):
            conn.close()

    def _wake_one(self) -> None:
        """A connection came free or was closed: wake the oldest waiter it lets go on (one for the same
        pod, or, under the limit in all, for any pod). A waiter that cannot go on yet keeps waiting."""
        for key, waiter in self._slot_waiters:
            if not waiter.done() and self._can_go_on(key):
                waiter.set_result(None)
                return

    def _put_back(self, conn: _Connection) -> None:
        if conn.closed or not conn.complete or not conn.keep_alive or conn.chunks or self._closing:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)
        self._wake_one()

    # ---- requests --------------------------------------------------------------------------
    async def post(self, url: str, body: bytes, headers: Mapping[str, str], method: str = "POST") -> UpstreamResponse:
        """Send the request (a POST, or ``method`` with ``body``: a GET's is empty) and wait for the
        answer's status and headers.

        Raises ``PodIOError`` (cannot connect, closed, malformed, read timeout) or ``PoolBusy``.
        """
        key, host, target = split_url(url)
        data = [request_head(target, host, headers, len(body), method), body]
        deadline = asyncio.get_running_loop().time() + self.connect_timeout_s
        for attempt in (0, 1):
            conn = await self._acquire(key, deadline)
            reused = conn.uses > 0
            conn.start(data)
            try:
                while not conn.headers_done:
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait(self.read_timeout_s)
            except PodIOError:
                conn.close()
                # the pod closed this idle connection as the request went out (a reused connection is
                # taken without waiting, so the request was written at deadline - connect timeout)
                if (attempt == 0 and reused and not conn.received and conn.closed
                        and asyncio.get_running_loop().time() - deadline + self.connect_timeout_s < STALE_CLOSE_S):
                    continue
                raise
            except BaseException:
                conn.close()  # cancelled: closing is how the pod learns the client has gone
                raise
            return UpstreamResponse(conn)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        self._closing = True
        for idle in list(self._idle.values()):
            for conn in list(idle):
                conn.close()
        self._idle.clear()
        await asyncio.sleep(0)
