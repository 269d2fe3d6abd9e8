"""One admitted request's life: book -> dispatch (with retries) -> first token -> finish.

``api.py`` authenticates, reads and parses the body and asks ``Router.plan`` for a decision; then
``Lifecycle.serve`` carries it out:

1. a rejected plan answers 429/503 at once (nothing is booked);
2. for each pod in the plan's ranking (the first, then up to ``retries`` more, skipping pods that
   left the fleet or went unhealthy since the ranking was made): ``Router.book``
   holds the route in the ledger and the request is sent (``Dispatcher.open``); a connection
   failure or a 5xx before the first byte ends that attempt and the next pod is tried; a client
   that leaves meanwhile ends the request (499, and the pod's connection is dropped so it aborts);
3. the answer is relayed: a stream chunk by chunk (the first chunk is the first token), a
   non-streaming answer whole.

An attempt the pod did not take (a non-2xx answer, a 5xx, a connection that failed) releases its
booking and withdraws the prompt blocks its booking credited to the index at once (``_unserved``).
Every attempt ends in exactly one ``Outcome``, and ``_end`` is the one place that releases its
booking and records its metrics (``Booking.release`` is idempotent besides, because the first
token releases a booking before the request has ended).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvcommon.asgi import unless_disconnected
from kvcommon.listener import chunk_writer, write_whole
from kvcommon.sse import error_event
from router.booking import Booking
from router.config import RouterSettings
from router.disagg import prefill_header
from router.dispatch import Dispatcher, Opened, UpstreamError, relay, response_headers
from router.errors import error_response
from router.messages import PATH as MESSAGES_PATH
from router.messages import STREAM_PREAMBLE as MESSAGES_PREAMBLE
from router.metrics import RouterMetrics
from router.pods import PodRegistry
from router.responses import PATH as RESPONSES_PATH
from router.responses import STREAM_PREAMBLE as RESPONSES_PREAMBLE
from router.routing import Plan, Router
from router.scheduling.decide import Route
from router.upstream import PodIOError

POD_HEADER = "x-kvroute-pod"
# a stream's events before its first token, by route (router/dispatch.py ``first_event_begins``)
PREAMBLES = {RESPONSES_PATH: RESPONSES_PREAMBLE, MESSAGES_PATH: MESSAGES_PREAMBLE}
POD_HEADER_BYTES = POD_HEADER.encode()
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended: the pod, the status the client saw ("" for a retried attempt), and
    whether the client left."""

    pod_id: str
    status: str
    disconnect: bool = False


