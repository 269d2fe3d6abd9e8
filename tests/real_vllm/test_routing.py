"""Routing in front of two real engines: a conversation's follow-ups go where its prefix is cached."""

from __future__ import annotations

import asyncio
import json

import httpx

from realvllm.engines import MODEL_NAME, router_pod
from tests.real_vllm.conftest import engine_metric, running_router

SESSIONS = 6


def system_prompt(s: int) -> str:
    return f"You are helper {s} of the routing test. " + " ".join(f"rule {s}.{i}: answer in kind." for i in range(60))


async def turn(client: httpx.AsyncClient, messages: list[dict]) -> tuple[str, str]:
    r = await client.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, "max_tokens": 6,
                                                        "temperature": 0})
    assert r.status_code == 200, r.text
    return r.headers["x-kvroute-pod"], r.json()["choices"][0]["message"]["content"] or ""


def test_follow_ups_land_on_the_engine_holding_the_prefix(agg_engines, real_env, tmp_path):
    urls = {e.name: e.url for e in agg_engines}
    with running_router(tmp_path, [router_pod(e) for e in agg_engines], tokenizer=str(real_env.tokenizer),
                        policy="predicted-ttft") as base:

        async def conversations() -> tuple[dict[int, str], dict[int, list[str]]]:
            first: dict[int, str] = {}
            later: dict[int, list[str]] = {s: [] for s in range(SESSIONS)}
            histories: dict[int, list[dict]] = {}
            async with httpx.AsyncClient(base_url=base, timeout=120) as c:
                async def open_session(s: int) -> None:
                    messages = [{"role": "system", "content": system_prompt(s)},
                                {"role": "user", "content": f"First question of session {s}?"}]
                    first[s], answer = await turn(c, messages)
                    histories[s] = messages + [{"role": "assistant", "content": answer}]

                await asyncio.gather(*(open_session(s) for s in range(SESSIONS)))
                for k in range(2):
                    for s in range(SESSIONS):
                        histories[s].append({"role": "user", "content": f"Follow-up {k} of session {s}?"})
                        pod, answer = await turn(c, histories[s])
                        later[s].append(pod)
                        histories[s].append({"role": "assistant", "content": answer})
            return first, later

        hits_before = {n: engine_metric(u, "vllm:prefix_cache_hits_total") for n, u in urls.items()}
        first, later = asyncio.run(conversations())
        hits = {n: engine_metric(u, "vllm:prefix_cache_hits_total") - hits_before[n] for n, u in urls.items()}
        print(f"first turns {first}; follow-ups {later}; engine hits {hits}")
        assert set(first.values()) == set(urls)  # both engines took conversations
        for s in range(SESSIONS):
            assert later[s] == [first[s]] * 2, f"session {s} left the engine holding its prefix"
        # every follow-up reused at least its system prompt on the engine that held it
        assert all(hits[n] >= 600 * list(first.values()).count(n) * 2 for n in urls)


def test_a_body_declared_as_another_type_reaches_the_engine_as_json(agg_engines, real_env, tmp_path):
    """vLLM refuses a completion whose Content-Type is not application/json (400); the router has read
    the body as JSON and says so upstream, so `curl -d` (form-urlencoded) or no type at all is served."""
    body = json.dumps({"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 2}).encode()
    direct = httpx.post(agg_engines[0].url + "/v1/completions", content=body, timeout=120,
                        headers={"content-type": "application/x-www-form-urlencoded"})
    assert direct.status_code == 400 and "application/json" in direct.text, direct.text
    with running_router(tmp_path, [router_pod(e) for e in agg_engines], tokenizer=str(real_env.tokenizer)) as base:
        for declared in ("application/x-www-form-urlencoded", "text/plain", None):
            headers = {"content-type": declared} if declared else {}
            r = httpx.post(base + "/v1/completions", content=body, headers=headers, timeout=120)
            assert r.status_code == 200, (declared, r.text)
            assert r.json()["usage"]["completion_tokens"] == 2
