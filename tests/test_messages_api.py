"""The Anthropic Messages API through the router (router/messages.py): the router in this process in
front of recording loopback pods that answer ``/v1/messages`` and ``/v1/messages/count_tokens``.

A request goes through the chat route's front door and planning (the chat body it renders as,
indexer/messages.py); what reaches the pod is the client's body (a key's derived salt in it, a
client's ``kv_transfer_params`` not), on an aggregated pod; a stream's ``message_start`` is not its
first token; ``count_tokens`` is passed through.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import anthropic
import httpx
import orjson
import pytest
from aiohttp import web

from tests.helpers import free_port
from tests.test_router_api import Pod, running_router, settings_for, started
from tests.test_stream_review import ttft_observations

pytestmark = pytest.mark.e2e


def _event(name: str, data: dict) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (name.encode(), orjson.dumps({"type": name, **data}))


START = _event("message_start", {"message": {"id": "chatcmpl-1", "type": "message", "role": "assistant",
                                             "content": [], "usage": {"input_tokens": 9, "output_tokens": 0}}})
TOKENS = [_event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
          _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "hi"}}),
          _event("content_block_stop", {"index": 0}),
          _event("message_delta", {"delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 1}}),
          _event("message_stop", {})]


@dataclass
class MessagesPod(Pod):
    """A recording pod that answers the Messages API; a stream's ``message_start`` at once and the
    rest ``start_wait_s`` later."""

    start_wait_s: float = 0.0

    def routes(self, app: web.Application) -> None:
        super().routes(app)
        app.router.add_post("/v1/messages", self.create)
        app.router.add_post("/v1/messages/count_tokens", self.count)

    async def create(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = orjson.loads(raw)
        await self.received(request, raw)
        if not body.get("stream"):
            return web.json_response({"id": "chatcmpl-1", "type": "message", "role": "assistant", "pod": self.name,
                                      "content": [{"type": "text", "text": "hi"}], "stop_reason": "max_tokens"})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        await resp.write(START)
        await asyncio.sleep(self.start_wait_s)
        for event in TOKENS:
            await resp.write(event)
        return resp

    async def count(self, request: web.Request) -> web.Response:
        raw = await request.read()
        await self.received(request, raw)
        return web.json_response({"input_tokens": 9, "pod": self.name})


def message(text: str, **extra) -> dict:
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": text}], **extra}


async def test_a_messages_request_goes_through_the_chat_front_door_and_planning():
    keys = [{"key": "sk-a", "name": "tenant-a", "cache_salt": "s" * 32}, {"key": "sk-o", "name": "ops", "admin": True}]
    pods = [MessagesPod(f"pod-{i}", free_port()) for i in range(2)]
    async with started(pods), running_router(settings_for(pods, api_keys=keys)) as (base, _), \
            httpx.AsyncClient(base_url=base, timeout=10) as c:
        by_name = {p.name: p for p in pods}
        sent = message("hello", kv_transfer_params={"do_remote_prefill": True, "remote_host": "10.0.0.1"},
                       system=[{"type": "text", "text": "Be brief."}])
        r = await c.post("/v1/messages", json=sent, headers={"authorization": "Bearer sk-a"})
        assert r.status_code == 200, r.text
        got = orjson.loads(by_name[r.headers["x-kvroute-pod"]].seen[-1]["raw"])
        assert "kv_transfer_params" not in got and got["system"] == sent["system"]
        assert len(got["cache_salt"]) == 64 and "s" * 32 not in got["cache_salt"]   # the key's, derived
        # without a key's salt or a client's transfer params, the client's bytes as they came
        raw = orjson.dumps(message("bytes as sent", metadata={"user_id": "u1"}))
        r = await c.post("/v1/messages", content=raw, headers={"authorization": "Bearer sk-o"})
        assert r.status_code == 200 and by_name[r.headers["x-kvroute-pod"]].seen[-1]["raw"] == raw
        # what vLLM would refuse whatever the pod: the router's 400, naming the field; nothing sent
        before = sum(len(p.seen) for p in pods)
        for bad, param in ((message("x", max_tokens=0), "max_tokens"), ({"model": "m", "max_tokens": 3}, "messages"),
                           (message("x", system=7), "system"),
                           (message("x", tools=[{"name": "f"}]), "tools"),
                           ({**message("x"), "messages": [{"role": "robot", "content": "x"}]}, "messages")):
            r = await c.post("/v1/messages", json=bad, headers={"authorization": "Bearer sk-o"})
            assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), (bad, r.text)
        assert sum(len(p.seen) for p in pods) == before
        # an image: routed on an estimate of its length (the router cannot render it as vLLM does)
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
        r = await c.post("/v1/messages", json={**message("x"), "messages": [{"role": "user", "content": [
            image, {"type": "text", "text": "what is this?"}]}]}, headers={"authorization": "Bearer sk-o"})
        assert r.status_code == 200
        # count_tokens: passed through as it came, no salt (vLLM's count_tokens takes none)
        counted = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
        r = await c.post("/v1/messages/count_tokens", json=counted, headers={"authorization": "Bearer sk-a"})
        assert r.status_code == 200 and r.json()["input_tokens"] == 9
        assert orjson.loads(by_name[r.headers["x-kvroute-pod"]].seen[-1]["raw"]) == counted
        assert (await c.post("/v1/messages", json=message("x"))).status_code == 401


async def test_anthropics_sdk_authenticates_with_its_x_api_key_header_and_the_pods_never_see_it():
    """Anthropic's SDKs send their key as ``x-api-key`` (``auth_token`` as a bearer key): the router
    takes either as the caller's key, and a pod sees neither. A wrong key is the SDK's 401, and the
    key's limits are its own: the request bucket counts requests made either way."""
    keys = [{"key": "sk-a", "name": "a", "requests_per_s": 0.01, "request_burst": 3}]
    pods = [MessagesPod("pod-0", free_port())]
    async with started(pods), running_router(settings_for(pods, api_keys=keys)) as (base, _):
        for client in (anthropic.AsyncAnthropic(base_url=base, api_key="sk-a", max_retries=0, timeout=10),
                       anthropic.AsyncAnthropic(base_url=base, auth_token="sk-a", max_retries=0, timeout=10)):
            answer = await client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
            assert answer.content[0].text == "hi"
            await client.close()
        for seen in pods[0].seen:
            assert "x-api-key" not in seen["headers"] and "authorization" not in seen["headers"], seen["headers"]
        wrong = anthropic.AsyncAnthropic(base_url=base, api_key="sk-b", max_retries=0, timeout=10)
        with pytest.raises(anthropic.AuthenticationError, match="x-api-key"):
            await wrong.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        await wrong.close()
        limited = anthropic.AsyncAnthropic(base_url=base, api_key="sk-a", max_retries=0, timeout=10)
        await limited.messages.count_tokens(model="m", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(anthropic.RateLimitError):   # the burst of 3 spent by the two above and this one
            await limited.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        await limited.close()
    assert len(pods[0].seen) == 3


async def test_a_messages_prefix_is_routed_to_the_pod_that_holds_it():
    """Follow-ups of one long system prompt go where its first request went (the index's credit),
    while another conversation is free to go elsewhere."""
    pods = [MessagesPod(f"pod-{i}", free_port()) for i in range(2)]
    async with started(pods), running_router(settings_for(pods)) as (base, services), \
            httpx.AsyncClient(base_url=base, timeout=10) as c:
        system = "You are the support agent of a large company. " * 60
        first = await c.post("/v1/messages", json=message("first question", system=system))
        assert first.status_code == 200
        for i in range(4):
            r = await c.post("/v1/messages", json=message(f"question {i}", system=system))
            assert r.headers["x-kvroute-pod"] == first.headers["x-kvroute-pod"]
        explained = await c.post("/debug/route", json={"model": "m", "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": "question 9"}]})
        cached = {p["pod"]: p["cached_tokens"] for p in explained.json()["pods"]}
        assert cached[first.headers["x-kvroute-pod"]] > 0
        # the Messages request itself, explained as its route plans it
        explained = await c.post("/debug/route?route=/v1/messages", json=message("question 9", system=system))
        assert explained.status_code == 200, explained.text
        rows = {p["pod"]: p for p in explained.json()["pods"]}
        assert explained.json()["chosen"] == first.headers["x-kvroute-pod"]
        assert rows[first.headers["x-kvroute-pod"]]["cached_tokens"] == cached[first.headers["x-kvroute-pod"]]
        bad = await c.post("/debug/route?route=/v1/embeddings", json=message("x"))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "route"


async def test_a_messages_streams_first_token_is_not_its_message_start():
    wait_s = 0.6
    pods = [MessagesPod("pod-0", free_port(), start_wait_s=wait_s)]
    async with started(pods), running_router(settings_for(pods, retries=0)) as (base, services), \
            httpx.AsyncClient(base_url=base, timeout=10) as c:
        t0 = time.monotonic()
        async with c.stream("POST", "/v1/messages", json=message("hi", stream=True)) as r:
            assert r.status_code == 200
            got = b"".join([part async for part in r.aiter_bytes()])
        took = time.monotonic() - t0
        total, count = ttft_observations(services)
    assert got == START + b"".join(TOKENS) and took >= wait_s
    assert count == 1 and total >= wait_s * 0.9, f"observed TTFT {total:.3f} s, the first token after {wait_s} s"
