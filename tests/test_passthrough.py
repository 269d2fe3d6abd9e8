"""vLLM's other request routes through the router (router/passthrough.py): /tokenize, /detokenize,
/v1/embeddings, /pooling, /classify, /score, /v1/score, /rerank, /v1/rerank, /v2/rerank and /v2/embed.

The router runs in this process under uvicorn (``running_router`` of tests/test_router_api.py); the
pods are its recording loopback pods (aiohttp) with these routes added, since the simulated pod
answers only /tokenize and /detokenize of them. Each pod answers with its name, the path it was sent
and the model the body named, so a test sees where a request went and what arrived there.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass, field

import httpx
import openai
import orjson
import pytest
from aiohttp import web

from kvcommon.settings import build_settings
from router.config import RouterSettings
from router.passthrough import PATHS, POOLING_PATHS
from tests.helpers import free_port, until
from tests.test_router_api import Pod, completion, running_router, started

pytestmark = pytest.mark.e2e

EMBEDDING = [0.25, -0.5, 1.0]


@dataclass
class PassPod(Pod):
    """A recording pod that also answers vLLM's pass-through routes; a pooling answer says the model
    ran over the next of ``usage``'s counts while there are any (an embedding's 2 after them)."""

    model: str = "m"
    adapters: tuple[str, ...] = ()
    usage: list[int] = field(default_factory=list)

    def routes(self, app: web.Application) -> None:
        super().routes(app)
        for path in PATHS:
            app.router.add_post(path, self.other)

    async def other(self, request: web.Request) -> web.Response:
        raw = await request.read()
        instead = await self.received(request, raw, query=request.query_string)
        if instead is not None:
            return instead
        body = orjson.loads(raw)
        if body.get("bad"):  # a refusal of the pod's own, relayed as it is
            return web.json_response({"error": {"message": "pod says no", "type": "BadRequestError", "code": 400}},
                                     status=400, headers={"x-pod-name": self.name})
        counted = {"usage": {"prompt_tokens": n, "total_tokens": n}} if (
            request.path in POOLING_PATHS and (n := self.usage.pop(0) if self.usage else None) is not None) else {}
        if request.path == "/v1/embeddings":
            packed = struct.pack(f"<{len(EMBEDDING)}f", *EMBEDDING)
            vector = (base64.b64encode(packed).decode() if body.get("encoding_format") == "base64"
                      else EMBEDDING)
            return web.json_response({"object": "list", "model": body.get("model") or self.model,
                                      "data": [{"object": "embedding", "index": 0, "embedding": vector}],
                                      "usage": {"prompt_tokens": 2, "total_tokens": 2}, **counted},
                                     headers={"x-pod-name": self.name})
        return web.json_response({"pod": self.name, "path": request.path, "model": body.get("model"), **counted},
                                 status=200, headers={"x-pod-name": self.name})


def pass_pods(*specs: tuple[str, str, tuple[str, ...]], **kw):
    """Pods (name, model, adapters), started on free ports."""
    return started([PassPod(name, free_port(), model=model, adapters=adapters, **kw)
                    for name, model, adapters in specs])


def settings_for(pods: list[PassPod], **kw) -> RouterSettings:
    fleet = [{"id": p.name, "url": p.url, "model": p.model, "lora_adapters": list(p.adapters)} for p in pods]
    base = {"pods": fleet, "port": free_port(), "health_interval_s": 0.2, "scrape_interval_s": 0.1}
    base.update(kw)
    return build_settings(RouterSettings, base)


def body_for(path: str, model: str | None) -> dict:
    """A plausible body of ``path``'s vLLM request (the pods do not read it beyond ``model``)."""
    shapes = {"/tokenize": {"prompt": "hello world"}, "/detokenize": {"tokens": [1, 2, 3]},
              "/v1/embeddings": {"input": "hello"}, "/pooling": {"input": "hello"},
              "/classify": {"input": "hello"}, "/score": {"queries": "q", "documents": ["a"]},
              "/v1/score": {"queries": "q", "documents": ["a"]}, "/rerank": {"query": "q", "documents": ["a"]},
              "/v1/rerank": {"query": "q", "documents": ["a"]}, "/v2/rerank": {"query": "q", "documents": ["a"]},
              "/v2/embed": {"texts": ["hello"], "input_type": "search_document"},
              "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hello"}]},
              "/v1/chat/completions/render": {"messages": [{"role": "user", "content": "hello"}]},
              "/v1/completions/render": {"prompt": "hello"},
              "/v1/messages/render": {"max_tokens": 1, "messages": [{"role": "user", "content": "hello"}]}}
    body = dict(shapes[path])
    if model is not None:
        body["model"] = model
    return body


