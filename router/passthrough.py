"""vLLM's other request routes, passed through to a pod of the body's model (docs/router.md, "Other
vLLM routes").

``POST /tokenize``, ``/detokenize``, ``/v1/embeddings``, ``/pooling``, ``/classify``, ``/score``,
``/v1/score``, ``/rerank``, ``/v1/rerank``, ``/v2/rerank``, ``/v2/embed``, ``/v1/messages/count_tokens`` and the
render routes ``/v1/chat/completions/render``, ``/v1/completions/render``, ``/v1/messages/render``
(``PATHS``: each one a route of vLLM 0.32's server whose body names its model in ``model``, which
vLLM lets a client leave out, but for count_tokens, which requires it) go
through the same front door as the generation routes in ``router/api.py`` (API key, the key's
models, its request bucket, body size and JSON) and then here: no tokenizing, no prefix lookup, no
TTFT prediction and no booking. The pod is the least loaded healthy, ready pod that serves the
model (``Passthrough.ranked``); a connection failure or a 5xx before the answer is tried once more
on the next (``retries``), as ``Lifecycle.serve`` does; the answer is relayed whole, status and
body as the pod sent them (``WholeAnswer``).

The path sent to the pod is the route's own, from ``PATHS``, never the client's raw target, and
the pod's address comes from the fleet alone: nothing the client sends picks a host.

The pooling routes (``POOLING_PATHS``) run the model over their input, so they spend the key's
prompt-token bucket: an estimate before the request is sent (router/api.py), settled to what the
pod's answer says it ran (``pooled_tokens``), as a generation request's estimate is settled to its
tokenized length.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kvcommon.asgi import unless_disconnected
from router.config import RouterSettings
from router.disagg import RANK_HEADER
from router.dispatch import Dispatcher, Opened, UpstreamError, response_headers
from router.errors import APIError, error_response
from router.lifecycle import POD_HEADER, RelayResponse, WholeAnswer, failed_answer, ours, retry_cause
from router.metrics import RouterMetrics
from router.pods import PodRegistry, PodState
from router.routing import Router
from router.upstream import PodIOError

log = logging.getLogger(__name__)

# vLLM 0.32's routes passed through (vllm/entrypoints/serve/tokenize/api_router.py,
# vllm/entrypoints/pooling/*/api_router.py and vllm/entrypoints/anthropic/api_router.py); every body
# names its model in ``model`` (optional there but for count_tokens)
PATHS = ("/tokenize", "/detokenize", "/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score",
         "/rerank", "/v1/rerank", "/v2/rerank", "/v2/embed", "/v1/messages/count_tokens",
         # vLLM's render routes: a request rendered into the token-in body of /inference/v1/generate
         # (router/generate.py). Not /v1/responses/render: it reads a stored response, which lives on one
         # pod and belongs to one API key (router/responses.py)
         "/v1/chat/completions/render", "/v1/completions/render", "/v1/messages/render")
# the routes that run the model over their input (vLLM's pooling routes): charged to the prompt-token
# bucket at an estimate, and given a key's cache salt (their requests read the prefix cache)
POOLING_PATHS = frozenset(("/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
                           "/v2/rerank", "/v2/embed"))
# a pooling answer's count of what the model ran over (``pooled_tokens``): vLLM's ``usage`` object
# (UsageInfo and RerankUsage, ``prompt_tokens`` their first field), and the Cohere embed route's
# ``meta.billed_units`` (input and image tokens). ``[^{}]`` keeps each match inside its own object
_USAGE = re.compile(rb'"usage"\s*:\s*\{[^{}]*?"prompt_tokens"\s*:\s*(\d+)')
_BILLED = re.compile(rb'"billed_units"\s*:\s*\{([^{}]*)\}')
_BILLED_FIELD = re.compile(rb'"(?:input|image)_tokens"\s*:\s*(\d+)')
# kvroute_requests_total's ``policy`` label on these routes' answers: one fixed value, never the path
POLICY = "passthrough"


def pooled_tokens(payload: bytes) -> int | None:
    """The prompt tokens a pooling answer says the model ran over, or None when it says nothing the
    router reads: ``usage.prompt_tokens`` (vLLM's embeddings, pooling, classify, score and rerank
    answers) or the sum of ``meta.billed_units``' input and image tokens (``/v2/embed``). Read off
    the raw bytes, not parsed: an embeddings answer can be megabytes of floats. The last ``"usage"``
    key is vLLM's own: a client's text echoed in an answer (a rerank document) is a JSON string,
    whose quotes are escaped, so no text of it can match the pattern's quoted key."""
    for key, pattern in ((b'"usage"', _USAGE), (b'"billed_units"', _BILLED)):
        at = len(payload)
        while (at := payload.rfind(key, 0, at)) >= 0:  # from the end: vLLM writes usage last but on rerank
            found = pattern.match(payload, at)
            if found is not None:
                if pattern is _USAGE:
                    return int(found.group(1))
                return sum(int(n) for n in _BILLED_FIELD.findall(found.group(1)))
    return None


def passthrough_model(router: Router, body: Mapping[str, Any]) -> str:
    """The model (a base model or a LoRA adapter) a pass-through body names, as the generation routes
    resolve it (``Router.resolve_model``: 400 for a non-string, 404 for a model no pod serves). A body
    without ``model`` takes the fleet's base model when it serves exactly one, as vLLM's own server
    takes its one model; with several it is a 400."""
    if body.get("model") is None:
        models = router.registry.models()
        if len(models) != 1:
            if not models:
                raise APIError(503, "no pods are configured")
            raise APIError(400, "`model` is required: this router serves several models", param="model")
        return models[0]
    return router.resolve_model(body)


