"""Sending a request to a pod and relaying its answer, over the router's own HTTP/1.1 client.

The client (``router/upstream.py``) replaced aiohttp, which had replaced httpx: a bare FastAPI proxy
measured 2,286 req/s with aiohttp against 307 req/s with httpx at 32 connections on this kind of
machine (httpx's pool serialises under a lock), and ``bench/overhead.py`` measures all three. Bytes
pass through untouched: request bodies as the client sent them, responses as
network chunks (no SSE re-parsing, no decompression). A connection failure or a 5xx before the
first response byte is retried on the next-best pod; after the first byte nothing is retried.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvcommon.listener import ChunkWriter
from kvcommon.sse import EventFramer
from router.upstream import PodIOError, PoolBusy, UpstreamClient, UpstreamResponse

# Request headers never forwarded to a pod: hop-by-hop ones, ones the client writes itself (host,
# content-length), and internal ones a client must not be able to set (they steer sidecars to hosts,
# or impersonate the router).
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
                        "expect", "proxy-connection"})
INTERNAL = frozenset({"x-prefiller-host-port", "x-prefiller-url", "x-data-parallel-host-port",
                      "x-encoder-hosts-ports", "x-kv-cache-source-host-port", "x-data-parallel-rank"})
# ours, and llm-d's prefixed spellings of the same routing headers (x-llm-d-prefiller-host-port, ...)
INTERNAL_PREFIXES = ("x-kvroute-", "x-llm-d-")
# Pod answer headers never relayed to the client: hop-by-hop ones and the ones the router writes itself.
# The sidecar's report of the request's own prefill leg (``x-kvroute-prefill``/``-ms``) goes on, as
# ``x-kvroute-pod`` tells the client which pod served it: both are about that request alone.
RESPONSE_DROP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"server", b"date",
                           b"x-kvroute-pod", b"x-request-id", b"proxy-authenticate", b"trailer", b"upgrade"})


# CR, LF and NUL, which would split or cut a header written out as is (one C-level search per name and value)
_UNSENDABLE = re.compile(rb"[\r\n\0]")
# never forwarded: hop-by-hop and internal headers (and, in upstream_headers, the request id and the
# content type, which the router sets itself)
_NOT_FORWARDED = HOP_BY_HOP | INTERNAL
_NEVER = _NOT_FORWARDED | {"x-request-id", "content-type"}
# the headers a client's API key comes in (router/auth.py): not for the pods when the router checked it
CREDENTIALS = ("authorization", "x-api-key")
# Connection values that name no other header (what nearly every client sends)
_PLAIN_CONNECTION = (b"keep-alive", b"close", b"Keep-Alive", b"Close")


def forwardable(name: str) -> bool:
    """Whether a client request header (lower-case name) may be passed on to a pod: the rule that
    ``upstream_headers`` applies inline, per header, on the hot path."""
    return name not in _NOT_FORWARDED and not name.startswith(INTERNAL_PREFIXES)


def upstream_headers(raw: list[tuple[bytes, bytes]], request_id: str, drop_credentials: bool,
                     client: tuple[str, int] | None = None) -> dict[str, str]:
    """The client's headers a pod may see, plus the request id and ``content-type: application/json``.
    A header whose name or value holds CR, LF or NUL is dropped: written out as is it would split the
    upstream request. The content type is the router's to say: it has read the body as JSON, and vLLM
    refuses a completion whose declared type is anything else (``validate_json_request``: 400), so a
    client's ``curl -d`` (form-urlencoded) or a missing header would otherwise be a pod's 400 after
    the router had booked it. A header that the client's ``Connection`` names is hop-by-hop too
    (RFC 9110 7.6.1: a proxy removes it). A client's ``X-Forwarded-For`` goes on with ``client``
    (the request's peer, host and port) appended, as a proxy appends it: a server that trusts the
    header from its own loopback (vLLM's uvicorn behind a sidecar) takes the last address, not one
    the client wrote. Without one none is added (the pod then sees the router's own address, or the
    sidecar's): a header on every request cost 0.8 % of a small completion's instructions.
    ``drop_credentials``: the router checked the client's API key, which the pods are not to see
    (``CREDENTIALS``)."""
    out: dict[str, str] = {}
    unsendable = _UNSENDABLE.search
    nominated = b""  # what the client's Connection names besides keep-alive or close
    for k, v in raw:
        name = k.decode("latin-1").lower()
        if name in _NEVER or name.startswith(INTERNAL_PREFIXES) or (drop_credentials and name in CREDENTIALS):
            if name == "connection" and v not in _PLAIN_CONNECTION:
                nominated += b"," + v
            continue  # forwardable(name), written out: this runs for every header of every request
        if unsendable(k) or unsendable(v):
            continue
        value = v.decode("latin-1")
        out[name] = f"{out[name]}, {value}" if name in out else value
    if nominated:
        for option in nominated.decode("latin-1").split(","):
            out.pop(option.strip().lower(), None)
    if client is not None and "x-forwarded-for" in out:
        out["x-forwarded-for"] += f", {client[0]}"
    out["x-request-id"] = request_id
    out["content-type"] = "application/json"
    return out


def response_headers(resp: UpstreamResponse) -> list[tuple[bytes, bytes]]:
    """The pod's answer headers the client gets, as ASGI wants them (lower-case name, value bytes).
    A header that the pod's own ``Connection`` names is hop-by-hop too (RFC 9110 7.6.1) and is
    dropped. Only a header dropped anyway pays for that test (one comparison: about 25 ns for the three
    of a vLLM answer), and a Connection that names something besides keep-alive or close (vLLM's
    never does) leaves the comprehension for ``_without_nominated``."""
    try:
        return [(k, v) for k, v in resp.headers.raw if k not in RESPONSE_DROP
                or k == b"connection" and v not in _PLAIN_CONNECTION and _nominates()]
    except _Nominated:
        return _without_nominated(resp.headers.raw)


class _Nominated(Exception):
    """The pod's Connection header names other headers (``response_headers``' rare path)."""


def _nominates() -> bool:
    raise _Nominated


def _without_nominated(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``raw`` less RESPONSE_DROP and the headers its Connection headers name."""
    named = {option.strip().lower() for k, v in raw if k == b"connection" for option in v.split(b",")}
    return [(k, v) for k, v in raw if k not in RESPONSE_DROP and k not in named]


class UpstreamError(Exception):
    """The pod could not be reached or failed before sending a byte; another pod may be tried."""

    def __init__(self, cause: str, status: int | None = None, body: bytes = b"",
                 headers: list[tuple[bytes, bytes]] | None = None, pod_down: bool = True):
        super().__init__(cause)
        self.cause = cause
        self.status = status
        self.body = body
        self.headers = headers or []
        self.pod_down = pod_down and status is None  # False for a 5xx, and for our own pool being full

    @property
    def kind(self) -> str:
        """What failed, without the detail (which may name the pod's address): connect, read, busy,
        empty stream, or the status line."""
        return self.cause.split(":", 1)[0]


@dataclass
class Opened:
    """An upstream response whose status is below 500 (and, for streams, whose first chunk is in)."""

    resp: UpstreamResponse
    first_chunk: bytes
    streaming: bool
    # a stream whose first chunk held no token: the first-byte callback, still owed at the first
    # token's event (``relay`` calls it), where that chunk ended (``first_event_begins``'s state)
    # and the events that come before the first token (``Dispatcher.open``'s ``preamble``)
    first_token: Callable[[], None] | None = None
    skipping: int = 0
    preamble: tuple[bytes, ...] = ()


# first_event_begins's states: between lines, inside a comment line, inside an event of the
# preamble, and inside one whose last byte was a newline (a blank line ends it)
_LINE, _COMMENT, _PREAMBLE, _PREAMBLE_NL = 0, 1, 2, 3


def first_event_begins(data: bytes, skipping: int = _LINE, preamble: tuple[bytes, ...] = ()) -> tuple[bool, int]:
    """(whether the first token's SSE event begins in ``data``, where ``data`` ends: a state to pass
    with the next chunk), ``skipping`` telling where it begins. Comment lines (``:`` first) and blank
    lines are no event: vLLM's ``--sse-keep-alive-interval`` sends ``: keep-alive`` while a request
    waits or prefills, long before its first token. Nor is an event whose first line begins with one
    of ``preamble``: the Responses API's ``response.created`` and ``response.in_progress``, sent as
    the request is taken (router/responses.py). Such an event ends at a blank line, as vLLM ends
    each (``\n\n``)."""
    i, n = 0, len(data)
    while i < n:
        if skipping == _COMMENT:
            ends = [j for j in (data.find(b"\n", i), data.find(b"\r", i)) if j >= 0]
            if not ends:
                return False, _COMMENT
            skipping, i = _LINE, min(ends) + 1
        elif skipping == _PREAMBLE_NL:
            if data[i] == 10:
                skipping, i = _LINE, i + 1
            else:
                skipping = _PREAMBLE
        elif skipping == _PREAMBLE:
            j = data.find(b"\n\n", i)
            if j < 0:
                return False, _PREAMBLE_NL if data[-1] == 10 else _PREAMBLE
            skipping, i = _LINE, j + 2
        elif data[i] in (10, 13):
            i += 1
        elif data[i] == 58:  # ":"
            skipping = _COMMENT
        elif preamble and data.startswith(preamble, i):
            skipping = _PREAMBLE
        else:
            return True, _LINE
    return False, skipping


class Dispatcher:
    """Owns the one upstream client (connection pool) of the process."""

    def __init__(self, connect_timeout_s: float = 3.0, read_timeout_s: float | None = None,
                 max_connections: int = 0, max_connections_per_pod: int = 0):
        self._args = (connect_timeout_s, read_timeout_s, max_connections, max_connections_per_pod)
        self.client: UpstreamClient | None = None

    async def start(self) -> None:
        self.client = UpstreamClient(*self._args)

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None

    async def open(self, url: str, body: bytes, headers: dict[str, str],
                   on_first_byte: Callable[[], None] | None = None, preamble: tuple[bytes, ...] = (),
                   method: str = "POST") -> Opened:
        """POST (or ``method``) and wait for the status (and, for SSE, the first chunk).
        ``on_first_byte`` is called at the first token: a stream's first event that is not one of
        ``preamble`` (``first_event_begins``).

        Raises ``UpstreamError`` for anything retryable: connect failures, resets before the first
        byte, 5xx. The caller owns the returned response and must close or release it.
        """
        assert self.client is not None, "dispatcher not started"
        try:
            resp = await self.client.post(url, body, headers, method)
        except PoolBusy as exc:
            raise UpstreamError(f"busy: {exc}", pod_down=False) from exc
        except PodIOError as exc:
            raise UpstreamError(f"connect: {exc}") from exc
        try:
            if resp.status >= 500:
                try:
                    payload = await resp.read()
                except PodIOError:
                    payload = b""
                hdrs = response_headers(resp)
                resp.release()
                raise UpstreamError(f"status {resp.status}", resp.status, payload, hdrs)
            streaming = (resp.headers.first(b"content-type") or b"").startswith(b"text/event-stream")
            first = b""
            if streaming:
                try:
                    first = await resp.readany()
                except PodIOError as exc:
                    raise UpstreamError(f"read: {exc}") from exc
                if not first:
                    raise UpstreamError("empty stream")
                if first[:1] == b":" or (preamble and first.startswith(preamble)):  # begun, and no token yet
                    found, skipping = first_event_begins(first, _LINE, preamble)
                    if not found:
                        return Opened(resp, first, True, on_first_byte, skipping, preamble)
                if on_first_byte:
                    on_first_byte()
            return Opened(resp=resp, first_chunk=first, streaming=streaming)
        except BaseException:
            resp.close()
            raise


async def relay(opened: Opened, send: Callable[[bytes], Awaitable[None]], writer: ChunkWriter | None = None) -> None:
    """Send the first chunk and then every network chunk as it arrives: through ``send``, or given
    ``writer``, straight from the pod's connection (``UpstreamResponse.relay_to``). Whole events only
    (``kvcommon.sse``): the start of an event waits for its end, so a stream that breaks inside one
    leaves the client no half event before the caller's error event. A stream that opened with
    comments alone calls its ``first_token`` when its first event comes."""
    if writer is not None:
        if writer(opened.first_chunk):
            await writer.drain()
        await opened.resp.relay_to(writer if opened.first_token is None else _watch_first_event(opened, writer),
                                   writer.drain)
        if writer.flush():
            await writer.drain()
        return
    framer = EventFramer()
    if first := framer.whole(opened.first_chunk):
        await send(first)
    if opened.first_token is not None:
        send = _watch_first_event_async(opened, send)
    resp = opened.resp
    while True:
        chunk = await resp.readany()
        if not chunk:
            break
        if chunk := framer.whole(chunk):
            await send(chunk)
    if framer.held:  # the last event, without its blank line
        await send(framer.rest())


def _seen(opened: Opened, data: bytes) -> None:
    """Calls ``opened.first_token`` once, when the first event begins in ``data``."""
    call = opened.first_token
    if call is not None:
        found, opened.skipping = first_event_begins(data, opened.skipping, opened.preamble)
        if found:
            opened.first_token = None
            call()


def _watch_first_event(opened: Opened, sink: Callable[[bytes], bool]) -> Callable[[bytes], bool]:
    """``sink``, looking for the first event in each chunk first (only a stream whose first chunk held
    SSE comments alone pays for it)."""
    def watched(data: bytes) -> bool:
        _seen(opened, data)
        return sink(data)
    return watched


def _watch_first_event_async(opened: Opened, send: Callable[[bytes], Awaitable[None]]
                             ) -> Callable[[bytes], Awaitable[None]]:
    """``send``, as ``_watch_first_event`` wraps a sink."""
    async def watched(data: bytes) -> None:
        _seen(opened, data)
        await send(data)
    return watched