def requests_metric(services, pod: str, status: str) -> float:
    return services.metrics.requests.labels(pod, "passthrough", status)._value.get()


async def test_each_route_reaches_a_pod_of_the_body_s_model_and_its_answer_comes_back_as_sent():
    async with pass_pods(("a", "m1", ()), ("b", "m2", ())) as pods, \
            running_router(settings_for(pods)) as (base, services):
        a, b = pods
        async with httpx.AsyncClient(base_url=base) as c:
            for path in PATHS:
                for model, pod in (("m1", a), ("m2", b)):
                    raw = orjson.dumps(body_for(path, model)) + b"  "  # forwarded byte for byte
                    r = await c.post(path, content=raw, headers={"content-type": "application/json"})
                    assert r.status_code == 200, (path, r.text)
                    assert r.headers["x-kvroute-pod"] == pod.name == r.headers["x-pod-name"]
                    if path != "/v1/embeddings":
                        assert r.json() == {"pod": pod.name, "path": path, "model": model}
                    assert pod.seen[-1]["path"] == path and pod.seen[-1]["raw"] == raw
            assert len(a.seen) == len(b.seen) == len(PATHS)
            # the pod's own refusal comes back as it is, status, body and headers
            r = await c.post("/classify", json={"model": "m2", "input": "x", "bad": True})
            assert r.status_code == 400 and r.json()["error"]["message"] == "pod says no"
            assert r.headers["x-pod-name"] == "b" and r.headers["x-kvroute-pod"] == "b"
        assert requests_metric(services, "b", "200") == len(PATHS)
        assert requests_metric(services, "b", "400") == 1


async def test_nothing_the_client_sends_picks_the_host_or_the_path():
    async with pass_pods(("a", "m", ())) as pods, running_router(settings_for(pods)) as (base, _):
        async with httpx.AsyncClient(base_url=base) as c:
            r = await c.post("/tokenize?url=http://evil:1/x&pod=b", json=body_for("/tokenize", "m"), headers={
                "x-kvroute-pod": "b", "x-prefiller-host-port": "evil:1", "host": "evil:2",
                "x-data-parallel-host-port": "evil:3", "x-request-id": "rid-1", "x-user-header": "kept",
                "connection": "keep-alive, x-custom-hop", "x-custom-hop": "dropped"})
            assert r.status_code == 200 and r.headers["x-request-id"] == "rid-1"
            seen = pods[0].seen[-1]
            assert seen["path"] == "/tokenize" and seen["query"] == ""
            for stripped in ("x-kvroute-pod", "x-prefiller-host-port", "x-data-parallel-host-port", "x-custom-hop"):
                assert stripped not in seen["headers"]
            assert seen["headers"]["x-user-header"] == "kept" and seen["headers"]["x-request-id"] == "rid-1"
            assert seen["headers"]["host"] == f"127.0.0.1:{pods[0].port}"
            # a path outside the list (or one spelt otherwise) is no pass-through: the router's 404
            for other in ("/tokenize/", "/v1/tokenize", "/v2/embeddings", "/start_profile", "/TOKENIZE"):
                r = await c.post(other, json=body_for("/tokenize", "m"))
                assert r.status_code == 404, other
            # a GET is a 405, as for the generation routes
            assert (await c.get("/tokenize")).status_code == 405
        assert len(pods[0].seen) == 1


