"""``tokenizer: remote``: the router asks a pod of the fleet (``POST /tokenize``) for prompt ids.

Real ``kvroute sim`` pods (their /tokenize applies the same chat template as their engine, and they
publish real KV events) behind the real app; a recording aiohttp pod whose /tokenize fails or
stalls shows that tokenizing never costs the client its answer.
"""

from __future__ import annotations

import asyncio

import httpx
from aiohttp import web

from kvcommon.settings import build_settings
from router.config import RouterSettings
from simulator.testing import consecutive_free_ports, running_sims
from tests.helpers import free_port, serve_routes
from tests.test_e2e_router import fleet
from tests.test_router_api import Pod, completion, running_router, settings_for


def _remote_stats(services) -> tuple[int, int]:
    toks = services.remote_prompts._by_pod.values()
    return sum(t.hits for t in toks), sum(t.misses for t in toks)


def _failures(text: str, reason: str) -> float:
    name = f'kvroute_tokenize_failures_total{{reason="{reason}"}}'
    line = next((ln for ln in text.splitlines() if ln.startswith(name)),
                None)
    return float(line.split()[-1]) if line else 0.0


async def test_chat_follow_up_lands_on_the_pod_holding_its_prefix_with_pod_tokenized_prompts():
    events = consecutive_free_ports(6)
    with running_sims(3, ["--enable-prompt-tokens-details",
                          "--timing", "seed", "--kv-events-port", str(events), "--block-size", "16"]) as urls:
        settings = build_settings(RouterSettings, {
            "pods": fleet(urls, events), "port": free_port(), "tokenizer": "remote", "speculative_ttl_s": 0.2,
            "scrape_interval_s": 0.1, "health_interval_s": 0.2})
        async with running_router(settings) as (base, services):
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                messages = [{"role": "system", "content": "You answer in one line. " * 30},
                            {"role": "user", "content": "What is a KV cache?"}]
                r = await c.post("/v1/chat/completions", json={"model": "sim-model", "messages": messages,
                                                               "max_tokens": 6})
                assert r.status_code == 200, r.text
                first = r.headers["x-kvroute-pod"]
                answer = r.json()["choices"][0]["message"]["content"]
                hits, misses = _remote_stats(services)
                assert misses == 1 and hits == 0  # one round trip to a pod's /tokenize
                await asyncio.sleep(0.5)  # speculative credit expires: only the pod's own events remain

                follow = messages + [{"role": "assistant", "content": answer},
                                     {"role": "user", "content": "And why does it help?"}]
                body = {"model": "sim-model", "messages": follow, "max_tokens": 4}
                explained = (await c.post("/debug/route", json=body)).json()
                row = next(p for p in explained["pods"] if p["pod"] == first)
                assert row["cached_tokens_by_tier"].get("GPU", 0) >= 700
                assert all(p["cached_tokens_by_tier"].get("GPU", 0) == 0
                           for p in explained["pods"] if p["pod"] != first)
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.headers["x-kvroute-pod"] == first
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 700
                hits, misses = _remote_stats(services)
                assert misses == 2 and hits == 1  # /debug/route and the request shared one answer
                # the ids are the pod's: the router counts as many prompt tokens as the pod reports
                assert explained["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
                # token-id prompts need no round trip
                r = await c.post("/v1/completions",
                                 json={"model": "sim-model", "prompt": [1, 2, 3, 4], "max_tokens": 2})
                assert r.status_code == 200
                assert _remote_stats(services) == (1, 2)
                assert _failures((await c.get("/metrics")).text, "error") == 0


class TokenizeFailingPod(Pod):
    """A recording pod whose /tokenize answers 500 (``stall`` False) or stalls for seconds."""

    stall: bool = False
    tokenize_calls: int = 0

    def routes(self, app: web.Application) -> None:
        super().routes(app)
        app.router.add_post("/tokenize", self.tokenize)

    async def tokenize(self, request: web.Request) -> web.Response:
        self.tokenize_calls += 1
        await request.read()
        if self.stall:
            await asyncio.sleep(3)
        return web.json_response({"error": {"message": "tokenizer broke", "type": "InternalServerError", "code": 500}},
                                 status=500)


async def test_a_failing_or_stalled_tokenize_still_serves_the_request_and_counts_it():
    pods = [TokenizeFailingPod(f"pod-{i}", free_port()) for i in range(2)]
    for p in pods:
        await p.start()
    try:
        settings = settings_for(pods, tokenizer="remote", remote_tokenize_timeout_s=0.2)
        async with running_router(settings) as (base, services):
            async with httpx.AsyncClient(base_url=base, timeout=10) as c:
                r = await c.post("/v1/completions", json=completion(prompt="a prompt the pod cannot tokenize"))
                assert r.status_code == 200, r.text
                assert r.headers["x-pod-name"] in ("pod-0", "pod-1")
                r = await c.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2,
                                                               "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 200, r.text
                assert sum(p.tokenize_calls for p in pods) == 2
                assert pods[0].tokenize_calls == 2  # always the same pod of the fleet is asked
                text = (await c.get("/metrics")).text
                assert _failures(text, "error") == 2
                explained = (await c.post("/debug/route", json=completion(prompt="x" * 400))).json()
                assert explained["blocks"] == 0  # no prefix lookup without the pod's ids
                assert explained["prompt_tokens"] == 100  # a length estimate stands in

                for p in pods:
                    p.stall = True
                loop = asyncio.get_running_loop()
                started = loop.time()
                r = await c.post("/v1/completions", json=completion(prompt="another prompt"))
                assert r.status_code == 200, r.text
                assert loop.time() - started < 2.5  # the deadline cut the stalled /tokenize short
                assert _failures((await c.get("/metrics")).text, "timeout") == 1
                # a malformed prompt is still the client's error, not a tokenize failure
                r = await c.post("/v1/completions", json={"model": "m", "prompt": 5})
                assert r.status_code == 400
                assert r.json()["error"]["param"] == "prompt"
    finally:
        for p in pods:
            await p.stop()


async def test_a_chat_request_with_an_image_is_forwarded_without_cache_credit():
    """A multimodal chat request (an image part) was a 400 from a router with a local tokenizer; vLLM
    serves it on a multimodal model. It is routed now, on its text's length, with no block keys."""
    from tests.test_router_api import pods_running

    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "describe this picture in detail " * 20},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
    async with pods_running(1) as pods, running_router(settings_for(pods, block_size=16)) as (base, _):
        async with httpx.AsyncClient(base_url=base, timeout=10) as c:
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            explained = (await c.post("/debug/route", json=body)).json()
            assert explained["blocks"] == 0 and explained["prompt_tokens"] > 600
            # a completion of prompt embeddings alone (vLLM's --enable-prompt-embeds): routed, unkeyed
            r = await c.post("/v1/completions", json={"model": "m", "max_tokens": 2, "prompt_embeds": "AAAA"})
            assert r.status_code == 200, r.text


