"""The Responses API through the router (router/responses.py, indexer/responses.py).

The unit tests check the response ids (which pod, which API key), the query a retrieval sends, the
chat body a Responses request renders as, and where a Responses stream's first token begins. The
others run the router in this process in front of recording loopback pods that answer
``/v1/responses`` and its stored-response routes, and look at what reached which pod.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import orjson
import pytest
from aiohttp import web

from indexer.responses import Unrenderable, chat_body
from indexer.tokens import ChatTemplateError
from router.dispatch import first_event_begins
from router.errors import APIError
from router.responses import ID_CHARS, STREAM_PREAMBLE, caller_tag, mint, pod_of, pod_tag, stored_query
from tests.helpers import free_port
from tests.test_router_api import Pod, running_router, settings_for, started
from tests.test_stream_review import ttft_observations

# ---------------------------------------------------------------------------------------------
# ids, queries, rendering, the first token (no sockets)
# ---------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_an_id_names_its_pod_and_its_caller_and_nothing_else_reads_it():
    pods = ["pod-0", "pod-1", "pod-2"]
    made = mint("pod-1", "tenant-a")
    assert made.startswith("resp_") and len(made) == ID_CHARS and made != mint("pod-1", "tenant-a")
    assert made[5:17] == pod_tag("pod-1") and made[17:29] == caller_tag("tenant-a")
    assert pod_of(made, "tenant-a", pods) == "pod-1"
    refused = [(made, "tenant-b", pods),                      # another API key's response
               (made, "tenant-a", ["pod-0", "pod-2"]),        # its pod left the fleet (and its store with it)
               ("resp_aa9e9cdf795d0e37", "tenant-a", pods),    # vLLM's own id: not one the router made
               (made.upper(), "tenant-a", pods), (made + "0", "tenant-a", pods), ("", "tenant-a", pods),
               (made[:-1] + "/", "tenant-a", pods), ("x" * 10_000, "tenant-a", pods)]
    for response_id, caller, fleet in refused:
        with pytest.raises(APIError) as err:
            pod_of(response_id, caller, fleet)
        assert err.value.status == 404 and err.value.param == "response_id"
        assert len(err.value.message) < 300   # a long id is not echoed whole
    with pytest.raises(APIError) as err:
        pod_of(17, "tenant-a", pods)
    assert err.value.status == 400


@pytest.mark.unit
def test_a_retrieval_sends_vllms_two_query_values_checked_and_nothing_else():
    assert stored_query({}) == ""
    assert stored_query({"stream": "True", "starting_after": "007", "x": "1"}) == "?stream=true&starting_after=7"
    assert stored_query({"stream": "0"}) == "?stream=false"
    for bad in ({"stream": "yes"}, {"starting_after": "-1"}, {"starting_after": "1e3"},
                {"starting_after": "1" * 19}, {"starting_after": "٣"}):
        with pytest.raises(APIError) as err:
            stored_query(bad)
        assert err.value.status == 400


@pytest.mark.unit
def test_a_responses_body_renders_as_the_chat_body_vllm_builds():
    body = {"model": "m", "instructions": "Be brief.", "max_output_tokens": 5, "stream": True,
            "reasoning": {"effort": "low"}, "tool_choice": "auto",
            "tools": [{"type": "function", "name": "f", "parameters": {}}, {"type": "web_search_preview"}],
            "input": [{"role": "user", "content": "q"},
                      {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
                      {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                      {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                      {"type": "message", "role": "assistant", "status": "incomplete",
                       "content": [{"type": "output_text", "text": "so"}]}]}
    view = chat_body(body)
    assert view["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"},
        {"role": "assistant", "reasoning": "think",
         "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}, "type": "function"},
                        {"id": "c2", "function": {"name": "f", "arguments": "{}"}, "type": "function"}]},
        {"role": "tool", "content": "ok", "tool_call_id": "c1"},
        {"role": "assistant", "content": "so"}]
    assert view["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert (view["continue_final_message"], view["add_generation_prompt"], view["add_special_tokens"]) == \
        (True, False, True)
    assert (view["max_tokens"], view["reasoning_effort"], view["stream"], view["tool_choice"]) == \
        (5, "low", True, "auto")
    assert "tool_choice" not in chat_body({"input": "hi", "tool_choice": "none"})   # no tools: none rendered
    for bad, param in (({"input": 3}, "input"), ({"input": []}, "input"), ({"input": ["x"]}, "input"),
                       ({"input": [{"type": "nope"}]}, "input"), ({"input": "x", "instructions": 1}, "instructions"),
                       ({"input": [{"type": "reasoning", "encrypted_content": "zz"}]}, "input"),
                       ({"input": "x", "tools": "f"}, "tools"), ({"input": "x", "reasoning": "hi"}, "reasoning")):
        with pytest.raises(ChatTemplateError) as err:
            chat_body(bad)
        assert err.value.param == param
    with pytest.raises(Unrenderable):
        chat_body({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": "x"}]})


def _events(*kinds: str) -> list[bytes]:
    return [b"event: %s\ndata: {\"type\":\"%s\",\"pad\":\"%s\"}\n\n" % (k.encode(), k.encode(), b"x" * 40)
            for k in kinds]


STREAM = _events("response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added", "response.output_text.delta", "response.completed")


@pytest.mark.unit
def test_a_responses_streams_first_token_is_its_first_event_after_created_and_in_progress():
    """Split the stream in two at every byte but inside an event's first line (vLLM writes each
    event whole, so a read that ends inside one ends after its first line): the first token is found
    in the part that holds the first byte of ``response.output_item.added``, never before."""
    data = b"".join(STREAM)
    first = data.index(b"event: response.output_item.added")
    starts = [data.index(e) for e in STREAM]
    cuts = [c for c in range(1, len(data))
            if not any(s < c <= s + data.index(b"\n", s) - s for s in starts)]
    assert len(cuts) > len(data) * 0.7
    for cut in cuts:
        found, state = first_event_begins(data[:cut], 0, STREAM_PREAMBLE)
        assert found is (cut > first), cut
        if not found:
            assert first_event_begins(data[cut:], state, STREAM_PREAMBLE)[0] is True, cut
    # keep-alive comments between the preamble events change nothing; a chat stream has no preamble
    assert first_event_begins(b": keep-alive\n\n" + STREAM[0] + b": ka\n\n" + STREAM[1], 0, STREAM_PREAMBLE) == \
        (False, 0)
    assert first_event_begins(STREAM[0])[0] is True


# ---------------------------------------------------------------------------------------------
# through the router
# ---------------------------------------------------------------------------------------------


@dataclass
class ResponsesPod(Pod):
    """A recording pod that answers the Responses API: the id it was sent, its name; a stream's
    first two events at once and the rest ``first_delay_s`` later."""

    preamble_wait_s: float = 0.0

    def routes(self, app: web.Application) -> None:
        super().routes(app)
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{rid}", self.stored)
        app.router.add_post("/v1/responses/{rid}/cancel", self.stored)

    async def create(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = orjson.loads(raw)
        await self.received(request, raw)
        if not body.get("stream"):
            return web.json_response({"id": body.get("request_id"), "object": "response", "pod": self.name},
                                     headers={"x-pod-name": self.name})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        await resp.write(STREAM[0])
        await resp.write(STREAM[1])
        await asyncio.sleep(self.preamble_wait_s)
        for event in STREAM[2:]:
            await resp.write(event)
        return resp

    async def stored(self, request: web.Request) -> web.Response:
        await self.received(request, b"", query=request.query_string, method=request.method)
        return web.json_response({"id": request.match_info["rid"], "pod": self.name})


KEYS = [{"key": "sk-a", "name": "tenant-a"}, {"key": "sk-b", "name": "tenant-b", "cache_salt": "s" * 32}]


def _key(k: str) -> dict[str, str]:
    return {"authorization": f"Bearer {k}"}


@pytest.mark.e2e
async def test_turns_continuations_retrievals_and_other_keys_through_the_router():
    pods = [ResponsesPod(f"pod-{i}", free_port()) for i in range(3)]
    async with started(pods), running_router(settings_for(pods, api_keys=KEYS)) as (base, _), \
            httpx.AsyncClient(base_url=base, timeout=10) as c:
        by_name = {p.name: p for p in pods}
        sent = {"model": "m", "input": "hi", "max_output_tokens": 2, "request_id": "resp_mine",
                "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.0.0.1"}}
        r = await c.post("/v1/responses", json=sent, headers=_key("sk-a"))
        assert r.status_code == 200, r.text
        made, pod = r.json()["id"], r.headers["x-kvroute-pod"]
        got = orjson.loads(by_name[pod].seen[-1]["raw"])
        assert got["request_id"] == made != "resp_mine"              # the router's id, made for that pod
        assert pod_of(made, "tenant-a", by_name) == pod
        assert "kv_transfer_params" not in got                         # a client names no KV transfer
        # the salted key's request goes with its derived salt
        r = await c.post("/v1/responses", json={"model": "m", "input": "hi"}, headers=_key("sk-b"))
        assert r.status_code == 200
        salted = orjson.loads(by_name[r.headers["x-kvroute-pod"]].seen[-1]["raw"])
        assert len(salted["cache_salt"]) == 64 and "s" * 32 not in salted["cache_salt"]

        # a continuation goes to the pod that stores its response, however loaded
        for _ in range(4):
            r = await c.post("/v1/responses", json={"model": "m", "input": "more", "previous_response_id": made},
                             headers=_key("sk-a"))
            assert r.status_code == 200 and r.headers["x-kvroute-pod"] == pod
            assert pod_of(r.json()["id"], "tenant-a", by_name) == pod
        # retrieval and cancellation: that pod, the checked path and query
        r = await c.get(f"/v1/responses/{made}?stream=false&starting_after=3&evil=../x", headers=_key("sk-a"))
        assert r.status_code == 200 and r.json() == {"id": made, "pod": pod}
        seen = by_name[pod].seen[-1]
        assert (seen["path"], seen["query"], seen["method"]) == (f"/v1/responses/{made}",
                                                                 "stream=false&starting_after=3", "GET")
        r = await c.post(f"/v1/responses/{made}/cancel", headers=_key("sk-a"))
        assert r.status_code == 200 and by_name[pod].seen[-1]["path"] == f"/v1/responses/{made}/cancel"
        assert (await c.get(f"/v1/responses/{made}?starting_after=x", headers=_key("sk-a"))).status_code == 400

        # another key, an unknown id, a pod that left: vLLM's 404, and nothing reaches a pod
        before = sum(len(p.seen) for p in pods)
        gone = mint("pod-9", "tenant-a")
        for method, path, body, key in (
                ("GET", f"/v1/responses/{made}", None, "sk-b"),
                ("POST", f"/v1/responses/{made}/cancel", None, "sk-b"),
                ("POST", "/v1/responses", {"model": "m", "input": "x", "previous_response_id": made}, "sk-b"),
                ("GET", f"/v1/responses/{gone}", None, "sk-a"),
                ("POST", "/v1/responses", {"model": "m", "input": "x", "previous_response_id": gone}, "sk-a"),
                ("GET", "/v1/responses/resp_0123", None, "sk-a")):
            r = await c.request(method, path, json=body, headers=_key(key))
            assert r.status_code == 404, (path, r.text)
            assert r.json()["error"]["param"] == "response_id" and "not found" in r.json()["error"]["message"]
        assert sum(len(p.seen) for p in pods) == before
        # no key: 401 before anything else
        assert (await c.get(f"/v1/responses/{made}")).status_code == 401


@pytest.mark.e2e
async def test_a_background_responses_booking_stands_until_its_prefill_should_be_over():
    """vLLM answers a background response at once ("queued") and computes it afterwards (a probe of
    the real engine: 20 ms for a 3,300-token prompt whose prefill took ~0.5 s): its booking on the pod
    stands after the answer, until the prefill should be over, where a foreground answer's ends."""
    pods = [ResponsesPod("pod-0", free_port())]
    async with started(pods), running_router(settings_for(pods)) as (base, services), \
            httpx.AsyncClient(base_url=base, timeout=10) as c:
        ledger = services.router.ledger
        long = "tell me a long story about dragons and castles " * 400
        r = await c.post("/v1/responses", json={"model": "m", "input": long, "max_output_tokens": 50})
        assert r.status_code == 200 and ledger.inflight("pod-0") == 0   # foreground: released with the answer
        r = await c.post("/v1/responses", json={"model": "m", "input": long + "!", "background": True})
        assert r.status_code == 200 and ledger.inflight("pod-0") == 1   # the pod is computing it now
        deadline = time.monotonic() + 10
        while ledger.inflight("pod-0") and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert ledger.inflight("pod-0") == 0
        # a background stream is timed by its first event, as any stream
        async with c.stream("POST", "/v1/responses", json={"model": "m", "input": "hi", "background": True,
                                                          "stream": True}) as r:
            assert r.status_code == 200 and b"".join([part async for part in r.aiter_bytes()]) == b"".join(STREAM)
        assert ledger.inflight("pod-0") == 0


@pytest.mark.e2e
async def test_a_responses_streams_first_token_is_not_its_created_event():
    wait_s = 0.6
    pods = [ResponsesPod("pod-0", free_port(), preamble_wait_s=wait_s)]
    async with started(pods), running_router(settings_for(pods, retries=0)) as (base, services), \
            httpx.AsyncClient(base_url=base, timeout=10) as c:
        t0 = time.monotonic()
        async with c.stream("POST", "/v1/responses", json={"model": "m", "input": "hi", "stream": True}) as r:
            assert r.status_code == 200
            got = b"".join([part async for part in r.aiter_bytes()])
        took = time.monotonic() - t0
        total, count = ttft_observations(services)
    assert got == b"".join(STREAM) and took >= wait_s
    assert count == 1 and total >= wait_s * 0.9, f"observed TTFT {total:.3f} s, the first token after {wait_s} s"