async def test_embeddings_through_the_openai_sdk():
    async with pass_pods(("a", "m1", ()), ("b", "emb", ())) as pods, \
            running_router(settings_for(pods)) as (base, _):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        try:
            got = await client.embeddings.create(model="emb", input="hello")
            plain = await client.embeddings.create(model="emb", input="hello", encoding_format="float")
        finally:
            await client.close()
        assert got.data[0].embedding == plain.data[0].embedding == EMBEDDING
        assert got.model == "emb"
        assert [s["path"] for s in pods[1].seen] == ["/v1/embeddings"] * 2 and not pods[0].seen


async def test_an_adapter_s_request_goes_to_a_pod_that_serves_it_and_the_least_loaded_pod_is_chosen():
    async with pass_pods(("a", "m", ("ad",)), ("b", "m", ()), ("c", "m", ())) as pods, \
            running_router(settings_for(pods)) as (base, services):
        a, b, c_ = pods
        async with httpx.AsyncClient(base_url=base) as c:
            for _ in range(4):
                r = await c.post("/v1/embeddings", json=body_for("/v1/embeddings", "ad"))
                assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "a"
            # an idle fleet shares the base model's requests
            names = {(await c.post("/tokenize", json=body_for("/tokenize", "m"))).headers["x-kvroute-pod"]
                     for _ in range(6)}
            assert names == {"a", "b", "c"}
            # a queue on two of them (their scraped vllm:num_requests_waiting): the third takes them all
            a.waiting, b.waiting = 4, 2
            await until(lambda: services.registry.pods["a"].waiting == 4 and services.registry.pods["b"].waiting == 2,
                        what="the queues scraped")
            names = {(await c.post("/tokenize", json=body_for("/tokenize", "m"))).headers["x-kvroute-pod"]
                     for _ in range(4)}
            assert names == {"c"}
            # generation requests the router booked there count too
            c_.waiting = 0
            ticket = services.router.ledger.book("c", 100.0)
            ticket2 = services.router.ledger.book("c", 100.0)
            ticket3 = services.router.ledger.book("c", 100.0)
            r = await c.post("/tokenize", json=body_for("/tokenize", "m"))
            assert r.headers["x-kvroute-pod"] == "b"
            for t in (ticket, ticket2, ticket3):
                services.router.ledger.release("c", t)
        # an adapter no pod lists is the generation routes' 404
        async with httpx.AsyncClient(base_url=base) as c:
            r = await c.post("/tokenize", json=body_for("/tokenize", "nope"))
            gen = await c.post("/v1/completions", json=completion(model="nope"))
        assert r.status_code == gen.status_code == 404 and r.json() == gen.json()


async def test_a_key_limited_to_other_models_gets_the_404_and_keys_are_required():
    keys = [{"key": "k-m1", "models": ["m1"]}, {"key": "k-all"}]
    async with pass_pods(("a", "m1", ()), ("b", "m2", ())) as pods, \
            running_router(settings_for(pods, api_keys=keys)) as (base, services):
        async with httpx.AsyncClient(base_url=base) as c:
            r = await c.post("/tokenize", json=body_for("/tokenize", "m2"))
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
            limited = {"authorization": "Bearer k-m1"}
            r = await c.post("/rerank", json=body_for("/rerank", "m2"), headers=limited)
            gen = await c.post("/v1/completions", json=completion(model="m2"), headers=limited)
            assert r.status_code == gen.status_code == 404 and r.json() == gen.json()
            assert r.json()["error"]["message"] == "The model `m2` does not exist."
            assert (await c.post("/rerank", json=body_for("/rerank", "m1"), headers=limited)).status_code == 200
            r = await c.post("/rerank", json=body_for("/rerank", "m2"), headers={"authorization": "Bearer k-all"})
            assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "b"
            # the router checked the key: the pod never sees it
            assert "authorization" not in pods[1].seen[-1]["headers"]
        assert not any(s["raw"] and b'"m2"' in s["raw"] for s in pods[0].seen)
        assert len(pods[1].seen) == 1
        assert requests_metric(services, "", "401") == 1 and requests_metric(services, "", "404") == 1