async def test_pod_tokenized_prompts_are_truncated_as_vllm_truncates_them():
    """vLLM's /tokenize does not truncate, its chat and completion endpoints do
    (``truncate_prompt_tokens``): the router cuts the pod's tokens itself, from the tokenizer's side
    (left, keeping the BOS the tokenizer adds) unless ``truncation_side`` says otherwise."""
    from indexer.tokens import RemoteTokenizer
    from router.remote_prompts import RemotePrompts

    seen: list[dict] = []

    async def tokenize(request: web.Request) -> web.Response:  # vLLM's /tokenize: BOS=1 when special tokens
        body = await request.json()
        seen.append(body)
        if "messages" in body:
            text, special = "|".join(m["content"] for m in body["messages"]), body.get("add_special_tokens", False)
        else:
            text, special = body["prompt"], body.get("add_special_tokens", True)
        ids = [1] * special + [10 + b for b in text.encode()]
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": 100})

    async with serve_routes(web.post("/tokenize", tokenize)) as port:
        async with httpx.AsyncClient() as client:
            remote = RemotePrompts(None, lambda: None, 5.0, 64, lambda reason: None)
            remote._tokenizer_for = lambda model: RemoteTokenizer(f"http://127.0.0.1:{port}", model, client)

            async def ids(kind: str, **body) -> list[int]:
                got = await remote.prompt_ids(kind, body, "m")
                assert got.exact
                return list(got.tokens)

            abc = [10 + b for b in b"abcdef"]
            assert await ids("completion", prompt="abcdef") == [1, *abc]
            assert await ids("completion", prompt="abcdef", truncate_prompt_tokens=3) == [1, *abc[-2:]]
            assert await ids("completion", prompt="abcdef", truncate_prompt_tokens=3,
                             truncation_side="left") == abc[-3:]
            assert await ids("completion", prompt="abcdef", truncate_prompt_tokens=3,
                             truncation_side="right") == [1, *abc[:2]]
            assert await ids("completion", prompt="abcdef", truncate_prompt_tokens=-1) == [1, *abc]
            assert await ids("completion", prompt=[5, 6, 7, 8], truncate_prompt_tokens=2) == [7, 8]
            msgs = [{"role": "user", "content": "abcdef"}]
            assert await ids("chat", messages=msgs, truncate_prompt_tokens=2) == abc[-2:]
            assert await ids("chat", messages=msgs, truncate_prompt_tokens=2, add_special_tokens=True) == [1, abc[-1]]
            # without truncation the body sent is the one sent before (the answers' cache keys)
            seen.clear()
            await ids("chat", messages=msgs)
            assert seen == [{"model": "m", "messages": msgs}]



