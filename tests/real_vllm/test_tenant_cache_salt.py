"""An API key's ``cache_salt`` against a real engine: two tenants' identical prompts never share the
engine's prefix cache, and the router credits each tenant exactly what the engine then hits."""

from __future__ import annotations

import os

import httpx

from realvllm.engines import BLOCK_SIZE, MODEL_NAME, router_pod
from tests.real_vllm.conftest import engine_metric, running_router, wait_for

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 5 + i * (seed + 2)) % len(WORDS)] for i in range(words))


def hits(url: str) -> float:
    return engine_metric(url, "vllm:prefix_cache_hits_total")


def test_two_tenants_never_share_an_engines_prefix_cache(agg_engines, real_env, tmp_path):
    engine = agg_engines[0]
    salt_a, salt_b = os.urandom(16).hex(), os.urandom(16).hex()   # fresh: nothing of an earlier run is cached
    keys = [{"key": "sk-a", "name": "tenant-a", "cache_salt": salt_a},
            {"key": "sk-a-ops", "name": "tenant-a-ops", "cache_salt": salt_a, "admin": True},
            {"key": "sk-b", "name": "tenant-b", "cache_salt": salt_b},
            {"key": "sk-b-ops", "name": "tenant-b-ops", "cache_salt": salt_b, "admin": True}]
    # every prompt through the tokenize process (its keys take the derived salt as the loop's do)
    with running_router(tmp_path, [router_pod(engine)], tokenizer=str(real_env.tokenizer), speculative_ttl_s=0.05,
                        api_keys=keys, tokenize_offload_bytes=1, tokenize_inline_chars=0) as base, \
            httpx.Client(base_url=base, timeout=120) as c:

        def send(key: str, body: dict) -> tuple[httpx.Response, float]:
            before = hits(engine.url)
            r = c.post("/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            return r, hits(engine.url) - before

        def credited(key: str, body: dict) -> int:
            r = c.post("/debug/route", json=body, headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            assert salt_a not in r.text and salt_b not in r.text
            return int(sum(r.json()["pods"][0]["cached_tokens_by_tier"].values()))

        prefix = text(11, 600)
        first = {"model": MODEL_NAME, "prompt": prefix, "max_tokens": 2}
        r, cold = send("sk-a", first)
        stored = r.json()["usage"]["prompt_tokens"]
        follow = {"model": MODEL_NAME, "prompt": prefix + " " + text(12, 200), "max_tokens": 2}
        need = max(1, stored // BLOCK_SIZE - 1) * BLOCK_SIZE   # its full blocks but the last (split anew)
        wait_for(lambda: credited("sk-a-ops", follow) >= need, 15, f"tenant A's {need} tokens indexed")
        seen = {}
        for tenant in ("b", "a"):   # B first: A's own follow-up must not be what B could meet
            predicted = credited(f"sk-{tenant}-ops", follow)
            _, hit = send(f"sk-{tenant}", follow)
            seen[tenant] = (predicted, hit)
        print(f"tenant A's first prompt: {stored} tokens, {cold:g} hit; follow-up (router credited, engine "
              f"hit) by tenant: {seen}")
        assert cold == 0
        assert seen["b"] == (0, 0)
        assert seen["a"][0] == seen["a"][1] >= need
    logged = "".join(p.read_text(errors="replace") for p in tmp_path.glob("router-*.log"))
    assert logged and salt_a not in logged and salt_b not in logged, "a cache_salt secret in the router's log"