async def test_the_key_s_request_rate_limit_applies():
    keys = [{"key": "k", "requests_per_s": 0.5, "request_burst": 2}]
    async with pass_pods(("a", "m", ())) as pods, \
            running_router(settings_for(pods, api_keys=keys)) as (base, services):
        auth = {"authorization": "Bearer k"}
        async with httpx.AsyncClient(base_url=base) as c:
            codes = [(await c.post("/detokenize", json=body_for("/detokenize", "m"), headers=auth)).status_code
                     for _ in range(2)]
            r = await c.post("/detokenize", json=body_for("/detokenize", "m"), headers=auth)
            # the same bucket as the generation routes'
            gen = await c.post("/v1/completions", json=completion(), headers=auth)
        assert codes == [200, 200]
        assert r.status_code == gen.status_code == 429 and r.json()["error"]["type"] == "RateLimitError"
        assert int(r.headers["retry-after"]) >= 1
        assert len(pods[0].seen) == 2
        assert requests_metric(services, "", "429") == 1


async def test_the_pooling_routes_spend_the_key_s_prompt_tokens_and_the_others_do_not():
    """An embedding, score or rerank request runs the model over its input: it is charged to the key's
    prompt-token bucket at an estimate, as a generation request is before it is tokenized, so a
    tenant cannot prefill past its limit through them; /tokenize runs no model and is not charged.
    (The pod's answers count what the estimates do: settling is the next test's.)"""
    keys = [{"key": "k", "prompt_tokens_per_s": 1, "prompt_token_burst": 3000}]
    async with pass_pods(("a", "m", ()), usage=[1100, 900]) as pods, \
            running_router(settings_for(pods, api_keys=keys, estimate_chars_per_token=4.0)) as (base, services):
        auth = {"authorization": "Bearer k"}
        big = "the quick brown fox jumps over the lazy dog " * 100   # 4,400 characters: 1,100 tokens at 4 a token
        async with httpx.AsyncClient(base_url=base) as c:
            for _ in range(5):   # tokenizing runs no model: never charged
                assert (await c.post("/tokenize", json={"model": "m", "prompt": big}, headers=auth)).status_code == 200
            first = await c.post("/v1/embeddings", json={"model": "m", "input": [big]}, headers=auth)
            ids = await c.post("/rerank", json={"model": "m", "query": "q", "documents": [[7] * 900]}, headers=auth)
            refused = await c.post("/score", json={"model": "m", "queries": big, "documents": [big, big]}, headers=auth)
            # the generation routes spend the same bucket: about 1,000 tokens are left in it
            small = await c.post("/v1/completions", json=completion(), headers=auth)
            large = await c.post("/v1/completions", json={**completion(), "prompt": big}, headers=auth)
        assert first.status_code == 200 and ids.status_code == 200
        assert refused.status_code == 429 and "prompt tokens" in refused.json()["error"]["message"]
        assert small.status_code == 200 and large.status_code == 429
        assert [s["path"] for s in pods[0].seen] == ["/tokenize"] * 5 + ["/v1/embeddings", "/rerank", "/v1/completions"]


