"""The sidecar's ASGI application: the two-leg handler, the pass-through proxy, health and metrics.

It is a plain ASGI callable rather than a framework app because it needs two things frameworks
hide: a watch on the client's ``http.disconnect`` while a leg is running (so a client that leaves
mid-prefill cancels the prefill request at the prefill pod), and byte-for-byte relaying of the
decoder's response, chunk by chunk, headers included. One long-lived aiohttp session carries
both legs.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvcommon.asgi import read_body, unless_disconnected
from kvcommon.errors import APIError, ClientDisconnected, error_body
from kvcommon.sse import EventFramer, error_event
from kvcommon.transfer import drop_client_params, one_prefill_cannot_serve
from sidecar.allowlist import Allowlist, Resolver, TargetResolver, resolve_name
from sidecar.config import SidecarSettings
from sidecar.dataparallel import DataParallel, RankError
from sidecar.legs import (
    GENERATION_PATHS,
    BadBody,
    decode_body,
    engine_json,
    forward_headers,
    has_prefill_header,
    is_generation_path,
    is_streamed,
    normal_path,
    parse_body,
    pick_prefill_target,
    prefill_body,
    request_id,
    response_headers,
    without_client_params,
    write_body,
)
from sidecar.metrics import SidecarMetrics
from sidecar.targets import Target, TargetError, parse_target

log = logging.getLogger("kvroute.sidecar")

_JSON = b"application/json"


# what a client is told of a failed prefill leg (the log has the pod's address and the error's text)
_FAILED = {"connect_error": "the prefill pod could not be reached",
           "bad_response": "the prefill pod's answer could not be used",
           "server_error": "the prefill pod's answer broke off"}


@dataclass(slots=True)
class PrefillResult:
    """How the prefill leg ended. ``kind``: ok, client_error, server_error, connect_error, timeout, bad_response.

    ``decode`` is the decode leg's body with ``params`` in it, written (kind ok, params answered)."""

    kind: str
    status: int = 0
    body: bytes = b""
    content_type: bytes = _JSON
    params: dict[str, Any] | None = None
    decode: bytes = b""
    detail: str = ""
    seconds: float = 0.0