class Lifecycle:
    def __init__(self, settings: RouterSettings, registry: PodRegistry, dispatcher: Dispatcher,
                 metrics: RouterMetrics):
        self.settings = settings
        self.registry = registry
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.policy = settings.policy if settings.scorers is None else "custom"
        # kvroute_requests_total's children, by (pod, status): the metrics' own cache, which drops a
        # departed pod's (RouterMetrics.forget_pod)
        self._answered: dict[tuple[str, str], Any] = metrics.request_children

    def _end(self, router: Router, booking: Booking | None, outcome: Outcome) -> None:
        """The end of an attempt: release its booking (if the first token has not) and count it."""
        if booking is not None:
            router.ended(booking)
        if outcome.disconnect:
            self.metrics.client_disconnects.inc()
        if outcome.status:
            key = (outcome.pod_id, outcome.status)
            child = self._answered.get(key)
            if child is None:  # labels() builds a key and takes a lock per call: once per pod and status
                child = self._answered[key] = self.metrics.requests.labels(outcome.pod_id, self.policy,
                                                                          outcome.status)
            child.inc()

    async def serve(self, router: Router, plan: Plan, path: str, raw: bytes | Callable[[str], bytes],
                    headers: dict[str, str], request: Request, body: Mapping[str, Any], rid: str,
                    figures: bool = True, background: bool = False) -> Response:
        """Carry out ``plan``: send ``raw`` (the same bytes to every pod tried, or ``raw(pod_id)``'s:
        a Responses request carries an id made for its pod) to ``path`` on the chosen pod
        (``headers`` already filtered for upstream) and answer the client (a rejection with its
        figures or without: ``reject``). ``background``: a background Responses request, which the
        pod answers before it computes anything (``_respond``)."""
        if not plan.decision.verdict.admitted:
            return self.reject(router, plan, rid, figures)
        failure: tuple[str, UpstreamError] | None = None
        tries = 1 + max(self.settings.retries, 0)
        for cand in plan.decision.ranked:
            if failure is not None and not self._still_candidate(cand.pod_id):
                continue  # the ranking was made before the first try: a pod that left or went down since is skipped
            if tries == 0:
                break
            tries -= 1
            route = plan.decision.routes[cand.pod_id]
            booking = router.book(plan, cand)
            try:
                opened = await self._open(router, booking, plan.url(cand.pod_id, path),
                                          raw if isinstance(raw, bytes) else raw(cand.pod_id),
                                          {**headers, **prefill_header(route, plan.pods)}, request,
                                          PREAMBLES.get(path, ()))
            except UpstreamError as failed:
                self._unserved(router, plan, route, booking)
                self._end(router, booking, Outcome(cand.pod_id, ""))
                if failed.pod_down:
                    self.registry.mark(cand.pod_id, False)
                self.metrics.retries.labels(retry_cause(failed)).inc()
                failure = (cand.pod_id, failed)
                continue
            except BaseException:
                self._end(router, booking, Outcome(cand.pod_id, ""))
                raise
            if opened is None:  # the client left while the pod was still queueing or prefilling
                self._end(router, booking, Outcome(cand.pod_id, "499", disconnect=True))
                return Response(b"", status_code=499)
            if opened.resp.status >= 300:  # refused (a 4xx; a 5xx raised above): nothing was computed
                self._unserved(router, plan, route, booking)
            return await self._respond(router, opened, booking, body, rid, request, background, path)
        assert failure is not None
        pod_id, exc = failure
        self._end(router, None, Outcome(pod_id, str(exc.status or 502)))
        return failed_answer(pod_id, exc, rid)

    @staticmethod
    def _unserved(router: Router, plan: Plan, route: Route, booking: Booking) -> None:
        """The pod did not take the request: it refused it (a non-2xx answer: vLLM checks a request
        before its engine sees it, so a 400 computed and cached nothing), failed it (a 5xx) or could
        not be reached. Its booking is released now, without learning a TTFT from the answer and
        without counting it among the requests whose blocks the pod must announce (the event
        watchdog's ``event_sources``), and the prompt blocks ``Router.book`` credited to the pods
        that were to store them are withdrawn from the index: left, they drew the prompt's
        follow-ups and siblings to a pod that holds none of it, for ``speculative_ttl_s`` (2 s) on a
        pod with KV events and ``approximate_ttl_s`` (120 s) on one without. Only what this request
        credited goes: the blocks after those the index gave the pod when it was routed; what the
        pod's events have stored since is not a credit and stays (``PrefixIndex.withdraw``). A
        prompt credited in pieces (``Router.speculate``) may have pieces still to come: the pod's
        credits under way are put in whole first (``Router.withdraw``). Never on a 2xx: one
        comparison of the status there."""
        booking.new_blocks = 0
        router.finish(booking)
        keys = plan.keys
        if not keys:
            return
        held = (route.prefill_pod,) if route.pod_id == route.prefill_pod else (route.prefill_pod, route.pod_id)
        bs, snapshot = router.block_size, plan.snapshot
        try:
            for pod_id in held:   # what the index gave the pod when it was routed was not this credit
                router.withdraw(pod_id, keys[snapshot.candidate(pod_id).cached_tokens // bs:])
        except Exception:  # the index is advisory; never fail a request over it
            log.exception("withdrawing the credit of a request the pod did not take failed")

    def _still_candidate(self, pod_id: str) -> bool:
        pod = self.registry.pods.get(pod_id)
        return pod is not None and pod.healthy and pod.ready

    async def _open(self, router: Router, booking: Booking, url: str, raw: bytes, headers: dict[str, str],
                    request: Request, preamble: tuple[bytes, ...] = ()) -> Opened | None:
        """Send the request; None if the client went away before the pod answered (cancelling the
        open closes that connection, so the pod aborts the request too). ``preamble``: a stream's
        events that come before its first token (``Dispatcher.open``)."""
        return await unless_disconnected(request.scope, request.receive, self.dispatcher.open(
            url, raw, headers, on_first_byte=lambda: router.first_token(booking), preamble=preamble))

    def reject(self, router: Router, plan: Plan, rid: str, figures: bool = True) -> Response:
        """The 429 (or 503) for a request the decision did not admit. ``figures``: the best predicted
        TTFT and the objective are in the message. Not for a tenant's key (one without the admin or
        the objective grant): the prediction falls by what the pods hold of the prompt, so with a
        tightened objective a tenant could read off, without a request reaching any pod, whether
        another tenant's prompt is cached, which /debug/route, admin-only, would otherwise tell."""
        verdict = plan.decision.verdict
        self.metrics.rejections.labels(verdict.reason).inc()
        retry = {"retry-after": str(self.settings.retry_after_s), "x-request-id": rid}
        if verdict.reason == "no-pods":
            self._end(router, None, Outcome("", "503"))
            return error_response(503, f"no healthy pod serves model `{plan.model}`", headers={"x-request-id": rid})
        self._end(router, None, Outcome("", "429"))
        if verdict.reason == "kv":
            return error_response(429, "overloaded: no decode pod has KV cache room for the prompt and the "
                                  "expected output", headers=retry)
        if not figures:
            return error_response(429, "overloaded: no pod is predicted to meet the time-to-first-token "
                                  "objective", headers=retry)
        best = plan.decision.best_prediction
        objective = plan.request.objective_s or 0.0
        best_ms = best.ttft_s * 1000 if best else 0.0
        return error_response(429, f"overloaded: the best predicted time to first token is {best_ms:.0f} ms, over "
                              f"the {objective * 1000:.0f} ms objective", headers=retry)

    async def _respond(self, router: Router, opened: Opened, booking: Booking, body: Mapping[str, Any],
                       rid: str, request: Request, background: bool = False, path: str = "") -> Response:
        resp = opened.resp
        headers = response_headers(resp) + ours(booking.pod_id, rid)
        router.observe_answer(booking, resp.headers)
        pod_id, status = booking.pod_id, str(resp.status)
        if opened.streaming:
            headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]

            def done(how: str) -> None:
                self._end(router, booking, Outcome(pod_id, "502" if how == "upstream-error" else status,
                                                   disconnect=how == "disconnect"))

            return RelayResponse(opened, headers, done, path)
        # non-streaming: the whole answer is the first byte; release the booking once the prefill
        # should be over even if decoding goes on, so one long answer does not block the queue view
        loop = asyncio.get_running_loop()
        handle = loop.call_later(max(booking.predicted_ttft_s, 0.0) * 1.5 + 0.05, router.finish, booking)
        try:
            # watched as the open is: a pod that sends its head and then trickles (or stalls) the body
            # must not keep the pod's request alive once the client has gone. An answer already whole
            # (vLLM's head and body come in one write) is read without the watch: nothing to wait for
            payload = await (resp.read() if resp.complete else
                             unless_disconnected(request.scope, request.receive, resp.read()))
        except PodIOError as exc:
            resp.close()
            self._end(router, booking, Outcome(pod_id, "502"))
            return error_response(502, f"pod {pod_id} failed mid-response ({type(exc).__name__})",
                                  headers={POD_HEADER: pod_id, "x-request-id": rid})
        except BaseException:
            resp.close()
            self._end(router, booking, Outcome(pod_id, ""))
            raise
        finally:
            handle.cancel()
        if payload is None:  # the client left mid-answer: closing the connection tells the pod
            resp.close()
            self._end(router, booking, Outcome(pod_id, "499", disconnect=True))
            return Response(b"", status_code=499)
        resp.release()
        if background and resp.status == 200:
            # vLLM answers a background response at once ("queued", ~20 ms for a 3,300-token prompt
            # whose prefill took ~0.5 s on the tiny CPU model) and computes it afterwards: the booking
            # stands until the prefill should be over, as a whole answer's would at the latest, and
            # no TTFT is learnt from the answer
            loop.call_at(handle.when(), router.ended, booking)
            self._end(router, None, Outcome(pod_id, status))
            return _answer(payload, resp.status, headers)
        # a one-token answer's duration is its time to first token: learn from it
        router.first_token(booking, observe=_max_tokens(body) == 1 and not booking.released)
        self._end(router, booking, Outcome(pod_id, status))
        return _answer(payload, resp.status, headers)


def retry_cause(failed: UpstreamError) -> str:
    """``kvroute_retries_total``'s cause for a try that failed before the pod's answer."""
    return "5xx" if failed.status else "connect" if failed.pod_down else "busy"


def failed_answer(pod_id: str, exc: UpstreamError, rid: str) -> Response:
    """The answer when the last pod tried failed before answering: its own 5xx, passed through with
    its body, or a 502 that says what failed and not the detail (a connect error names the pod's
    address)."""
    if exc.status:
        return _answer(exc.body, exc.status, exc.headers + ours(pod_id, rid))
    log.info("request %s: pod %s could not be reached (%s)", rid, pod_id, exc.cause)
    return error_response(502, f"pod {pod_id} could not be reached ({exc.kind})",
                          headers={POD_HEADER: pod_id, "x-request-id": rid})


def ours(pod_id: str, rid: str) -> list[tuple[bytes, bytes]]:
    """The headers the router adds to a pod's answer: which pod, and the request id."""
    return [(POD_HEADER_BYTES, pod_id.encode("latin-1")), (b"x-request-id", rid.encode("latin-1"))]


def _answer(payload: bytes, status: int, headers: list[tuple[bytes, bytes]]) -> Response:
    """A whole answer with ``headers`` (ASGI's lower-case bytes pairs) as they are, plus its length."""
    return WholeAnswer(payload, status, headers)


class WholeAnswer(Response):
    """A pod's whole (non-streaming) answer, relayed: under kvroute's listener in one write, head and
    body together (``kvcommon.listener.write_whole``), elsewhere as the two ASGI messages.
    ``headers`` come from ``response_headers`` and ``ours``: no Content-Length or Connection."""

    def __init__(self, payload: bytes, status: int, headers: list[tuple[bytes, bytes]]):
        self.body = self._payload = payload
        self.status_code = status
        self.background = None
        self._head = headers  # write_whole adds the length itself
        self.raw_headers = headers + [(b"content-length", b"%d" % len(payload))]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if write_whole(scope, self.status_code, self._head, self._payload):
            return
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self._payload})