async def test_a_pooling_charge_is_settled_to_what_the_pod_says_it_ran():
    """The estimate is the characters' (4 a token here); the pod's answer says what its tokenizer made
    of them (``usage.prompt_tokens``), and the key is charged that: text that tokenizes densely (rare
    characters, a token or more each) takes the bucket into debt, refusing the next pooling request
    before its body is read, and an estimate over the count is given back. A refused answer (the pod's
    400) and one with no count keep the estimate."""
    keys = [{"key": "k", "prompt_tokens_per_s": 1, "prompt_token_burst": 3000}]
    text = "x" * 4000   # 1,000 tokens by the estimate
    async with pass_pods(("a", "m", ()), usage=[10, 3100]) as pods, \
            running_router(settings_for(pods, api_keys=keys, estimate_chars_per_token=4.0)) as (base, services):
        auth = {"authorization": "Bearer k"}
        async with httpx.AsyncClient(base_url=base) as c:
            over = await c.post("/v1/embeddings", json={"model": "m", "input": text}, headers=auth)
            # 1,000 charged, settled to 10: 2,990 left, so two more of these fit where one did not
            again = await c.post("/classify", json={"model": "m", "input": text * 2}, headers=auth)
            # that one ran 3,100 tokens (the pod said so), not the estimated 2,000: the bucket is 110 in
            # debt (less its refill since, 1 a second), so the next is refused before the pod sees it
            refused = await c.post("/v1/embeddings", json={"model": "m", "input": "hi"}, headers=auth)
    assert over.status_code == 200 and again.status_code == 200, (over.text, again.text)
    assert refused.status_code == 429 and "prompt tokens" in refused.json()["error"]["message"], refused.text
    assert [s["path"] for s in pods[0].seen] == ["/v1/embeddings", "/classify"]


async def test_a_connection_failure_is_retried_on_another_pod_once_and_marks_the_pod():
    async with pass_pods(("alive", "m", ())) as pods:
        fleet = [{"id": "dead", "url": f"http://127.0.0.1:{free_port()}", "model": "m"},
                 {"id": "alive", "url": pods[0].url, "model": "m"}]
        settings = build_settings(RouterSettings, {"pods": fleet, "port": free_port(), "health_interval_s": 30,
                                                   "unhealthy_after": 5})
        async with running_router(settings) as (base, services):
            services.registry.mark("dead", True)  # pretend it was healthy at the last check
            async with httpx.AsyncClient(base_url=base) as c:
                answers = [await c.post("/pooling", json=body_for("/pooling", "m")) for _ in range(2)]
            assert [r.status_code for r in answers] == [200, 200]
            assert {r.headers["x-kvroute-pod"] for r in answers} == {"alive"}
            assert services.metrics.retries.labels("connect")._value.get() == 1
            assert services.registry.pods["dead"].failures == 1


async def test_a_missing_model_takes_the_one_model_served_and_is_a_400_with_two():
    async with pass_pods(("a", "m", ("ad",)), ("b", "m", ())) as pods, \
            running_router(settings_for(pods)) as (base, _):
        async with httpx.AsyncClient(base_url=base) as c:
            r = await c.post("/tokenize", json=body_for("/tokenize", None))
        assert r.status_code == 200 and r.json()["model"] is None  # forwarded untouched: vLLM takes its model
        assert r.headers["x-kvroute-pod"] in {"a", "b"}
    async with pass_pods(("a", "m1", ()), ("b", "m2", ())) as pods, \
            running_router(settings_for(pods)) as (base, services):
        async with httpx.AsyncClient(base_url=base) as c:
            r = await c.post("/v1/embeddings", json=body_for("/v1/embeddings", None))
            null = await c.post("/v1/embeddings", json={**body_for("/v1/embeddings", None), "model": None})
        assert r.status_code == null.status_code == 400
        assert r.json()["error"]["param"] == "model" and "`model` is required" in r.json()["error"]["message"]
        assert not pods[0].seen and not pods[1].seen
        assert requests_metric(services, "", "400") == 2


@pytest.mark.parametrize("raw", [b"not json", b"", b"[1, 2]", b'{"model": 7}', b'{"model": "m", '],
                         ids=["text", "empty", "array", "model-not-a-string", "cut"])