class MultimodalPod(Pod):
    """A recording pod of a multimodal model: its /tokenize answers a chat with an image as vLLM's
    does, the same ids whatever the image (its placeholder tokens)."""

    def routes(self, app: web.Application) -> None:
        super().routes(app)
        app.router.add_post("/tokenize", self.tokenize)

    async def tokenize(self, request: web.Request) -> web.Response:
        await request.read()
        ids = list(range(1000, 1400))
        return web.json_response({"count": len(ids), "max_model_len": 4096, "tokens": ids})


async def test_pod_tokenized_chat_with_an_image_is_routed_on_its_length_without_block_keys():
    """vLLM hashes a block that holds an image's tokens with the image's hash too: the pod's /tokenize
    ids alone would key two requests that differ only in their image alike, and the second would be
    credited with the first's blocks. A pod-tokenized request with media parts is routed on the pod's
    count of its tokens, with no block keys, as a locally tokenized one is."""
    def body(image: str) -> dict:
        return {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "describe this picture in detail " * 20},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}]}]}

    pods = [MultimodalPod(f"pod-{i}", free_port()) for i in range(2)]
    for p in pods:
        await p.start()
    try:
        async with running_router(settings_for(pods, tokenizer="remote", block_size=16)) as (base, _):
            async with httpx.AsyncClient(base_url=base, timeout=10) as c:
                r = await c.post("/v1/chat/completions", json=body("AAAA"))
                assert r.status_code == 200, r.text
                explained = (await c.post("/debug/route", json=body("BBBB"))).json()
                assert explained["blocks"] == 0
                assert explained["prompt_tokens"] == 400  # the pod's count
                assert all(sum(p["cached_tokens_by_tier"].values()) == 0 for p in explained["pods"])
                # a text-only prompt is keyed on the pod's ids as before
                text_only = {**body("AAAA"), "messages": [{"role": "user", "content": "describe " * 100}]}
                assert (await c.post("/debug/route", json=text_only)).json()["blocks"] == 25
    finally:
        for p in pods:
            await p.stop()


async def test_pods_that_exclude_tools_for_tool_choice_none_are_asked_to_tokenize_without_them():
    """vLLM's --exclude-tools-when-tool-choice-none leaves the tools out of the chat endpoint's template
    for ``tool_choice: "none"``, but its /tokenize renders them: with the router's
    ``exclude_tools_when_tool_choice_none`` the router asks /tokenize without them in that case only."""
    import orjson

    class RecordingPod(MultimodalPod):
        asked: list = []

        async def tokenize(self, request: web.Request) -> web.Response:
            self.asked.append(orjson.loads(await request.read()))
            return web.json_response({"count": 3, "max_model_len": 4096, "tokens": [1, 2, 3]})

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    pods = [RecordingPod("pod-0", free_port())]
    for p in pods:
        await p.start()
    try:
        settings = settings_for(pods, tokenizer="remote", exclude_tools_when_tool_choice_none=True)
        async with running_router(settings) as (base, _):
            async with httpx.AsyncClient(base_url=base, timeout=10) as c:
                for choice in ("none", "auto"):
                    body = {"model": "m", "max_tokens": 2, "tools": [tool], "tool_choice": choice,
                            "messages": [{"role": "user", "content": f"tool choice {choice}"}]}
                    assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
        assert ["tools" in asked for asked in pods[0].asked] == [False, True]
    finally:
        for p in pods:
            await p.stop()