class Passthrough:
    """Sends a pass-through request to a pod and relays its answer; counts what each pod has in
    flight of them (``inflight``), which its choice of pod reads."""

    def __init__(self, settings: RouterSettings, registry: PodRegistry, dispatcher: Dispatcher,
                 metrics: RouterMetrics):
        self.settings = settings
        self.registry = registry
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.inflight: dict[str, int] = {}
        self._turns = itertools.count()

    def count(self, pod_id: str, status: int | str) -> None:
        """One answer in ``kvroute_requests_total{pod, policy="passthrough", status}`` (pod "" when
        none was chosen)."""
        self.metrics.requests.labels(pod_id, POLICY, str(status)).inc()

    def ranked(self, router: Router, model: str) -> list[PodState]:
        """The healthy, ready pods that serve ``model`` (the adapter's pods for an adapter), least
        loaded first: by what waits there (the pod's scraped ``waiting``, the generation requests
        the routers have booked there and not yet seen start, and the pass-through requests this
        process has in flight there), then by its scraped ``running``. Pods of role ``both`` when
        any is up, as the aggregated planner takes them; equals in turn (round robin), so that an
        idle fleet shares the work."""
        pods = self.registry.serving(*router.target(model))
        both = [p for p in pods if p.config.role == "both"]
        pods = both or pods
        if len(pods) > 1:
            k = next(self._turns) % len(pods)
            pods = pods[k:] + pods[:k]
            ledger, inflight = router.ledger, self.inflight
            pods.sort(key=lambda p: (p.waiting + ledger.inflight(p.id) + inflight.get(p.id, 0), p.running))
        return pods

    async def serve(self, router: Router, path: str, model: str, raw: bytes, headers: dict[str, str],
                    request: Request, rid: str, pods: list[PodState] | None = None,
                    method: str = "POST", on_answer: Callable[[bytes], None] | None = None) -> Response:
        """Send ``raw`` to ``path`` on the best pod for ``model`` (``headers`` already filtered for
        upstream), the next one after a failure before the answer, and relay the answer. ``pods``:
        the pods to try, in order, instead (a stored response's one pod: router/responses.py),
        ``method`` the request's (a GET's ``raw`` is empty), and ``on_answer`` called with a 200
        answer's whole body (a pooling request's charge settled: router/api.py)."""
        if pods is None:
            pods = self.ranked(router, model)
        if not pods:
            self.count("", 503)
            return error_response(503, f"no healthy pod serves model `{model}`", headers={"x-request-id": rid})
        failure: tuple[str, UpstreamError] | None = None
        tries = 1 + max(self.settings.retries, 0)
        for pod in pods:
            if failure is not None and not (pod.id in self.registry.pods and pod.healthy and pod.ready):
                continue  # went down or left since the ranking was made
            if tries == 0:
                break
            tries -= 1
            sent = headers if pod.config.dp_rank is None else {**headers, RANK_HEADER: str(pod.config.dp_rank)}
            self.inflight[pod.id] = self.inflight.get(pod.id, 0) + 1
            try:
                try:
                    opened = await unless_disconnected(request.scope, request.receive,
                                                       self.dispatcher.open(pod.config.url + path, raw, sent,
                                                                            method=method))
                except UpstreamError as failed:
                    if failed.pod_down:
                        self.registry.mark(pod.id, False)
                    self.metrics.retries.labels(retry_cause(failed)).inc()
                    failure = (pod.id, failed)
                    continue
                if opened is None:  # the client left while the pod worked: the open was cancelled
                    return self._left(pod.id)
                return await self._respond(pod.id, opened, request, rid, on_answer)
            finally:
                left = self.inflight.get(pod.id, 1) - 1
                if left > 0:
                    self.inflight[pod.id] = left
                else:
                    self.inflight.pop(pod.id, None)
        assert failure is not None
        pod_id, exc = failure
        self.count(pod_id, exc.status or 502)
        return failed_answer(pod_id, exc, rid)

    def _left(self, pod_id: str) -> Response:
        self.metrics.client_disconnects.inc()
        self.count(pod_id, 499)
        return Response(b"", status_code=499)

    async def _respond(self, pod_id: str, opened: Opened, request: Request, rid: str,
                       on_answer: Callable[[bytes], None] | None = None) -> Response:
        """The pod's answer, read whole (watched for the client leaving, as the generation path reads
        a non-streaming answer) and relayed with its status and headers; a stream (a stored
        response's events) relayed as the generation path relays one."""
        resp = opened.resp
        if opened.streaming:
            status = resp.status
            headers = response_headers(resp) + ours(pod_id, rid) + [(b"cache-control", b"no-cache"),
                                                                     (b"x-accel-buffering", b"no")]
            return RelayResponse(opened, headers, lambda how: self.count(
                pod_id, 502 if how == "upstream-error" else 499 if how == "disconnect" else status))
        try:
            payload = await (resp.read() if resp.complete else
                             unless_disconnected(request.scope, request.receive, resp.read()))
        except PodIOError as exc:
            resp.close()
            self.count(pod_id, 502)
            return error_response(502, f"pod {pod_id} failed mid-response ({type(exc).__name__})",
                                  headers={POD_HEADER: pod_id, "x-request-id": rid})
        except BaseException:
            resp.close()
            raise
        if payload is None:  # the client left mid-answer: closing the connection tells the pod
            resp.close()
            return self._left(pod_id)
        headers = response_headers(resp) + ours(pod_id, rid)
        resp.release()
        self.count(pod_id, resp.status)
        whole = opened.first_chunk + payload
        if on_answer is not None and resp.status == 200:
            try:
                on_answer(whole)
            except Exception:  # settling a charge must never cost the client its answer
                log.exception("settling a pass-through answer's charge failed")
        return WholeAnswer(whole, resp.status, headers)