async def test_a_body_that_is_not_a_json_object_is_an_openai_400(raw):
    async with pass_pods(("a", "m", ())) as pods, running_router(settings_for(pods)) as (base, _):
        async with httpx.AsyncClient(base_url=base) as c:
            r = await c.post("/score", content=raw, headers={"content-type": "application/json"})
            big = await c.post("/score", content=b'{"model": "m", "x": "' + b"y" * 300 + b'"}',
                               headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"} and r.json()["error"]["code"] == 400
        assert "Traceback" not in r.text
        assert big.status_code == 200
        assert len(pods[0].seen) == 1


async def test_a_body_over_the_limit_is_a_413():
    async with pass_pods(("a", "m", ())) as pods, \
            running_router(settings_for(pods, max_body_bytes=1024)) as (base, _):
        async with httpx.AsyncClient(base_url=base) as c:
            r = await c.post("/v1/embeddings", json={"model": "m", "input": "x" * 2000})
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        assert not pods[0].seen


async def test_an_upstream_that_fails_is_retried_once_then_passed_through():
    async with pass_pods(("a", "m", ()), ("b", "m", ()), fail_status=500) as pods, \
            running_router(settings_for(pods, health_interval_s=30)) as (base, services):
        for p in pods:
            p.fail_times = 1
        async with httpx.AsyncClient(base_url=base) as c:
            # the first pod's 500, then the other pod's 500: the client gets the last one as it was
            r = await c.post("/classify", json=body_for("/classify", "m"))
            assert r.status_code == 500 and r.json()["error"]["message"] == "boom"
            assert sum(len(p.seen) for p in pods) == 2
            assert services.metrics.retries.labels("5xx")._value.get() == 2
            assert requests_metric(services, r.headers["x-kvroute-pod"], "500") == 1
            # one failing pod: the other answers, whichever was tried first
            pods[0].fail_times = 1
            answers = [await c.post("/classify", json=body_for("/classify", "m")) for _ in range(2)]
            assert [r.status_code for r in answers] == [200, 200]
            assert {r.headers["x-kvroute-pod"] for r in answers} == {"b"}
        # every pod stopped: a 502 that names the pod, not its address, and no stack trace
        for p in pods:
            await p.stop()
        async with httpx.AsyncClient(base_url=base) as c:
            r = await c.post("/classify", json=body_for("/classify", "m"))
        assert r.status_code == 502 and r.json()["error"]["code"] == 502
        assert "could not be reached (connect)" in r.json()["error"]["message"] and "127.0.0.1" not in r.text
        assert services.metrics.retries.labels("connect")._value.get() == 2


class HalfPod(PassPod):
    """Sends the head and part of the body, then closes the connection."""

    async def other(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "application/json"})
        resp.content_length = 100
        await resp.prepare(request)
        await resp.write(b'{"pod": "a"')
        assert request.transport is not None
        request.transport.close()
        return resp


async def test_an_upstream_that_breaks_mid_answer_is_a_502():
    pod = HalfPod("a", free_port())
    await pod.start()
    try:
        async with running_router(settings_for([pod])) as (base, services):
            async with httpx.AsyncClient(base_url=base) as c:
                r = await c.post("/tokenize", json=body_for("/tokenize", "m"))
            assert r.status_code == 502 and "failed mid-response" in r.json()["error"]["message"]
            assert requests_metric(services, "a", "502") == 1
    finally:
        await pod.stop()


async def test_a_client_that_leaves_cancels_the_pod_s_request():
    async with pass_pods(("a", "m", ()), first_delay=5.0) as pods, \
            running_router(settings_for(pods)) as (base, services):
        async with httpx.AsyncClient(base_url=base, timeout=0.5) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/v1/embeddings", json=body_for("/v1/embeddings", "m"))
        await until(lambda: pods[0].cancelled == 1, what="the pod to see the router leave")
        await until(lambda: requests_metric(services, "a", "499") == 1, what="the 499 counted")
        assert services.metrics.client_disconnects._value.get() == 1
