"""How a real engine's prefix cache behaves where the simulator must behave the same.

vLLM registers a request's blocks in its prefix cache when it schedules them, for the tokens the step
will compute (``KVCacheManager.allocate_slots`` calls ``cache_blocks``), not when the step has
computed them. The simulator's ``CostCore`` copies that (``_cache_full_blocks``); these tests hold
the claim against the real engine, whose figures are ``vllm:prefix_cache_hits_total``.
"""

from __future__ import annotations

import time

import httpx

from realvllm.engines import BLOCK_SIZE, MODEL_NAME
from tests.real_vllm.conftest import engine_metric, running_router

CPU_STEP_TOKENS = 2048  # vLLM's default max_num_batched_tokens for an API server on CPU (0.32)


def test_a_request_behind_a_chunked_prefill_reuses_the_chunk_scheduled_in_the_same_step(agg_engines):
    """Two copies of one 3,000-token prompt in one call: A's first step takes the whole budget (2,048
    tokens); in the second, A's last 952 tokens are scheduled and B, behind it, finds all of A's full
    blocks cached, the ones that step is computing included. Blocks cached only once computed would
    have left B the 2,048 of the first step."""
    engine = agg_engines[0]
    n = 3000
    ids = [2 + (i * 7919 + 104729) % 2800 for i in range(n)]  # a prompt no other test sends
    reusable = (n - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last prompt token is always computed
    assert CPU_STEP_TOKENS < n and reusable - CPU_STEP_TOKENS >= BLOCK_SIZE
    before = engine_metric(engine.url, "vllm:prefix_cache_hits_total")
    r = httpx.post(engine.url + "/v1/completions", timeout=120,
                   json={"model": MODEL_NAME, "prompt": [ids, ids], "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    hits = engine_metric(engine.url, "vllm:prefix_cache_hits_total") - before
    print(f"prefix-cache hits {hits:.0f}: reusable {reusable}, first step {CPU_STEP_TOKENS}")
    assert hits == reusable


def test_an_engine_holds_at_most_its_kv_blocks_and_the_router_credits_no_more(agg_engines, real_env, tmp_path):
    """An engine's prefix cache holds at most ``num_gpu_blocks`` blocks and evicts the least recently
    used: after six 64-block prompts on a 256-block engine the first is gone and the last is whole.
    The router, with the engine as a pod without KV events, credits it from its own routes, capped at
    the ``num_gpu_blocks`` it scraped, so it predicts the same: nothing for the first prompt, all of
    the last (uncapped, it predicted the first whole)."""
    engine = agg_engines[0]
    n = 64 * BLOCK_SIZE
    prompts = [[2 + (i * 7919 + 31337 * (p + 1)) % 2800 for i in range(n)] for p in range(6)]
    pod = {"id": engine.name, "url": engine.url, "model": MODEL_NAME}  # no kv_events: indexed from routes
    with running_router(tmp_path, [pod], tokenizer=str(real_env.tokenizer)) as base:
        time.sleep(1.0)  # a few scrapes: the router has the engine's num_gpu_blocks
        with httpx.Client(base_url=base, timeout=120) as c:
            for ids in prompts:
                r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 1,
                                                    "temperature": 0})
                assert r.status_code == 200, r.text
            predicted = [next(row for row in c.post("/debug/route", json={"model": MODEL_NAME, "prompt": ids})
                              .json()["pods"] if row["pod"] == engine.name)["cached_tokens"]
                         for ids in (prompts[0], prompts[-1])]
    reusable = (n - 1) // BLOCK_SIZE * BLOCK_SIZE
    hits = []
    for ids in (prompts[-1], prompts[0]):  # the last first: a hit on it evicts nothing of the first's
        before = engine_metric(engine.url, "vllm:prefix_cache_hits_total")
        r = httpx.post(engine.url + "/v1/completions", timeout=120,
                       json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        hits.append(engine_metric(engine.url, "vllm:prefix_cache_hits_total") - before)
    print(f"router predicted {predicted} cached tokens (first, last); engine hits {hits} (last, first)")
    assert hits == [reusable, 0]
    assert predicted[0] == 0 and predicted[1] >= reusable


def test_a_request_for_prompt_logprobs_reads_no_cached_prefix_and_the_router_credits_none(
        agg_engines, real_env, tmp_path):
    """vLLM skips its prefix cache for a request that asks for prompt logprobs (its sampling params'
    ``skip_reading_prefix_cache``): the engine computes the whole prompt though it holds it. The
    router, which credits the engine with the prompt once it has served it, predicts no cached prefix
    for such a request either."""
    engine = agg_engines[0]
    n = 40 * BLOCK_SIZE
    ids = [2 + (i * 7919 + 271828) % 2800 for i in range(n)]  # a prompt no other test sends
    reusable = (n - 1) // BLOCK_SIZE * BLOCK_SIZE
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0}
    pod = {"id": engine.name, "url": engine.url, "model": MODEL_NAME}  # credited from its routes
    with running_router(tmp_path, [pod], tokenizer=str(real_env.tokenizer)) as base:
        with httpx.Client(base_url=base, timeout=120) as c:
            assert c.post("/v1/completions", json=body).status_code == 200

            def credited(extra: dict) -> int:
                rows = c.post("/debug/route", json={**body, **extra}).json()["pods"]
                return next(row for row in rows if row["pod"] == engine.name)["cached_tokens"]

            predicted = [credited({}), credited({"prompt_logprobs": 1}), credited({"echo": True, "logprobs": 1})]
    hits = []
    for extra in ({"prompt_logprobs": 1}, {"echo": True, "logprobs": 1}, {}):
        before = engine_metric(engine.url, "vllm:prefix_cache_hits_total")
        r = httpx.post(engine.url + "/v1/completions", timeout=120, json={**body, **extra})
        assert r.status_code == 200, r.text
        hits.append(engine_metric(engine.url, "vllm:prefix_cache_hits_total") - before)
    print(f"router predicted {predicted} cached tokens (plain, prompt_logprobs, echo+logprobs); "
          f"engine hits {hits} (prompt_logprobs, echo+logprobs, plain)")
    assert hits == [0, 0, reusable]
    assert predicted[0] >= reusable and predicted[1:] == [0, 0]
