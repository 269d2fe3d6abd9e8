"""The HTTP surface, built by ``create_app(services)``: a thin adapter around the router.

One request's path, top-down: ``proxy`` here (authenticate, rate and cost limits, read and parse
the body) -> ``Router.plan`` (``routing.py``: tokenize, snapshot the fleet, a planner decides) ->
``Lifecycle.serve`` (``lifecycle.py``: book, dispatch with retries, relay, release, metrics).

Proxy routes read the raw body, parse it once with orjson for the few fields routing needs
(model, prompt or messages, stream) and forward the original bytes. There is no
``BaseHTTPMiddleware`` (it wraps every streamed chunk); auth, size limit and request ids are plain
function calls in the handlers. Every failure answers with OpenAI-style error JSON.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from indexer.prefix_tokens import NotCached
from kvcommon.asgi import read_body
from router.auth import Caller, Gate, install_reload
from router.chat_batch import PATH as CHAT_BATCH_PATH
from router.chat_batch import BatchTurn
from router.costs import estimate_input_tokens, estimate_prompt_tokens
from router.disagg import prefill_targets, sanitize_body
from router.dispatch import upstream_headers
from router.errors import APIError, error_response, from_exc
from router.explain import explain
from router.generate import PATH as GENERATE_PATH
from router.generate import GenerateTurn
from router.lifecycle import POD_HEADER, Lifecycle
from router.messages import PATH as MESSAGES_PATH
from router.messages import MessagesTurn
from router.messages import Rendering as MessagesRendering
from router.openapi import openapi_body
from router.passthrough import PATHS as PASSTHROUGH_PATHS
from router.passthrough import POLICY as PASSTHROUGH_POLICY
from router.passthrough import POOLING_PATHS, Passthrough, passthrough_model, pooled_tokens
from router.prompts import LoopLoad, usable_cpus
from router.responses import PATH as RESPONSES_PATH
from router.responses import Turn, stored_query
from router.responses import pod_of as response_pod
from router.routing import Plan, Router, cache_salt
from router.service import Services

__all__ = ["POD_HEADER", "create_app"]



# the routes whose requests are planned as the chat or completion request they amount to (router/responses.py,
# router/messages.py, a batch by its first conversation: router/chat_batch.py, token ids: router/generate.py)
PLANNED_AS_OTHERS = frozenset({"responses", "messages", "chat_batch", "generate"})
# the generation routes /debug/route explains (``?route=``), by the kind of request each takes
EXPLAINED = {"/v1/completions": "completion", "/v1/chat/completions": "chat", CHAT_BATCH_PATH: "chat_batch",
             RESPONSES_PATH: "responses", MESSAGES_PATH: "messages", GENERATE_PATH: "generate"}

_RID_PREFIX = os.urandom(6).hex()
_rid_counter = itertools.count(1)


def header_map(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """A request's headers by (lower-case) name, the first of a repeated one, as Starlette's
    ``Headers.get`` answers: built once per proxied request, so that its few lookups are dict
    lookups rather than scans of the list that raise ``KeyError`` for every header not sent."""
    out: dict[str, str] = {}
    for name, value in raw:
        key = name.decode("latin-1")
        if key not in out:
            out[key] = value.decode("latin-1")
    return out


def _request_id(headers: Mapping[str, str]) -> str:
    """The client's X-Request-Id if it is sane, else a new one (process-random prefix + counter:
    unique, and cheaper than a uuid4 per request)."""
    rid = headers.get("x-request-id")
    if rid and len(rid) <= 200 and rid.isprintable():
        return rid
    return f"{_RID_PREFIX}{next(_rid_counter):010x}"


class KVRouteApp(FastAPI):
    """FastAPI with a fast path: the two proxy routes (and the pass-through routes, POST alike) skip
    the middleware stack, routing table and dependency solver (they need none of them) and are
    called as plain functions; everything else, including the lifespan, goes through FastAPI as usual."""

    fast_routes: dict[str, Callable[[Request], Any]]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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


def freeze_startup_heap(metrics: Any) -> None:
    """Move every object alive once the router has started (modules, settings, the tokenizer's Python
    side, the fleet's state: ~78,000 tracked objects) out of the garbage collector's reach.

    Without it, each full collection walks them all: under 32 connections of small requests one
    process ran one or two in 5 s, each holding the event loop 53-71 ms (every request in flight
    waited that long); with it, the full collections of the same load took 1.5-1.8 ms, a walk over
    the few hundred objects made since (docs/router.md, "Garbage collection"). Objects that die later
    are still freed by reference counting; only start-up garbage in a cycle would be kept, hence the
    collection first."""
    gc.collect()
    gc.freeze()
    metrics.gc_frozen_objects.set(gc.get_freeze_count())


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


def create_app(services: Services) -> FastAPI:
    settings = services.settings
    metrics = services.metrics
    gate = Gate(settings, on_limited=lambda kind: metrics.rejections.labels("rate-limit").inc())
    lifecycle = Lifecycle(settings, services.registry, services.dispatcher, metrics)
    passthrough = Passthrough(settings, services.registry, services.dispatcher, metrics)
    rendering = MessagesRendering()  # the pods' template probes for /v1/messages, made once (router/messages.py)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        reload_settings = getattr(app.state, "reload_settings", None)  # set by kvroute serve
        if reload_settings is not None:
            install_reload(gate, reload_settings, asyncio.get_running_loop())
        await services.start()
        if services.bus is not None:  # the rate-limit buckets' spending, shared with the other processes
            services.bus.on_spent = gate.charge_foreign
            gate.on_spent = services.bus.share_spent
        if getattr(app.state, "freeze_gc", False):  # set by kvroute serve: the process is the router's alone
            freeze_startup_heap(metrics)
        try:
            yield
        finally:
            await services.stop()

    # redirect_slashes off: Starlette answered `/v1/completions/` with a 307 to `http://<the client's Host
    # header>/v1/completions`, a location chosen by a client header (a cache in front would keep it for
    # others) and no OpenAI error; an unknown path, trailing slash or not, is the 404 below
    app = KVRouteApp(title="kvroute", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                     redirect_slashes=False)
    app.state.services = services
    app.state.gate = gate

    def router() -> Router:
        r = services.router
        if r is None:
            raise APIError(503, "router is starting")
        return r

    load = LoopLoad(settings.tokenize_crowded_share, spare_core=usable_cpus() >= 2 * settings.workers)

    async def prompt_ids(r: Router, kind: str, body: dict[str, Any], raw: bytes) -> dict[str, Any]:
        """tokenizer remote: the pod-tokenized prompt for plan. Off the event loop, in the tokenize
        process (router/tokenize_proc.py; a tokenize thread, router/prompts.py TokenizePool, when
        that cannot answer): a body of ``tokenize_crowded_bytes`` or more when the loop is crowded
        (``LoopLoad``, router/prompts.py), and one of ``tokenize_offload_bytes`` or more unless its
        new part is short (``tokenize_inline_chars`` past the prefix token cache: a follow-up turn).
        Otherwise here: plan tokenizes it on the spot.

        On the loop, a follow-up pays no round trip to the tokenize process: on this 2-core VM its
        write, the child's wake-up, the answer's write and the router's wake-up took ~190 µs of an
        8k-token chat follow-up's ~650 µs there (docs/router.md, "Overhead at real prompt sizes").
        On a crowded loop, every request waits for a prompt tokenized there, while the process's
        core could do the work."""
        if services.remote_prompts is None:
            size = len(raw)
            # the process's core, not the threads (they share the loop's GIL), takes a crowded loop's work
            crowded = (size >= settings.tokenize_crowded_bytes and services.tokenize_process is not None
                       and load.crowded())
            if not crowded:
                if size < settings.tokenize_offload_bytes:
                    return {}
                if settings.tokenize_inline_chars and services.prefix_tokens is not None:
                    try:
                        tokens, rest, keys = r.prompt_and_keys(kind, body, settings.tokenize_inline_chars)
                    except NotCached:
                        metrics.tokenize_inline.labels("too-new").inc()
                    else:
                        metrics.tokenize_inline.labels("done").inc()
                        return {"tokens": tokens, "rest": rest, "keys": keys}
            else:
                metrics.tokenize_crowded.inc()
            got = None
            if services.tokenize_process is not None:
                model = r.resolve_model(body)
                got = await services.tokenize_process.run(kind, raw, r.block_size, r.key_seed(model),
                                                          r.target(model)[1], cache_salt(body),
                                                          r.chars_per_token)
            if got is None:
                got = await services.tokenize_pool.run(r.prompt_and_keys, kind, body)
            tokens, rest, keys = got
            return {"tokens": tokens, "rest": rest, "keys": keys}
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
    async def prefill_pods(request: Request) -> Response:
        """The prefill pods' host:port the router may name in x-prefiller-host-port (sidecar allowlists).
        Internal addresses: with API keys only an admin key reads them (the sidecars' --prefill-allowlist-key)."""
        if not gate.open:
            gate.require_admin(gate.authenticate(request.headers), "GET /internal/prefill-pods")
        return Response(orjson.dumps(prefill_targets(p.config for p in services.registry.pods.values())),
                        media_type="application/json")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        caller = gate.admit(request.headers)  # a request like any other: one from the key's request bucket
        allowed = caller.models
        now = int(time.time())
        data = [{"id": m, "object": "model", "created": now, "owned_by": "kvroute", "root": m, "parent": None}
                for m in services.registry.models() if allowed is None or m in allowed]
        # LoRA adapters as vLLM lists them: each with its base model as ``parent``
        data += [{"id": a, "object": "model", "created": now, "owned_by": "kvroute", "root": a, "parent": base}
                 for a, base in services.registry.adapters().items() if allowed is None or a in allowed]
        return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")

    async def admitted_body(request: Request, caller: Caller,
                            kind: str | None) -> tuple[bytes, dict[str, Any], str, int]:
        """Admission before any tokenizing: a caller in prompt-token debt is refused before its body
        is read; then the body (size and time bounded), parsed, and a cheap estimate of all its
        prompt tokens charged (``router.costs``), once the caller's key may use the model it names.
        Returns raw, body, kind and what was charged."""
        gate.check_prompt_debt(caller)
        raw = await read_body(request.scope, request.receive, settings.max_body_bytes, settings.body_timeout_s)
        body = _parse(raw)
        if caller.salt is not None:  # the key's own cache salt, derived: in body now, in the bytes sent at sanitize
            caller.salt.apply(body)
        kind = kind or ("chat" if "messages" in body else "completion")
        if caller.models is not None:  # a key limited to some models and adapters: before any charge
            gate.check_model(caller, router().resolve_model(body))
        charged = gate.precharge(caller, estimate_prompt_tokens(kind, body, router().chars_per_token))
        return raw, body, kind, charged

    async def plan_turn(r: Router, kind: str, raw: bytes, body: dict[str, Any], headers: Mapping[str, str],
                        caller: Caller, dry_run: bool = False) -> tuple[Plan, Callable[[str], bytes], dict]:
        """A request of a route planned as the chat or completion request it amounts to
        (``PLANNED_AS_OTHERS``: a Responses turn, a Messages request, a chat batch by its first
        conversation, a token-in request): its plan, the bytes sent to a pod (a function of the pod:
        a Responses turn carries an id made for it) and the body the lifecycle reads. A client's
        ``kv_transfer_params`` leave the body (not in a dry run, which sends nothing and counts no
        stripping)."""
        stripped = not dry_run and sanitize_body(raw, body, settings.strip_client_kv_transfer_params,
                                                 r.pd_metrics) is not raw
        changed = stripped or caller.salt is not None
        turn: Turn | MessagesTurn | BatchTurn | GenerateTurn = (
            Turn(body, caller.name, lambda: services.registry.pods) if kind == "responses" else
            MessagesTurn(body, rendering.probe(r), raw, changed) if kind == "messages" else
            BatchTurn(body, raw, changed, r.chars_per_token) if kind == "chat_batch" else
            GenerateTurn(body, raw, changed))
        view, planned = turn.view, turn.planned
        if isinstance(turn, (BatchTurn, GenerateTurn)) or turn.keyed:  # the first conversation, the ids: always
            prompt = await prompt_ids(r, planned, view, orjson.dumps(view)) if planned == "chat" else {}
        else:
            prompt = {"tokens": turn.estimate(r.chars_per_token), "exact": False}
        plan = r.plan(planned, view, headers, dry_run=dry_run, grants=caller.grants, only=turn.pods,
                      more=turn.rest, **prompt)
        return plan, turn.sent, view

    # ---- explain -------------------------------------------------------------------------------
    @app.post("/debug/route", openapi_extra=openapi_body("completion"))
    async def debug_route(request: Request) -> Response:
        """The decision for a request without sending it; ``?route=`` the path it is for (a chat
        request if the body has ``messages``, else a completion)."""
        caller = gate.authenticate(request.headers)
        gate.require_admin(caller, "POST /debug/route")  # it tells what is cached: not for tenants
        gate.admit(request.headers)
        route = request.query_params.get("route")
        kind = EXPLAINED.get(route) if route is not None else None
        if route is not None and kind is None:
            raise APIError(400, f"route must be one of {', '.join(EXPLAINED)}", param="route")
        raw, body, kind, charged = await admitted_body(request, caller, kind)
        r = router()
        if kind in PLANNED_AS_OTHERS:
            plan = (await plan_turn(r, kind, raw, body, request.headers, caller, dry_run=True))[0]
        else:
            plan = r.plan(kind, body, request.headers, dry_run=True, grants=caller.grants,
                          **await prompt_ids(r, kind, body, raw))
        gate.settle(caller, charged, plan.request.prompt_tokens)
        answer = explain(plan, r.block_size, lifecycle.policy, settings.ttft_interval_level)
        return Response(orjson.dumps(answer), media_type="application/json")

    # ---- proxy ---------------------------------------------------------------------------------
    async def proxy(request: Request, kind: str, path: str) -> Response:
        """Admit, plan, then hand over to the lifecycle (router/lifecycle.py)."""
        headers = header_map(request.scope["headers"])
        rid = _request_id(headers)
        raw = None
        load.active += 1  # requests being handled now: LoopLoad's first half
        try:
            # authenticate -> request bucket -> body size and estimated prompt tokens -> full cost
            caller = gate.admit(headers)
            raw, body, _, charged = await admitted_body(request, caller, kind)
            stream = body.get("stream")
            if stream is not None and not isinstance(stream, bool):
                raise APIError(400, "'stream' must be a boolean", param="stream")
            r = router()
            # answered before the pod computes it (router/lifecycle.py): a stream's first event still times its token
            background = kind == "responses" and body.get("background") is True and not stream
            if kind in PLANNED_AS_OTHERS:  # planned as the chat or completion request each amounts to
                plan, sent_to, body = await plan_turn(r, kind, raw, body, headers, caller)
                gate.settle(caller, charged, plan.request.prompt_tokens)
                sent: bytes | Callable[[str], bytes] = sent_to
            else:
                prompt = await prompt_ids(r, kind, body, raw)
                plan = r.plan(kind, body, headers, grants=caller.grants, **prompt)
                gate.settle(caller, charged, plan.request.prompt_tokens)
                sent = sanitize_body(raw, body, settings.strip_client_kv_transfer_params, r.pd_metrics)
                # a key with a cache salt: body holds the derived salt (admitted_body), the bytes not yet
                sent = orjson.dumps(body) if caller.salt is not None and sent is raw else sent
        except APIError as exc:
            metrics.requests.labels("", lifecycle.policy, str(exc.status)).inc()
            extra = {"x-request-id": rid}
            if raw is None:  # refused before its body was read: close rather than read and discard it
                extra["connection"] = "close"
            return from_exc(exc, extra)
        else:
            scope = request.scope
            fwd = upstream_headers(scope["headers"], rid, not gate.open, scope.get("client"))
            figures = caller.grants.admin or caller.grants.objective  # see Lifecycle.reject
            return await lifecycle.serve(r, plan, path, sent, fwd, request, body, rid, figures, background)
        finally:
            load.active -= 1

    @app.post("/v1/completions", openapi_extra=openapi_body("completion"))
    async def completions(request: Request) -> Response:
        return await proxy(request, "completion", "/v1/completions")

    @app.post("/v1/chat/completions", openapi_extra=openapi_body("chat"))
    async def chat_completions(request: Request) -> Response:
        return await proxy(request, "chat", "/v1/chat/completions")

    @app.post(RESPONSES_PATH, openapi_extra=openapi_body("responses"))
    async def responses_create(request: Request) -> Response:
        return await proxy(request, "responses", RESPONSES_PATH)

    @app.post(MESSAGES_PATH, include_in_schema=False)  # Anthropic's schema, not OpenAI's: not described here
    async def messages_create(request: Request) -> Response:
        return await proxy(request, "messages", MESSAGES_PATH)

    @app.post(CHAT_BATCH_PATH, openapi_extra=openapi_body("chat_batch"))
    async def chat_batch(request: Request) -> Response:
        return await proxy(request, "chat_batch", CHAT_BATCH_PATH)

    @app.post(GENERATE_PATH, openapi_extra=openapi_body("generate"))
    async def generate(request: Request) -> Response:
        return await proxy(request, "generate", GENERATE_PATH)

    app.fast_routes = {"/v1/completions": completions, "/v1/chat/completions": chat_completions,
                       RESPONSES_PATH: responses_create, MESSAGES_PATH: messages_create, CHAT_BATCH_PATH: chat_batch,
                       GENERATE_PATH: generate}

    # ---- vLLM's other routes (router/passthrough.py) ----------------------------------------------
    async def pass_through(request: Request, path: str) -> Response:
        """The generation routes' front door (API key, the key's models, its request bucket, body
        size and JSON; no prompt-token charge), then the least loaded pod of the body's model.
        ``path`` is the route's own (``PASSTHROUGH_PATHS``), never the client's raw target."""
        headers = header_map(request.scope["headers"])
        rid = _request_id(headers)
        raw = None
        try:
            caller = gate.admit(headers)
            pooling = path in POOLING_PATHS
            if pooling:  # a caller in prompt-token debt is refused before its body is read
                gate.check_prompt_debt(caller)
            raw = await read_body(request.scope, request.receive, settings.max_body_bytes, settings.body_timeout_s)
            body = _parse(raw)
            r = router()
            model = passthrough_model(r, body)
            gate.check_model(caller, model)
            charged = 0
            if pooling:  # the model runs over its input: charged as prompt tokens, at an estimate
                charged = gate.precharge(caller, estimate_input_tokens(body, r.chars_per_token))
            if caller.salt is not None and pooling:  # vLLM's pooling requests take a cache_salt too (the prefix cache)
                caller.salt.apply(body)
                raw = orjson.dumps(body)
        except APIError as exc:
            metrics.requests.labels("", PASSTHROUGH_POLICY, str(exc.status)).inc()
            extra = {"x-request-id": rid}
            if raw is None:  # refused before its body was read: close rather than read and discard it
                extra["connection"] = "close"
            return from_exc(exc, extra)
        scope = request.scope
        fwd = upstream_headers(scope["headers"], rid, not gate.open, scope.get("client"))
        settle = None
        if pooling and caller.prompt_tokens is not None:
            def settle(answer: bytes) -> None:  # the estimate, settled to what the pod says it ran
                ran = pooled_tokens(answer)
                if ran is not None:
                    gate.settle(caller, charged, ran)
        return await passthrough.serve(r, path, model, raw, fwd, request, rid, on_answer=settle)

    def passthrough_route(path: str) -> Callable[[Request], Any]:
        async def handler(request: Request) -> Response:
            return await pass_through(request, path)
        return handler

    # ---- a stored response (router/responses.py): on the pod its id names, for its own API key ----------
    async def stored_response(request: Request, response_id: str, action: str) -> Response:
        """``GET /v1/responses/{id}`` (``action`` "") or ``POST /v1/responses/{id}/cancel``
        ("/cancel"), sent to the pod that stores the response, as a pass-through request. The path
        sent is built from the id the router checked and the query values vLLM reads (``stream``,
        ``starting_after``), each checked: nothing else of the client's target reaches the pod."""
        headers = header_map(request.scope["headers"])
        rid = _request_id(headers)
        try:
            caller = gate.admit(headers)
            router()
            pod_id = response_pod(response_id, caller.name, services.registry.pods)
            path = f"{RESPONSES_PATH}/{response_id}{action}"
            if not action:
                path += stored_query(request.query_params)
            pod = services.registry.pods[pod_id]
            if not (pod.healthy and pod.ready):
                raise APIError(503, f"pod {pod_id}, which stores response {response_id}, is not ready")
        except APIError as exc:
            metrics.requests.labels("", PASSTHROUGH_POLICY, str(exc.status)).inc()
            return from_exc(exc, {"x-request-id": rid})
        scope = request.scope
        fwd = upstream_headers(scope["headers"], rid, not gate.open, scope.get("client"))
        fwd.pop("content-type", None)
        return await passthrough.serve(router(), path, pod.config.model, b"", fwd, request, rid, pods=[pod],
                                       method="GET" if not action else "POST")

    @app.get(RESPONSES_PATH + "/{response_id}", include_in_schema=False)
    async def responses_retrieve(request: Request, response_id: str) -> Response:
        return await stored_response(request, response_id, "")

    @app.post(RESPONSES_PATH + "/{response_id}/cancel", include_in_schema=False)
    async def responses_cancel(request: Request, response_id: str) -> Response:
        return await stored_response(request, response_id, "/cancel")

    for path in PASSTHROUGH_PATHS:
        handler = passthrough_route(path)
        # in the routing table for a GET's 405; out of the OpenAPI schema (vLLM's own describes the bodies)
        app.add_api_route(path, handler, methods=["POST"], include_in_schema=False)
        app.fast_routes[path] = handler
    return app
