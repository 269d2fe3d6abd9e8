"""vLLM 0.32's batch of chat conversations through the router (router/chat_batch.py): the router in
this process in front of recording loopback pods that answer ``/v1/chat/completions/batch``.

A batch goes through the chat route's front door; its first conversation routes it (looked up and
credited as a chat prompt is) and the others count for its prompt tokens; what reaches the pod is the
client's body (a key's derived salt in it, a client's ``kv_transfer_params`` not), on an aggregated
pod.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import orjson
import pytest
from aiohttp import web

from kvcommon.settings import build_settings
from router.config import RouterSettings
from router.costs import estimate_prompt_tokens
from tests.helpers import free_port
from tests.test_router_api import Pod, running_router, settings_for, started

pytestmark = pytest.mark.e2e

PATH = "/v1/chat/completions/batch"


@dataclass
class BatchPod(Pod):
    """A recording pod that answers a batch as vLLM does: one choice per conversation, whole JSON."""

    def routes(self, app: web.Application) -> None:
        super().routes(app)
        app.router.add_post(PATH, self.batch)

    async def batch(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = orjson.loads(raw)
        await self.received(request, raw)
        choices = [{"index": i, "message": {"role": "assistant", "content": f"hi {i}"}, "finish_reason": "length"}
                   for i in range(len(body["messages"]))]
        return web.json_response({"id": "chatcmpl-1", "object": "chat.completion", "model": body.get("model"),
                                  "choices": choices, "pod": self.name})


def conversation(text: str, system: str | None = None) -> list[dict]:
    head = [{"role": "system", "content": system}] if system is not None else []
    return head + [{"role": "user", "content": text}]


def batch(*conversations: list[dict], **extra) -> dict:
    return {"model": "m", "max_tokens": 4, "messages": list(conversations), **extra}


async def test_a_batch_goes_through_the_chat_front_door():
    keys = [{"key": "sk-a", "name": "tenant-a", "cache_salt": "s" * 32}, {"key": "sk-o", "name": "ops", "admin": True}]
    pods = [BatchPod(f"pod-{i}", free_port()) for i in range(2)]
    async with started(pods), running_router(settings_for(pods, api_keys=keys)) as (base, _), \
            httpx.AsyncClient(base_url=base, timeout=10) as c:
        by_name = {p.name: p for p in pods}
        sent = batch(conversation("hello"), conversation("bonjour"),
                     kv_transfer_params={"do_remote_prefill": True, "remote_host": "10.0.0.1"})
        r = await c.post(PATH, json=sent, headers={"authorization": "Bearer sk-a"})
        assert r.status_code == 200, r.text
        assert [ch["index"] for ch in r.json()["choices"]] == [0, 1]
        got = orjson.loads(by_name[r.headers["x-kvroute-pod"]].seen[-1]["raw"])
        assert got["messages"] == sent["messages"] and "kv_transfer_params" not in got
        assert len(got["cache_salt"]) == 64 and "s" * 32 not in got["cache_salt"]   # the key's, derived
        # without a key's salt or a client's transfer params, the client's bytes as they came (its
        # stream flag too: vLLM ignores it and answers whole)
        raw = orjson.dumps(batch(conversation("as sent"), stream=True, tools=[{"type": "function"}]))
        r = await c.post(PATH, content=raw, headers={"authorization": "Bearer sk-o"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
        assert by_name[r.headers["x-kvroute-pod"]].seen[-1]["raw"] == raw
        # shapes vLLM refuses whatever the pod: the router's 400, naming the field; nothing sent
        before = sum(len(p.seen) for p in pods)
        for bad, param in (({"model": "m"}, "messages"), (batch(), "messages"),
                           ({"model": "m", "messages": conversation("flat")}, "messages.0"),
                           (batch(conversation("x"), []), "messages.1"), ({"model": "m", "messages": "x"}, "messages"),
                           (batch(conversation("x"), stream="yes"), "stream")):
            r = await c.post(PATH, json=bad, headers={"authorization": "Bearer sk-o"})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
        assert sum(len(p.seen) for p in pods) == before
        assert (await c.post(PATH, json=batch(conversation("x")))).status_code == 401


async def test_a_batch_is_routed_by_its_first_conversation_and_counts_them_all():
    pods = [BatchPod(f"pod-{i}", free_port()) for i in range(2)]
    async with started(pods), running_router(settings_for(pods)) as (base, services), \
            httpx.AsyncClient(base_url=base, timeout=10) as c:
        system = "You are the support agent of a large company. " * 60
        first = await c.post(PATH, json=batch(conversation("first question", system), conversation("other")))
        assert first.status_code == 200
        home = first.headers["x-kvroute-pod"]
        for i in range(4):   # the same first conversation's prefix: the pod credited with it
            r = await c.post(PATH, json=batch(conversation(f"question {i}", system), conversation(f"else {i}")))
            assert r.headers["x-kvroute-pod"] == home
        explained = await c.post("/debug/route", json={"model": "m", "messages": conversation("question 9", system)})
        cached = {p["pod"]: p["cached_tokens"] for p in explained.json()["pods"]}
        assert cached[home] > 0 and cached[home] > max(v for k, v in cached.items() if k != home)
        # the batch itself, explained: its first conversation's prefix, the others counted too
        explained = await c.post("/debug/route?route=" + PATH,
                                 json=batch(conversation("question 9", system), conversation("else " * 100)))
        assert explained.status_code == 200, explained.text
        assert explained.json()["chosen"] == home
        assert {p["pod"]: p["cached_tokens"] for p in explained.json()["pods"]}[home] == cached[home]
        assert explained.json()["prompt_tokens"] > services.router.prompt("chat", {
            "model": "m", "messages": conversation("question 9", system)})[0].__len__()
        # the other conversations count, at their estimated length, as prompt tokens routed
        counter = services.metrics.prompt_tokens
        others = [conversation("a long second conversation " * 200), conversation("and a third " * 100)]
        before = counter._value.get()
        r = await c.post(PATH, json=batch(conversation("short"), *others))
        assert r.status_code == 200
        counted = counter._value.get() - before
        rest = sum(estimate_prompt_tokens("chat", {"messages": o}, services.router.chars_per_token) for o in others)
        alone = services.router.prompt("chat", {"model": "m", "messages": conversation("short")})[0]
        assert rest > 1000 and counted == len(alone) + rest


def _routes_without_a_prefill_leg():
    from tests.test_generate import GeneratePod, generate
    from tests.test_messages_api import MessagesPod, message
    from tests.test_responses import ResponsesPod
    return [(BatchPod, PATH, batch(conversation("hi"))), (MessagesPod, "/v1/messages", message("hi")),
            (ResponsesPod, "/v1/responses", {"model": "m", "input": "hi"}),
            (GeneratePod, "/inference/v1/generate", generate([1, 2, 3]))]


@pytest.mark.parametrize("pod_class,path,body", _routes_without_a_prefill_leg(),
                         ids=["batch", "messages", "responses", "generate"])
async def test_on_prefill_and_decode_pods_the_decode_engine_computes_it_whole(pod_class, path, body):
    """The sidecar runs its two legs for the chat and completion routes only and passes a chat batch,
    a Messages request, a Responses turn or a token-in request to its decode engine: so the request
    goes to a decode pod, with no prefill pod named, and the decode engine computes it; a prefill pod
    alone serves none."""
    pods = [pod_class(f"pod-{i}", free_port()) for i in range(2)]
    fleet = [{"id": p.name, "url": p.url, "model": "m", "role": role} for p, role in zip(pods, ("prefill", "decode"))]
    for only_prefill in (False, True):
        settings = build_settings(RouterSettings, {"pods": fleet[:1] if only_prefill else fleet, "port": free_port(),
                                                   "health_interval_s": 0.2, "scrape_interval_s": 0.1})
        async with started(pods), running_router(settings) as (base, _), \
                httpx.AsyncClient(base_url=base, timeout=10) as c:
            r = await c.post(path, json=body)
            if only_prefill:
                assert r.status_code == 503
            else:
                assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "pod-1", r.text
                assert "x-prefiller-host-port" not in pods[1].seen[-1]["headers"]
        assert not pods[0].seen
