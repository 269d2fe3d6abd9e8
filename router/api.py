"""The HTTP surface: OpenAI routes in, one pod out; built by ``create_app(services)``.

Proxy routes read the raw body, parse it once with orjson for the few fields routing needs
(model, prompt or messages, stream) and forward the original bytes. There is no
``BaseHTTPMiddleware`` (it wraps every streamed chunk); auth, size limit and request ids are plain
function calls in the handlers. Every failure answers with OpenAI-style error JSON.
"""

from __future__ import annotations

import asyncio
import time
import itertools
import os
from contextlib import asynccontextmanager
from typing import Any, Callable

import aiohttp
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from router.auth import Caller, Gate, install_reload
from router.costs import estimate_prompt_tokens
from router.dispatch import Opened, UpstreamError, relay, upstream_headers
from router.errors import APIError, error_body, error_response, from_exc
from router.pd import explain_pd, prefill_targets
from router.openapi import openapi_body
from router.routing import Booking, Plan
from router.service import Services

POD_HEADER = "x-kvroute-pod"


_RID_PREFIX = os.urandom(6).hex()
_rid_counter = itertools.count(1)


def _request_id(request: Request) -> str:
    """The client's X-Request-Id if it is sane, else a new one (process-random prefix + counter:
    unique, and cheaper than a uuid4 per request)."""
    rid = request.headers.get("x-request-id")
    if rid and len(rid) <= 200 and rid.isprintable():
        return rid
    return f"{_RID_PREFIX}{next(_rid_counter):010x}"


class KVRouteApp(FastAPI):
    """FastAPI with a fast path: the two proxy routes skip the middleware stack, routing table and
    dependency solver (they need none of them) and are called as plain functions; everything
    else, including the lifespan, goes through FastAPI as usual."""

    fast_routes: dict[str, Callable[[Request], Any]]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.fast_routes.get(scope["path"])
            if handler is not None:
                request = Request(scope, receive)
                try:
                    response = await handler(request)
                except Exception as exc:  # the same answer the slow path's handler would give
                    response = error_response(500, f"internal error: {type(exc).__name__}")
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


async def _read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    if timeout_s:
        try:
            return await asyncio.wait_for(_read_body(request, limit), timeout_s)
        except asyncio.TimeoutError:
            raise APIError(408, f"request body not received within {timeout_s:g} s") from None
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise APIError(413, f"request body larger than the {limit}-byte limit")
        except ValueError:
            raise APIError(400, "invalid Content-Length") from None
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body larger than the {limit}-byte limit")
            chunks.append(chunk)
    except ClientDisconnect:  # nobody is left to answer; not a server error worth a traceback
        raise APIError(400, "client disconnected before the request body was complete") from None
    return b"".join(chunks)


