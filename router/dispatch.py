"""Sending a request to a pod and relaying its answer: one long-lived aiohttp session.

Why aiohttp: a bare FastAPI proxy measured 2,286 req/s with aiohttp against 307 req/s with httpx at
32 connections on this kind of machine (httpx's pool serialises under a lock); ``bench/overhead.py``
re-measures it. Bytes pass through untouched: request bodies as the client sent them, responses as
network chunks (no SSE re-parsing, no decompression). A connection failure or a 5xx before the
first response byte is retried on the next-best pod; after the first byte nothing is retried.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

# Request headers never forwarded to a pod: hop-by-hop ones, ones aiohttp recomputes, and internal
# ones a client must not be able to set (they steer sidecars to hosts, or impersonate the router).
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
                        "expect", "proxy-connection"})
INTERNAL = frozenset({"x-prefiller-host-port", "x-prefiller-url", "x-data-parallel-host-port",
                      "x-encoder-hosts-ports", "x-kv-cache-source-host-port", "x-data-parallel-rank"})
# ours, and llm-d's prefixed spellings of the same routing headers (x-llm-d-prefiller-host-port, ...)
INTERNAL_PREFIXES = ("x-kvroute-", "x-llm-d-")
RESPONSE_DROP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date",
                           "x-kvroute-pod", "x-request-id", "proxy-authenticate", "trailer", "upgrade"})


def forwardable(name: str) -> bool:
    """Whether a client request header (lower-case name) may be passed on to a pod."""
    return name not in HOP_BY_HOP and name not in INTERNAL and not name.startswith(INTERNAL_PREFIXES)


def upstream_headers(raw: list[tuple[bytes, bytes]], request_id: str, drop_authorization: bool) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in raw:
        name = k.decode("latin-1").lower()
        if not forwardable(name) or name == "x-request-id" or (drop_authorization and name == "authorization"):
            continue
        value = v.decode("latin-1")
        out[name] = f"{out[name]}, {value}" if name in out else value
    out["x-request-id"] = request_id
    return out


def response_headers(resp: aiohttp.ClientResponse) -> list[tuple[str, str]]:
    return [(k, v) for k, v in resp.headers.items() if k.lower() not in RESPONSE_DROP]


class UpstreamError(Exception):
    """The pod could not be reached or failed before sending a byte; another pod may be tried."""

    def __init__(self, cause: str, status: int | None = None, body: bytes = b"",
                 headers: list[tuple[str, str]] | None = None):
        super().__init__(cause)
        self.cause = cause
        self.status = status
        self.body = body
        self.headers = headers or []


@dataclass
class Opened:
    """An upstream response whose status is below 500 (and, for streams, whose first chunk is in)."""

    resp: aiohttp.ClientResponse
    first_chunk: bytes
    streaming: bool


class Dispatcher:
    """Owns the one upstream ``ClientSession`` of the process."""

    def __init__(self, connect_timeout_s: float = 3.0, read_timeout_s: float | None = None,
                 max_connections: int = 0, max_connections_per_pod: int = 0):
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
        self._limits = (max_connections, max_connections_per_pod)
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=self._limits[0], limit_per_host=self._limits[1],
                                         ttl_dns_cache=300, enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, auto_decompress=False,
                                             skip_auto_headers=("User-Agent", "Accept-Encoding"))

    async def stop(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def open(self, url: str, body: bytes, headers: dict[str, str],
                   on_first_byte: Callable[[], None] | None = None) -> Opened:
        """POST and wait for the status (and, for SSE, the first chunk).

        Raises ``UpstreamError`` for anything retryable: connect failures, resets before the first
        byte, 5xx. The caller owns the returned response and must close or release it.
        """
        assert self.session is not None, "dispatcher not started"
        try:
            resp = await self.session.post(url, data=body, headers=headers)
        except (TimeoutError, aiohttp.ClientConnectionError, OSError) as exc:
            raise UpstreamError(f"connect: {type(exc).__name__}") from exc
        try:
            if resp.status >= 500:
                try:
                    payload = await resp.read()
                except (TimeoutError, aiohttp.ClientError, OSError):
                    payload = b""
                hdrs = response_headers(resp)
                resp.release()
                raise UpstreamError(f"status {resp.status}", resp.status, payload, hdrs)
            ctype = resp.headers.get("content-type", "")
            streaming = ctype.startswith("text/event-stream")
            first = b""
            if streaming:
                try:
                    first = await resp.content.readany()
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    raise UpstreamError(f"read: {type(exc).__name__}") from exc
                if not first:
                    raise UpstreamError("empty stream")
                if on_first_byte:
                    on_first_byte()
            return Opened(resp=resp, first_chunk=first, streaming=streaming)
        except BaseException:
            resp.close()
            raise


async def relay(opened: Opened, send: Callable[[bytes], Awaitable[None]]) -> None:
    """Send the first chunk and then every network chunk as it arrives."""
    await send(opened.first_chunk)
    content = opened.resp.content
    while True:
        chunk = await content.readany()
        if not chunk:
            return
        await send(chunk)
