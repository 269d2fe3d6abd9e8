"""vLLM 0.32's token-in generation API through the router (router/generate.py): the router in this
process in front of recording loopback pods that answer ``/inference/v1/generate``.

The prompt is token ids, keyed as they are (no tokenizer): follow-ups that share a prefix of ids go
to the pod credited with it; what reaches the pod is the client's body (a key's derived salt in it,
a client's ``kv_transfer_params`` not).
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import orjson
import pytest
from aiohttp import web

from tests.helpers import free_port
from tests.test_router_api import Pod, running_router, settings_for, started

pytestmark = pytest.mark.e2e

PATH = "/inference/v1/generate"


@dataclass
class GeneratePod(Pod):
    """A recording pod that answers the token-in route as vLLM does: token ids out, whole or streamed."""

    def routes(self, app: web.Application) -> None:
        super().routes(app)
        app.router.add_post(PATH, self.generate_tokens)

    async def generate_tokens(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = orjson.loads(raw)
        await self.received(request, raw)
        choice = {"index": 0, "token_ids": [7, 8], "finish_reason": "length"}
        if not body.get("stream"):
            return web.json_response({"request_id": body.get("request_id", "r"), "choices": [choice]})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for t in (7, 8):
            await resp.write(b"data: " + orjson.dumps({"choices": [{"index": 0, "token_ids": [t]}]}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


def generate(ids: list[int], **extra) -> dict:
    return {"model": "m", "token_ids": ids, "sampling_params": {"max_tokens": 2}, **extra}


async def test_a_token_in_request_goes_through_the_front_door_as_it_came():
    keys = [{"key": "sk-a", "name": "tenant-a", "cache_salt": "s" * 32}, {"key": "sk-o", "name": "ops", "admin": True}]
    pods = [GeneratePod(f"pod-{i}", free_port()) for i in range(2)]
    async with started(pods), running_router(settings_for(pods, api_keys=keys)) as (base, _), \
            httpx.AsyncClient(base_url=base, timeout=10) as c:
        by_name = {p.name: p for p in pods}
        sent = generate([1, 2, 3], kv_transfer_params={"do_remote_prefill": True, "remote_host": "10.0.0.1"})
        r = await c.post(PATH, json=sent, headers={"authorization": "Bearer sk-a"})
        assert r.status_code == 200, r.text
        got = orjson.loads(by_name[r.headers["x-kvroute-pod"]].seen[-1]["raw"])
        assert got["token_ids"] == [1, 2, 3] and "kv_transfer_params" not in got
        assert len(got["cache_salt"]) == 64 and "s" * 32 not in got["cache_salt"]   # the key's, derived
        # the client's bytes as they came, without a salt or transfer params; no model: the fleet's one
        raw = orjson.dumps({"token_ids": [4, 5], "sampling_params": {"max_tokens": 1}, "stream": True})
        async with c.stream("POST", PATH, content=raw, headers={"authorization": "Bearer sk-o"}) as r:
            assert r.status_code == 200
            events = [e for e in (await r.aread()).split(b"\n\n") if e]
        assert by_name[r.headers["x-kvroute-pod"]].seen[-1]["raw"] == raw and events[-1] == b"data: [DONE]"
        # shapes vLLM refuses whatever the pod: the router's 400, naming the field; nothing sent
        before = sum(len(p.seen) for p in pods)
        for bad, param in (({"model": "m", "sampling_params": {}}, "token_ids"), (generate([]), "token_ids"),
                           (generate([1, -2]), "token_ids"), (generate([1, "2"]), "token_ids"),
                           (generate([1, True]), "token_ids"), ({"model": "m", "token_ids": [1]}, "sampling_params"),
                           (generate([1], stream="yes"), "stream"), (generate([1], model="other"), "model")):
            r = await c.post(PATH, json=bad, headers={"authorization": "Bearer sk-o"})
            assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (bad, r.text)
        assert sum(len(p.seen) for p in pods) == before
        assert (await c.post(PATH, json=generate([1]))).status_code == 401


async def test_token_ids_are_keyed_as_they_are_and_follow_ups_find_their_pod():
    pods = [GeneratePod(f"pod-{i}", free_port()) for i in range(2)]
    async with started(pods), running_router(settings_for(pods)) as (base, services), \
            httpx.AsyncClient(base_url=base, timeout=10) as c:
        shared = list(range(1000, 1000 + 64 * services.router.block_size))
        first = await c.post(PATH, json=generate(shared + [1]))
        assert first.status_code == 200
        home = first.headers["x-kvroute-pod"]
        for i in range(4):
            r = await c.post(PATH, json=generate(shared + [2 + i]))
            assert r.headers["x-kvroute-pod"] == home
        explained = await c.post("/debug/route?route=" + PATH, json=generate(shared + [9]))
        assert explained.status_code == 200, explained.text
        assert explained.json()["prompt_tokens"] == len(shared) + 1   # the ids themselves, no tokenizer
        cached = {p["pod"]: p["cached_tokens"] for p in explained.json()["pods"]}
        assert cached[home] == len(shared) and explained.json()["chosen"] == home