def _parse(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise APIError(400, "request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


def _max_tokens(body: dict[str, Any]) -> Any:
    return body.get("max_completion_tokens", body.get("max_tokens"))


class RelayResponse(Response):
    """Streams an upstream SSE response chunk by chunk; a client that leaves cancels the upstream."""

    def __init__(self, opened: Opened, headers: list[tuple[str, str]], on_done: Callable[[str], None]):
        self.status_code = opened.resp.status
        self.background = None
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        self._opened = opened
        self._on_done = on_done

    async def __call__(self, scope, receive, send) -> None:
        opened = self._opened
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def out(chunk: bytes) -> None:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

        async def listen() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return

        pump = asyncio.ensure_future(relay(opened, out))
        watch = asyncio.ensure_future(listen())
        outcome = "ok"
        try:
            done, _ = await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            if pump in done:
                exc = pump.exception()
                if exc is None:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                elif isinstance(exc, OSError) and not isinstance(exc, aiohttp.ClientError):
                    outcome = "disconnect"  # the client's socket went away while we wrote
                else:
                    outcome = "upstream-error"
                    msg = error_body(502, f"upstream stream failed: {type(exc).__name__}")
                    try:
                        await out(b"data: " + msg + b"\n\ndata: [DONE]\n\n")
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                    except OSError:
                        pass
            else:
                outcome = "disconnect"
        finally:
            for t in (pump, watch):
                if not t.done():
                    t.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)
            if outcome == "ok":
                opened.resp.release()
            else:
                opened.resp.close()  # drop the connection: the pod sees the client go and aborts
            self._on_done(outcome)


def create_app(services: Services) -> FastAPI:
    settings = services.settings
    metrics = services.metrics
    gate = Gate(settings, on_limited=lambda kind: metrics.rejections.labels("rate-limit").inc())
    policy = settings.policy

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        reload_settings = getattr(app.state, "reload_settings", None)  # set by kvroute serve
        if reload_settings is not None:
            install_reload(gate, reload_settings, asyncio.get_running_loop())
        await services.start()
        try:
            yield
        finally:
            await services.stop()

    app = KVRouteApp(title="kvroute", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.services = services
    app.state.gate = gate

    def authenticate(request: Request) -> None:
        gate.authenticate(request.headers)

    def router():
        r = services.router
        if r is None:
            raise APIError(503, "router is starting")
        return r

    async def prompt_ids(r, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        """tokenizer remote: the pod-tokenized prompt for plan; otherwise plan tokenizes locally."""
        if services.remote_prompts is None:
            return {}
        got = await services.remote_prompts.prompt_ids(kind, body, r.resolve_model(body))
        return {"tokens": got.tokens, "exact": got.exact}

    # ---- errors --------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return from_exc(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        msg = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on {request.url.path}"}
        return error_response(exc.status_code, msg.get(exc.status_code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response(400, str(exc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}")

    # ---- service endpoints ---------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        return Response(b"", status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        if services.started and services.registry.healthy():
            answer: dict[str, Any] = {"ready": True}
            if gate.open:  # with API keys, readiness tells a probe nothing about the fleet
                answer["healthy_pods"] = len(services.registry.healthy())
            return Response(orjson.dumps(answer), media_type="application/json")
        return error_response(503, "no healthy pod yet")

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        # per-pod load and cache-hit counters would let one tenant watch another's traffic
        if not gate.open and not settings.public_metrics:
            gate.require_admin(gate.authenticate(request.headers), "GET /metrics")
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/internal/prefill-pods")
    async def prefill_pods() -> Response:
        """The prefill pods' host:port the router may name in x-prefiller-host-port (sidecar allowlists)."""
        return Response(orjson.dumps(prefill_targets(p.config for p in services.registry.pods.values())),
                        media_type="application/json")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authenticate(request)
        now = int(time.time())
        data = [{"id": m, "object": "model", "created": now, "owned_by": "kvroute", "root": m, "parent": None}
                for m in services.registry.models()]
        return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")

    async def admitted_body(request: Request, caller: Caller, kind: str | None) -> tuple[bytes, dict[str, Any], str, int]:
        """Admission before any tokenizing: a caller in prompt-token debt is refused before its body
        is read; then the body (size and time bounded), parsed, and a cheap estimate of all its
        prompt tokens charged (``router.costs``). Returns raw, body, kind and what was charged."""
        gate.check_prompt_debt(caller)
        raw = await _read_body(request, settings.max_body_bytes, settings.body_timeout_s)
        body = _parse(raw)
        kind = kind or ("chat" if "messages" in body else "completion")
        charged = gate.precharge(caller, estimate_prompt_tokens(kind, body, router().chars_per_token))
        return raw, body, kind, charged

    # ---- explain -------------------------------------------------------------------------------
    @app.post("/debug/route", openapi_extra=openapi_body("completion"))
    async def debug_route(request: Request) -> Response:
        caller = gate.authenticate(request.headers)
        gate.require_admin(caller, "POST /debug/route")  # it tells what is cached: not for tenants
        gate.admit(request.headers)
        _, body, kind, charged = await admitted_body(request, caller, None)
        r = router()
        plan = r.plan(kind, body, request.headers, dry_run=True, grants=caller.grants,
                      **await prompt_ids(r, kind, body))
        gate.settle(caller, charged, plan.request.prompt_tokens)
        return Response(orjson.dumps(explain(plan, router().block_size, policy)), media_type="application/json")

    # ---- proxy ---------------------------------------------------------------------------------
    async def proxy(request: Request, kind: str, path: str) -> Response:
        rid = _request_id(request)
        raw = None
        try:
            # authenticate -> request bucket -> body size and estimated prompt tokens -> full cost
            caller = gate.admit(request.headers)
            raw, body, _, charged = await admitted_body(request, caller, kind)
            stream = body.get("stream")
            if stream is not None and not isinstance(stream, bool):
                raise APIError(400, "'stream' must be a boolean", param="stream")
            r = router()
            plan = r.plan(kind, body, request.headers, grants=caller.grants, **await prompt_ids(r, kind, body))
            gate.settle(caller, charged, plan.request.prompt_tokens)
            raw = r.pd.sanitize_body(raw, body)
        except APIError as exc:
            metrics.requests.labels("", policy, str(exc.status)).inc()
            extra = {"x-request-id": rid}
            if raw is None:  # refused before its body was read: close rather than read and discard it
                extra["connection"] = "close"
            return from_exc(exc, extra)
        decision = plan.decision
        if not decision.verdict.admitted:
            return reject(plan, rid)
        fwd = upstream_headers(request.headers.raw, rid, drop_authorization=not gate.open)
        last: tuple[str, UpstreamError] | None = None
        opened = booking = None
        for cand in decision.ranked[: 1 + max(settings.retries, 0)]:
            booking = r.book(plan, cand)
            url = plan.pods[cand.pod_id].config.url + path
            opening = asyncio.ensure_future(services.dispatcher.open(url, raw, r.pd.headers_for(plan, cand.pod_id, fwd),
                                                                            on_first_byte=_first(r, booking)))
            watch = asyncio.ensure_future(_until_disconnect(request))
            try:
                await asyncio.wait((opening, watch), return_when=asyncio.FIRST_COMPLETED)
                if not opening.done():
                    # the client left while the pod was still queueing or prefilling its request:
                    # cancelling the open closes that connection, so the pod aborts it too
                    opening.cancel()
                    await asyncio.gather(opening, return_exceptions=True)
                    r.finish(booking)
                    metrics.client_disconnects.inc()
                    metrics.requests.labels(cand.pod_id, policy, "499").inc()
                    return Response(b"", status_code=499)
                opened = opening.result()
                break
            except UpstreamError as exc:
                r.finish(booking)
                if exc.status is None:
                    services.registry.mark(cand.pod_id, False)
                metrics.retries.labels("5xx" if exc.status else "connect").inc()
                last = (cand.pod_id, exc)
                opened = None
            except BaseException:
                opening.cancel()
                r.finish(booking)
                raise
            finally:
                watch.cancel()
        if opened is None:
            pod_id, exc = last  # type: ignore[misc]
            metrics.requests.labels(pod_id, policy, str(exc.status or 502)).inc()
            if exc.status:
                return Response(exc.body, status_code=exc.status,
                                headers={**dict(exc.headers), POD_HEADER: pod_id, "x-request-id": rid})
            return error_response(502, f"pod {pod_id} could not be reached ({exc.cause})",
                                  headers={POD_HEADER: pod_id, "x-request-id": rid})
        assert booking is not None
        return await respond(r, opened, booking, body, rid)

    def reject(plan: Plan, rid: str) -> Response:
        verdict = plan.decision.verdict
        metrics.rejections.labels(verdict.reason).inc()
        if verdict.reason == "kv":
            metrics.requests.labels("", policy, "429").inc()
            return error_response(429, "overloaded: no decode pod has KV cache room for the prompt and the expected "
                                  "output", headers={"retry-after": str(settings.retry_after_s), "x-request-id": rid})
        if verdict.reason == "no-pods":
            metrics.requests.labels("", policy, "503").inc()
            return error_response(503, f"no healthy pod serves model `{plan.model}`", headers={"x-request-id": rid})
        best = plan.decision.best_prediction
        objective = plan.request.objective_s or 0.0
        metrics.requests.labels("", policy, "429").inc()
        return error_response(
            429, f"overloaded: the best predicted time to first token is {best.ttft_s * 1000:.0f} ms, over the "
            f"{objective * 1000:.0f} ms objective",
            headers={"retry-after": str(settings.retry_after_s), "x-request-id": rid})

    async def respond(r, opened: Opened, booking: Booking, body: dict[str, Any], rid: str) -> Response:
        resp = opened.resp
        headers = [(k, v) for k, v in resp.headers.items() if k.lower() not in _RESPONSE_DROP]
        headers += [(POD_HEADER, booking.pod_id), ("x-request-id", rid)]
        r.pd.observe_answer(r, booking, resp.headers)
        pod_id, status = booking.pod_id, str(resp.status)
        if opened.streaming:
            headers += [("cache-control", "no-cache"), ("x-accel-buffering", "no")]

            def done(outcome: str) -> None:
                r.finish(booking)
                if outcome == "disconnect":
                    metrics.client_disconnects.inc()
                metrics.requests.labels(pod_id, policy, status if outcome != "upstream-error" else "502").inc()

            return RelayResponse(opened, headers, done)
        # non-streaming: the whole answer is the first byte; release the booking once the prefill
        # should be over even if decoding goes on, so one long answer does not block the queue view
        handle = asyncio.get_running_loop().call_later(max(booking.predicted_ttft_s, 0.0) * 1.5 + 0.05,
                                                       r.finish, booking)
        try:
            payload = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            resp.close()
            r.finish(booking)
            metrics.requests.labels(pod_id, policy, "502").inc()
            return error_response(502, f"pod {pod_id} failed mid-response ({type(exc).__name__})",
                                  headers={POD_HEADER: pod_id, "x-request-id": rid})
        except BaseException:
            resp.close()
            r.finish(booking)
            raise
        finally:
            handle.cancel()
        resp.release()
        r.first_token(booking, observe=_max_tokens(body) == 1 and not booking.released)
        r.finish(booking)
        metrics.requests.labels(pod_id, policy, status).inc()
        out = Response(payload, status_code=resp.status)
        out.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        out.raw_headers.append((b"content-length", str(len(payload)).encode()))
        return out

    @app.post("/v1/completions", openapi_extra=openapi_body("completion"))
    async def completions(request: Request) -> Response:
        return await proxy(request, "completion", "/v1/completions")

    @app.post("/v1/chat/completions", openapi_extra=openapi_body("chat"))
    async def chat_completions(request: Request) -> Response:
        return await proxy(request, "chat", "/v1/chat/completions")

    app.fast_routes = {"/v1/completions": completions, "/v1/chat/completions": chat_completions}
    return app


_RESPONSE_DROP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date",
                            "x-kvroute-pod", "x-request-id", "trailer", "upgrade", "proxy-authenticate"})


async def _until_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so only a disconnect can come)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _first(r, booking: Booking) -> Callable[[], None]:
    return lambda: r.first_token(booking)


def explain(plan: Plan, block_size: int, policy: str) -> dict[str, Any]:
    """The decision as JSON: per pod what it holds, what is pending, what is predicted, the verdict."""
    d = plan.decision
    chosen = d.chosen.pod_id if d.chosen else None
    order = {c.pod_id: i for i, c in enumerate(d.ranked)}
    pods = []
    for c in sorted(d.ranked, key=lambda c: order[c.pod_id]):
        p = d.predictions[c.pod_id]
        pods.append({
            "pod": c.pod_id, "rank": order[c.pod_id] + 1,
            "verdict": "chosen" if c.pod_id == chosen else ("rejected" if not d.verdict.admitted else "candidate"),
            "cached_tokens": c.cached_tokens, "cached_tokens_by_tier": c.cached_by_tier,
            "effective_cached_tokens": c.effective_cached_tokens, "uncached_tokens": p.uncached_tokens,
            "pending_requests": c.inflight_requests, "pending_prefill_tokens": round(c.queue_tokens, 1),
            "waiting": c.waiting, "running": c.running, "kv_usage": c.kv_usage,
            "prefill_tokens_per_s": round(c.prefill_tokens_per_s, 1),
            "predicted_ttft_ms": round(p.ttft_s * 1000, 3), "queue_ms": round(p.queue_s * 1000, 3),
            "prefill_ms": round(p.prefill_s * 1000, 3), "overhead_ms": round(p.overhead_s * 1000, 3),
        })
    best = d.best_prediction
    return {
        "policy": policy, "model": plan.model, "prompt_tokens": plan.request.prompt_tokens,
        "block_size": block_size, "blocks": len(plan.keys),
        "objective_ms": plan.request.objective_s * 1000 if plan.request.objective_s is not None else None,
        "admitted": d.verdict.admitted, "reason": d.verdict.reason, "chosen": chosen,
        "best_predicted_ttft_ms": round(best.ttft_s * 1000, 3) if best else None,
        "pods": pods,
        **({"pd": explain_pd(plan.pd)} if plan.pd is not None else {}),
    }
