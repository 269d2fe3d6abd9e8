"""The router's prefix index against what real vLLM engines report of their own prefix cache."""

from __future__ import annotations

import httpx

from realvllm.engines import MODEL_NAME, router_pod
from tests.real_vllm.conftest import cached_tokens, engine_metric, running_router, wait_indexed

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * (seed + 3)) % len(WORDS)] for i in range(words))


def hits(url: str) -> float:
    return engine_metric(url, "vllm:prefix_cache_hits_total")


def test_completion_prefix_credited_as_the_engine_hits_it(agg_engines, real_env, tmp_path):
    pods = [router_pod(e) for e in agg_engines]
    with running_router(tmp_path, pods, tokenizer=str(real_env.tokenizer), speculative_ttl_s=0.05) as base:
        prefix = text(1, 700)
        first = {"model": MODEL_NAME, "prompt": prefix, "max_tokens": 2}
        r = httpx.post(base + "/v1/completions", json=first, timeout=60)
        assert r.status_code == 200, r.text
        pod = r.headers["x-kvroute-pod"]
        url = next(e.url for e in agg_engines if e.name == pod)
        follow = {"model": MODEL_NAME, "prompt": prefix + " " + text(2, 300), "max_tokens": 2}
        predicted = wait_indexed(base, follow, pod, r.json()["usage"]["prompt_tokens"])
        before = hits(url)
        r = httpx.post(base + "/v1/completions", json=follow, timeout=60)
        assert r.status_code == 200 and r.headers["x-kvroute-pod"] == pod
        observed = hits(url) - before
        print(f"prompt tokens {r.json()['usage']['prompt_tokens']}, router credited {predicted}, engine hit {observed}")
        assert observed > 0
        assert predicted == observed


def test_cache_salt_keys_a_prompt_apart_as_the_engine_does(agg_engines, real_env, tmp_path):
    """vLLM folds ``cache_salt`` into the first block's hash (and announces it in that block's
    ``extra_keys``): a salted prompt is a hit only for the same salt. The router keys it the same way,
    so it credits the same salt's prefix and nothing of another salt's or of the unsalted prompt."""
    pods = [router_pod(e) for e in agg_engines]
    with running_router(tmp_path, pods, tokenizer=str(real_env.tokenizer), speculative_ttl_s=0.05) as base:
        prefix = text(5, 600)
        first = {"model": MODEL_NAME, "prompt": prefix, "max_tokens": 2, "cache_salt": "tenant-a"}
        r = httpx.post(base + "/v1/completions", json=first, timeout=60)
        assert r.status_code == 200, r.text
        pod = r.headers["x-kvroute-pod"]
        url = next(e.url for e in agg_engines if e.name == pod)
        follow = {"model": MODEL_NAME, "prompt": prefix + " " + text(6, 200), "max_tokens": 2}
        wait_indexed(base, {**follow, "cache_salt": "tenant-a"}, pod, r.json()["usage"]["prompt_tokens"])
        seen = {}
        for salt in ("tenant-b", None, "tenant-a"):   # the same salt last: the others must not be hits
            body = follow if salt is None else {**follow, "cache_salt": salt}
            credited = cached_tokens(base, body, pod)
            before = hits(url)
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            seen[salt] = (credited, hits(url) - before)
        print(f"salted prefix: (router credited, engine hit) by salt {seen}")
        assert seen["tenant-b"] == (0, 0) and seen[None] == (0, 0)
        assert seen["tenant-a"][0] == seen["tenant-a"][1] > 0