async def _send_bytes(send, status: int, body: bytes, content_type: bytes | None = _JSON,
                      extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-length", str(len(body)).encode())]
    if content_type:
        headers.append((b"content-type", content_type))
    headers.extend(extra or [])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_error(send, status: int, message: str, err_type: str | None = None,
                      extra: list[tuple[bytes, bytes]] | None = None) -> None:
    await _send_bytes(send, status, error_body(status, message, err_type=err_type), _JSON, extra)


def prefill_ssl_context(settings: SidecarSettings) -> ssl.SSLContext | bool:
    """How HTTPS prefill legs check certificates: a CA bundle, the system's CAs (True), or not at all (False)."""
    if not settings.prefill_tls_verify:
        return False
    if settings.prefill_ca_file:
        try:
            return ssl.create_default_context(cafile=settings.prefill_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load --prefill-ca-file {settings.prefill_ca_file}: {exc}") from exc
    return True


async def _read_at_most(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """``resp``'s body, or None when it is larger than ``limit`` bytes: by its Content-Length, before
    reading anything, or counted chunk by chunk as it arrives (nothing past the limit is kept)."""
    if resp.content_length is not None and resp.content_length > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _outcome(status: int) -> str:
    return "ok" if status < 400 else "client_error" if status < 500 else "server_error"


class SidecarApp:
    """ASGI app for ``kvroute sidecar``; ``resolver`` is injectable so name checks can be exercised."""

    def __init__(self, settings: SidecarSettings, *, resolver: Resolver = resolve_name,
                 metrics: SidecarMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or SidecarMetrics()
        self.allowlist = Allowlist(
            settings.prefill_allowlist, settings.prefill_allow_dns, settings.prefill_allowlist_url,
            dns_refresh_s=settings.dns_refresh_s, url_refresh_s=settings.allowlist_refresh_s, resolver=resolver,
            on_refresh_error=lambda source: self.metrics.allowlist_refresh_errors.labels(source).inc(),
            url_key=settings.prefill_allowlist_key)
        self.targets = TargetResolver(resolver, ttl_s=settings.target_dns_cache_s)
        self.session: aiohttp.ClientSession | None = None
        self.prefill_ssl = prefill_ssl_context(settings)
        self.dp = DataParallel(settings)
        self.metrics.allowlist_entries.set_function(lambda: len(self.allowlist.snapshot))
        self._sample = random.SystemRandom().randrange  # --prefill-sampling: which of several targets

    # ---- lifecycle -------------------------------------------------------------------------
    async def startup(self) -> None:
        # keep-alive below vLLM/uvicorn's 5 s, so a pooled connection is never one the server is closing
        connector = aiohttp.TCPConnector(limit=self.settings.max_connections, ttl_dns_cache=10,
                                         keepalive_timeout=4.0)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                             skip_auto_headers=("User-Agent",))
        await self.allowlist.start(self.session)
        if self.settings.ssrf_protection and not self.allowlist.configured:
            log.warning("SSRF protection is on and no allowlist is configured: every request naming a "
                        "prefill target will be refused (403); see --prefill-allowlist")
        if not self.settings.ssrf_protection:
            log.warning("SSRF protection is OFF: any client that can reach this port can make it call any host")

    async def shutdown(self) -> None:
        await self.allowlist.stop()
        if self.session is not None:
            await self.session.close()

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:  # reported to the server, which exits cleanly
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ---- ASGI entry ------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] == "websocket":  # nothing here speaks WebSocket: refuse the handshake (403)
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if not path.startswith("/"):  # "GET *" or an absolute-form target: nothing to proxy
            await _send_error(send, 400, "the request target must be a path", "BadRequestError")
            return
        if path == "/health" and method in ("GET", "HEAD"):
            await _send_bytes(send, 200, b"", None)
            return
        if path == "/metrics" and method == "GET":
            await _send_bytes(send, 200, self.metrics.render(), self.metrics.content_type.encode())
            return
        try:
            rank = self.dp.rank(scope)
        except RankError as exc:
            await _send_error(send, 400, str(exc), "BadRequestError")
            return
        self.metrics.in_flight.inc()
        try:
            try:
                body = await read_body(scope, receive, self.settings.max_body_bytes, self.settings.body_timeout_s)
            except ClientDisconnected:  # nobody is left to answer
                return
            except APIError as exc:  # 413, 400 (Content-Length) or 408; after 408 the rest of the body is not read
                close = [(b"connection", b"close")] if exc.status == 408 else None
                await _send_error(send, exc.status, exc.message, extra=close)
                return
            started = False

            async def tracked_send(message) -> None:
                nonlocal started
                started = started or message["type"] == "http.response.start"
                await send(message)

            if method == "POST" and path in GENERATION_PATHS:
                work = self._generate(scope, body, tracked_send, rank)
            else:
                self.metrics.requests.labels("proxy").inc()
                try:
                    body = self._engine_body(scope, body)
                except BadBody as exc:
                    await _send_error(send, 400, str(exc), "BadRequestError")
                    return
                work = self._decode_leg(scope, body, tracked_send, leg="direct", rank=rank)
            try:
                await self._until_disconnect(scope, work, receive)
            except Exception:  # a bug must cost one request an error answer, never the client a stack trace
                log.exception("request to %s failed", path)
                if not started:
                    await _send_error(send, 500, "internal error in the sidecar", "InternalServerError")
        finally:
            self.metrics.in_flight.dec()

    async def _until_disconnect(self, scope, work, receive) -> None:
        """Run ``work``; if the client disconnects first, cancel it (which aborts the running leg upstream)."""

        async def whole() -> bool:
            await work
            return True

        if not await unless_disconnected(scope, receive, whole()):
            self.metrics.requests.labels("client_disconnected").inc()

    # ---- the two-leg handler ---------------------------------------------------------------
    async def _generate(self, scope, body: bytes, send, rank: int | None) -> None:
        headers = scope["headers"]
        if not has_prefill_header(headers):
            self.metrics.requests.labels("direct").inc()
            try:
                body = self._engine_body(scope, body)
            except BadBody as exc:
                await _send_error(send, 400, str(exc), "BadRequestError")
                return
            await self._decode_leg(scope, body, send, leg="direct", rank=rank)
            return
        self.metrics.requests.labels("pd").inc()
        rid = request_id(headers)
        rid_header = [(b"x-request-id", rid.encode("latin-1"))]
        try:  # read as the engine reads it (legs.parse_body); written back by legs.write_body
            request, exact = parse_body(body)
        except BadBody as exc:
            await _send_error(send, 400, str(exc), "BadRequestError", rid_header)
            return
        if not isinstance(request, dict):
            await _send_error(send, 400, "request body must be a JSON object", "BadRequestError", rid_header)
            return
        if self.settings.strip_client_kv_transfer_params and drop_client_params(request):
            self.metrics.client_params_stripped.inc()

        raw = pick_prefill_target(headers, self._sample if self.settings.prefill_sampling else None)
        try:
            if raw is None:
                raise TargetError("the header is empty")
            target = parse_target(raw)
        except TargetError as exc:
            self.metrics.ssrf_rejections.labels("malformed").inc()
            await _send_error(send, 400, f"bad prefill target in the prefill header: {exc}",
                              "BadRequestError", rid_header)
            return
        connect_host = await self._allowed_address(target)
        if connect_host is None:
            await _send_error(send, 403, f"Forbidden: prefill target {raw!r} is not allowed by the sidecar's "
                              "SSRF allowlist", "PermissionDeniedError", rid_header)
            return

        reason = one_prefill_cannot_serve(request, scope["path"])
        if reason is not None:  # no prefill leg: the decoder prefills, as when a prefill answers no params
            self.metrics.prefill_skipped.labels(reason).inc()
            try:
                local = write_body(decode_body(request, None), exact)
            except BadBody as exc:
                await _send_error(send, 400, str(exc), "BadRequestError", rid_header)
                return
            # no x-kvroute-prefill-ms: no prefill leg ran, so the router has no duration to calibrate on
            await self._decode_leg(scope, local, send, leg="decode", rid=rid,
                                   extra_headers=[(b"x-kvroute-prefill", b"local")], rank=rank)
            return
        try:
            sent = write_body(prefill_body(request, scope["path"]), exact)
        except BadBody as exc:
            await _send_error(send, 400, str(exc), "BadRequestError", rid_header)
            return

        result = await self._prefill_leg(scope, target, connect_host, sent, request, exact, rid)
        how = "remote"
        if result.kind == "ok":
            if not result.params:
                how = "local"
                self.metrics.no_params.inc()
        elif result.kind == "client_error":
            await _send_bytes(send, result.status, result.body, result.content_type, rid_header)
            return
        elif self.settings.fallback_on_prefill_error:
            how = "fallback"
            self.metrics.fallbacks.labels(result.kind).inc()
            log.warning("prefill at %s failed (%s: %s); prefilling locally", target.host_port, result.kind,
                        result.detail)
        elif result.kind == "server_error":
            await _send_bytes(send, result.status, result.body, result.content_type, rid_header)
            return
        else:
            # the client (through the router, a tenant) is told what failed, not where: the prefill
            # pod's address, and a connection error's text that names it, go to the log only
            log.warning("prefill at %s failed (%s: %s)", target.host_port, result.kind, result.detail)
            if result.kind == "timeout":
                await _send_error(send, 504, f"the prefill leg timed out after {self.settings.prefill_timeout}s",
                                  "GatewayTimeout", rid_header)
            else:
                await _send_error(send, 502, f"the prefill leg failed: {_FAILED.get(result.kind, result.kind)}",
                                  "BadGateway", rid_header)
            return
        out = result.decode
        if how != "remote":
            try:  # no deeper than the prefill body, which was written: not expected to fail
                out = write_body(decode_body(request, None), exact)
            except BadBody as exc:
                await _send_error(send, 400, str(exc), "BadRequestError", rid_header)
                return
        told = [(b"x-kvroute-prefill", how.encode()),
                (b"x-kvroute-prefill-ms", f"{result.seconds * 1000:.1f}".encode())]
        # a streamed decode leg that carries the prefill's params is handed over even if the client leaves
        # (below, _decode_leg): the decode engine then reads the blocks, and the prefill pod frees them
        await self._decode_leg(scope, out, send, leg="decode", rid=rid, extra_headers=told, rank=rank,
                               hand_over=how == "remote" and is_streamed(request))

    def _engine_body(self, scope, body: bytes) -> bytes:
        """The body to send the decoder for a request that goes to it directly, on any path.

        The decision is made on the body as the engine will parse it (``legs.engine_json``: Python's
        json, so ``"kv\\u005ftransfer_params"``, NaN or a lone surrogate change nothing): a client's own
        top-level ``kv_transfer_params`` is removed and the body re-serialised. A body that cannot be
        parsed is refused (400) when it may reach a generation route (any spelling of the path) or
        says it is JSON; only other bodies (a multipart upload) pass as they are."""
        if not body:
            return body
        try:
            engine_json(body)
        except BadBody:
            ctype = next((v for k, v in scope["headers"] if k.lower() == b"content-type"), b"").lower()
            if is_generation_path(scope["path"]) or not ctype or b"json" in ctype:
                raise
            return body
        if not self.settings.strip_client_kv_transfer_params:
            return body
        stripped = without_client_params(body)
        if stripped is None:
            return body
        self.metrics.client_params_stripped.inc()
        return stripped

    async def _allowed_address(self, target: Target) -> str | None:
        """The address to connect to for ``target``, or None (counted) when SSRF protection refuses it."""
        if not self.settings.ssrf_protection:
            return str(target.ip) if target.ip is not None else target.host
        if target.ip is not None:
            addresses = [target.ip]
        else:
            try:
                addresses = await self.targets.resolve(target.host)
            except OSError:
                self.metrics.ssrf_rejections.labels("unresolvable").inc()
                return None
        snapshot = self.allowlist.snapshot
        if not addresses or not all(snapshot.allows(ip, target.port) for ip in addresses):
            self.metrics.ssrf_rejections.labels("not_allowed").inc()
            log.info("refused prefill target %s (addresses %s)", target.host_port, [str(a) for a in addresses])
            return None
        return str(addresses[0])

    async def _prefill_leg(self, scope, target: Target, connect_host: str, sent: bytes, request: dict[str, Any],
                           exact: bool, rid: str) -> PrefillResult:
        """POST ``sent`` (the written prefill body) to ``target`` at ``connect_host``; ``request`` and
        ``exact`` (``legs.parse_body``'s) make the decode body when the answer carries params."""
        assert self.session is not None
        scheme = target.scheme or self.settings.prefill_scheme
        shown = f"[{connect_host}]" if ":" in connect_host else connect_host
        url = f"{scheme}://{shown}:{target.port}{scope['path']}"
        headers = forward_headers(scope["headers"])
        # a rank names one of the decode pod's engines (dataparallel.py), never one of the prefill pod's
        headers = [(k, v) for k, v in headers
                   if k.lower() not in ("content-type", "accept-encoding", "x-data-parallel-rank")]
        headers += [("Host", target.host_port), ("X-Request-Id", rid), ("Content-Type", "application/json"),
                    ("Accept-Encoding", "identity")]
        extra: dict[str, Any] = {}
        if scheme == "https":
            extra["ssl"] = self.prefill_ssl
            if target.ip is None:  # connecting to the checked address: verify the certificate against the name
                extra["server_hostname"] = target.host
        # total bounds the whole leg: a wait for a free pooled connection (--max-connections) included
        timeout = aiohttp.ClientTimeout(total=self.settings.prefill_timeout, sock_connect=self.settings.connect_timeout)
        limit = self.settings.max_prefill_answer_bytes
        started = time.perf_counter()
        result = PrefillResult("bad_response")
        try:
            async with self.session.post(url, data=sent, headers=headers, timeout=timeout, allow_redirects=False,
                                         **extra) as resp:
                data = await _read_at_most(resp, limit)
                if data is None:
                    resp.close()  # the connection goes, and the rest of the answer with it
                    result = PrefillResult("bad_response", resp.status, detail=f"prefill answer larger than "
                                           f"{limit} bytes")
                else:
                    result = self._classify_prefill(resp.status, data, resp.headers.get("Content-Type"),
                                                    request, exact)
        except asyncio.CancelledError:
            self.metrics.legs.labels("prefill", "cancelled").inc()
            raise
        except aiohttp.ConnectionTimeoutError:  # a TimeoutError too: no connection, not a slow answer
            result = PrefillResult("connect_error", detail=f"no connection within the connect timeout "
                                   f"({self.settings.connect_timeout}s)")
        except TimeoutError:
            result = PrefillResult("timeout", detail=f"no answer within {self.settings.prefill_timeout}s")
        except (aiohttp.ClientConnectorError, aiohttp.ClientOSError) as exc:
            result = PrefillResult("connect_error", detail=str(exc) or type(exc).__name__)
        except aiohttp.ClientError as exc:
            result = PrefillResult("server_error", status=502, detail=str(exc) or type(exc).__name__,
                                   body=error_body(502, f"the prefill leg failed: {_FAILED['server_error']}",
                                                   err_type="BadGateway"))
        result.seconds = time.perf_counter() - started
        self.metrics.leg_seconds.labels("prefill").observe(result.seconds)
        self.metrics.legs.labels("prefill", result.kind).inc()
        return result

    @staticmethod
    def _classify_prefill(status: int, data: bytes, content_type: str | None, request: dict[str, Any],
                          exact: bool) -> PrefillResult:
        """What the prefill's answer means; when it carries params, the decode body (``request``, read
        by ``legs.parse_body`` with ``exact``, plus the params) is written here: params that cannot be
        written make the answer unusable."""
        # relayed with a 4xx/5xx; a character outside latin-1 (aiohttp decodes headers as UTF-8) becomes "?"
        ctype = (content_type or "application/json").encode("latin-1", "replace")
        if 400 <= status < 500:
            return PrefillResult("client_error", status, data, ctype)
        if status >= 500:
            return PrefillResult("server_error", status, data, ctype, detail=f"status {status}")
        if status != 200:
            return PrefillResult("bad_response", status, detail=f"unexpected status {status}")
        try:
            parsed, answer_exact = parse_body(data)
        except BadBody:
            return PrefillResult("bad_response", status, detail="response is not JSON")
        params = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
        if params is not None and not isinstance(params, dict):
            return PrefillResult("bad_response", status, detail="kv_transfer_params is not an object")
        if not params:
            return PrefillResult("ok", status, params=params)
        try:
            decode = write_body(decode_body(request, params), exact or answer_exact, "kv_transfer_params")
        except BadBody as exc:
            return PrefillResult("bad_response", status, detail=str(exc))
        return PrefillResult("ok", status, params=params, decode=decode)

    # ---- the decoder: decode leg and pass-through ------------------------------------------
    @staticmethod
    async def _first_chunk(resp: aiohttp.ClientResponse) -> None:
        """Wait (each read bounded by the leg's ``sock_read``, ``--decode-timeout``) for ``resp``'s first
        body chunk, or its end; nothing is relayed: the client is gone."""
        try:
            if resp.status == 200:
                await resp.content.readany()
        except (TimeoutError, aiohttp.ClientError):
            pass

    async def _hand_over(self, pending: asyncio.Future) -> None:
        """The client left while a streamed decode leg carrying a prefill's params had no answer yet:
        let the request reach the decode engine (its first chunk), then close it (``_decode_leg``)."""
        try:
            resp = await pending
        except Exception:  # the decoder failed or was unreachable: nothing was handed over
            return
        try:
            await self._first_chunk(resp)
        finally:
            resp.close()

    async def _decode_leg(self, scope, body: bytes, send, *, leg: str, rid: str | None = None,
                          extra_headers: list[tuple[bytes, bytes]] | None = None, rank: int | None = None,
                          hand_over: bool = False) -> None:
        """Send ``body`` to the local decoder (engine ``rank``: ``dataparallel.py``) and relay its answer
        chunk by chunk (plus ``extra_headers``).

        ``hand_over``: ``body`` is a streamed request carrying a prefill pod's ``kv_transfer_params``. If
        the client leaves before the decoder's first chunk, the leg is not cut at once but when that
        chunk arrives (each wait bounded by ``--decode-timeout``): by then the decode engine has taken
        the params over (read the blocks, so the prefill pod frees them). Cut earlier, the request can
        be lost before the engine sees it (vLLM 0.32's server drops a request whose connection closes
        before its body is read, and adds a streamed one to the engine only when its body is first
        iterated), and the prefill pod holds the blocks for its whole NIXL lease (30 s by default)."""
        assert self.session is not None
        target = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string") or b""
        base, rank_headers = self.dp.decoder(rank)
        url = base + target.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")
        headers = forward_headers(scope["headers"])
        if rank_headers:  # the rank this port or header chose replaces any the client sent
            names = {k.lower() for k, _ in rank_headers}
            headers = [(k, v) for k, v in headers if k.lower() not in names] + rank_headers
        if rid is None:
            if any(k.lower() == b"x-request-id" for k, _ in scope["headers"]):
                rid = request_id(scope["headers"])  # the client's when sane, else a fresh one
        if rid is not None:
            headers.append(("X-Request-Id", rid))
        if not any(k.lower() == "accept-encoding" for k, _ in headers):
            headers.append(("Accept-Encoding", "identity"))
        # sock_connect bounds opening a connection; connect, the wait for a free one in the pool
        # (--max-connections) too, by the decode timeout, the longest this leg waits for anything. Not by
        # the connect timeout: a real-vLLM P/D run once gave up on the decoder after 5 s that way
        timeout = aiohttp.ClientTimeout(total=None, connect=self.settings.decode_timeout,
                                        sock_connect=self.settings.connect_timeout,
                                        sock_read=self.settings.decode_timeout)
        started = time.perf_counter()
        request = self.session.request(scope["method"], url, data=body or None, headers=headers,
                                       timeout=timeout, allow_redirects=False)
        # handed over: a cancel (the client gone) does not reach the request until _hand_over is done
        pending = asyncio.ensure_future(request) if hand_over else None
        try:
            resp = await (asyncio.shield(pending) if pending is not None else request)
        except asyncio.CancelledError:
            self.metrics.legs.labels(leg, "cancelled").inc()
            if pending is not None:
                await self._hand_over(pending)
            raise
        except (aiohttp.ClientConnectorError, aiohttp.ClientOSError) as exc:
            self.metrics.legs.labels(leg, "connect_error").inc()
            log.warning("decoder at %s unreachable: %r", base, exc)
            await _send_error(send, 503, "The decode node is not ready to accept requests", "ServiceUnavailable")
            return
        except aiohttp.ConnectionTimeoutError:  # a TimeoutError too, so before it: no connection, not silence
            self.metrics.legs.labels(leg, "connect_error").inc()
            log.warning("no connection to the decoder at %s (connect timeout %ss, pool wait %ss)", base,
                        self.settings.connect_timeout, self.settings.decode_timeout)
            await _send_error(send, 503, f"no connection to the decode node: none opened within the connect "
                              f"timeout ({self.settings.connect_timeout}s) or free in the pool within the decode "
                              f"timeout ({self.settings.decode_timeout}s)", "ServiceUnavailable")
            return
        except TimeoutError:
            self.metrics.legs.labels(leg, "timeout").inc()
            await _send_error(send, 504, f"the decoder did not answer within {self.settings.decode_timeout}s",
                              "GatewayTimeout")
            return
        except aiohttp.ClientError as exc:
            self.metrics.legs.labels(leg, "proxy_error").inc()
            await _send_error(send, 502, f"the decoder failed: {type(exc).__name__}", "BadGateway")
            return
        outcome = _outcome(resp.status)
        first = False  # a body chunk has come from the decoder
        try:
            out_headers = response_headers(resp.raw_headers)
            if rid is not None and not any(k == b"x-request-id" for k, _ in out_headers):
                out_headers.append((b"x-request-id", rid.encode("latin-1")))
            out_headers.extend(extra_headers or ())
            await send({"type": "http.response.start", "status": resp.status, "headers": out_headers})
            # an event stream is passed on in whole events: one broken inside an event leaves the client
            # no half event before the error event below (kvcommon/sse.py)
            framer = EventFramer() if resp.headers.get("Content-Type", "").startswith("text/event-stream") else None
            try:
                async for chunk in resp.content.iter_any():
                    first = True
                    if framer is not None and not (chunk := framer.whole(chunk)):
                        continue
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if framer is not None and framer.held:  # the last event, without its blank line
                    await send({"type": "http.response.body", "body": framer.rest(), "more_body": True})
            except (TimeoutError, aiohttp.ClientError) as exc:
                outcome = "stream_error"
                log.warning("decoder stream broke: %s", exc or type(exc).__name__)
                if framer is not None:  # in the shape the route's clients read (an Anthropic one on /v1/messages)
                    err = error_event(normal_path(scope["path"]), 502,
                                      f"the decoder stream broke: {exc or type(exc).__name__}",
                                      err_type="InternalServerError")
                    await send({"type": "http.response.body", "body": err, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            outcome = "cancelled"
            if hand_over and not first:
                await self._first_chunk(resp)
            resp.close()
            raise
        finally:
            resp.release()
            self.metrics.leg_seconds.labels(leg).observe(time.perf_counter() - started)
            self.metrics.legs.labels(leg, outcome).inc()