def _max_tokens(body: Mapping[str, Any]) -> Any:
    return body.get("max_completion_tokens", body.get("max_tokens"))


class RelayResponse(Response):
    """Streams an upstream SSE response chunk by chunk; a client that leaves cancels the upstream.
    ``on_done`` is called once with how it ended: "ok", "disconnect" or "upstream-error". A stream
    that breaks ends with an error event in the shape the clients of the pod's route ``path`` read
    (``kvcommon.sse.error_event``)."""

    def __init__(self, opened: Opened, headers: list[tuple[bytes, bytes]], on_done: Callable[[str], None],
                 path: str = ""):
        self.status_code = opened.resp.status
        self.background = None
        self.raw_headers = headers
        self._opened = opened
        self._on_done = on_done
        self._path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        opened = self._opened
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        writer = chunk_writer(scope)  # under kvroute's listener: chunks go out without a task step each

        async def out(chunk: bytes) -> None:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

        async def pump() -> bool:
            await relay(opened, out, writer)
            return True

        how = "disconnect"  # until the relay ends one way or the other
        try:
            if await unless_disconnected(scope, receive, pump()):
                how = "ok"
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception as exc:
            if isinstance(exc, OSError) and not isinstance(exc, PodIOError):
                how = "disconnect"  # the client's socket went away while we wrote (the last write too)
                return
            how = "upstream-error"
            try:
                await out(error_event(self._path, 502, f"upstream stream failed: {type(exc).__name__}"))
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                pass
        finally:
            if how == "ok":
                opened.resp.release()
            else:
                opened.resp.close()  # drop the connection: the pod sees the client go and aborts
            self._on_done(how)
