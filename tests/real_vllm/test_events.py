"""KV events from real engines into the router's index: live, replayed on connect, after a
prefix-cache reset (AllBlocksCleared), under eviction (BlockRemoved), and across an engine restart.

Each test compares what the router credits a pod for a prompt (``/debug/route``) with what the
engine then reports as a prefix-cache hit for it (``vllm:prefix_cache_hits_total``), so a wrong
reading of vLLM's events fails here even when our own simulator agrees with it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from realvllm.engines import MODEL_NAME, restart, router_pod
from tests.helpers import metric
from tests.real_vllm.conftest import cached_tokens, engine_metric, running_router, wait_for

WORDS = ("kilo lima mike november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu "
         "amber basalt cobalt dune ember fjord garnet harbor").split()


def text(tag: str, words: int) -> str:
    """Distinct per ``tag`` from its first word on, so tests sharing an engine never share a prefix."""
    h = sum(ord(c) * 31 ** i for i, c in enumerate(tag))
    return f"[{tag}] " + " ".join(WORDS[(h + i * (h % 7 + 2)) % len(WORDS)] for i in range(words))


def completion(prompt: str, max_tokens: int = 2) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def send(url: str, body: dict) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def hits_for(url: str, body: dict) -> float:
    """Send ``body`` straight to the engine; the prefix-cache hits it reported for it."""
    before = engine_metric(url, "vllm:prefix_cache_hits_total")
    send(url, body)
    return engine_metric(url, "vllm:prefix_cache_hits_total") - before


def index_blocks(base: str, pod: str) -> float:
    return metric(base, "kvroute_pod_index_blocks", pod=pod)


def test_router_started_after_the_engine_catches_up_from_replay(agg_engines, real_env, tmp_path):
    """Blocks the engine cached before the router existed are learnt from its replay socket."""
    engine = agg_engines[0]
    prompt = text("replay", 400)
    send(engine.url, completion(prompt))  # nobody is subscribed yet
    follow = completion(prompt + " " + text("replay-2", 200))
    with running_router(tmp_path, [router_pod(e) for e in agg_engines], tokenizer=str(real_env.tokenizer),
                        speculative_ttl_s=0.05) as base:
        wait_for(lambda: cached_tokens(base, follow, engine.name) > 0, 15, "catch-up from the replay socket")
        credited = cached_tokens(base, follow, engine.name)
        observed = hits_for(engine.url, follow)
        print(f"credited {credited}, engine hit {observed}")
        assert credited == observed > 0


def test_prefix_cache_reset_empties_the_pods_index(agg_engines, real_env, tmp_path):
    """``/reset_prefix_cache`` makes the engine publish AllBlocksCleared; the pod's entries go."""
    engine = agg_engines[0]
    with running_router(tmp_path, [router_pod(e) for e in agg_engines], tokenizer=str(real_env.tokenizer),
                        speculative_ttl_s=0.05) as base:
        prompt = completion(text("reset", 400))
        send(engine.url, prompt)
        wait_for(lambda: cached_tokens(base, prompt, engine.name) > 0, 10, "the prompt indexed")
        assert index_blocks(base, engine.name) > 0
        r = httpx.post(engine.url + "/reset_prefix_cache", timeout=30)
        assert r.status_code == 200, r.text
        send(engine.url, completion(text("reset-step", 10)))  # the event goes out on the engine's next step
        wait_for(lambda: cached_tokens(base, prompt, engine.name) == 0, 10, "the index emptied")
        assert hits_for(engine.url, prompt) == 0  # the engine agrees: nothing of it was left


def test_eviction_removes_entries_as_the_engine_evicts(agg_engines, real_env, tmp_path):
    """With 256 blocks of KV cache, later prompts evict an earlier one (BlockRemoved); the router's
    credit for it then matches what the engine still holds."""
    engine = agg_engines[1]
    with running_router(tmp_path, [router_pod(e) for e in agg_engines], tokenizer=str(real_env.tokenizer),
                        speculative_ttl_s=0.05) as base:
        victim = completion(text("victim", 500))
        send(engine.url, victim)
        wait_for(lambda: cached_tokens(base, victim, engine.name) > 0, 10, "the victim indexed")
        full = cached_tokens(base, victim, engine.name)
        # about 10,000 tokens (500 words are about 1,700 tokens), more than the engine's 8,192-token cache can keep
        for i in range(6):
            send(engine.url, completion(text(f"evict-{i}", 500)))
        wait_for(lambda: cached_tokens(base, victim, engine.name) < full, 10, "the victim's blocks removed")
        credited = cached_tokens(base, victim, engine.name)
        observed = hits_for(engine.url, victim)
        print(f"victim: {full} tokens credited before eviction, {credited} after; engine hit {observed}")
        assert credited == observed


def index_count(base: str, kind: str) -> float:
    return metric(base, "kvroute_index_operations_total", kind=kind)


def test_idle_blocks_go_in_the_order_they_were_freed_and_come_back_announced(agg_engines, real_env, tmp_path):
    """What the router's eviction model (indexer/recency.py) assumes of vLLM, checked on a real engine:
    a finished request's blocks wait in an LRU free queue, freed tail block first, and are evicted from
    its head; so an earlier prompt loses its blocks before a later one, from its last block backwards;
    and a prompt computed again after its eviction is announced again (BlockStored under the same
    keys), which is what the router's self-check of its eviction expectations watches for."""
    engine = agg_engines[1]
    with running_router(tmp_path, [router_pod(e) for e in agg_engines], tokenizer=str(real_env.tokenizer),
                        speculative_ttl_s=0.05) as base:
        older, newer = completion(text("freed-first", 300)), completion(text("freed-later", 300))
        send(engine.url, older)
        send(engine.url, newer)
        wait_for(lambda: cached_tokens(base, newer, engine.name) > 0, 10, "both prompts indexed")
        full_older, full_newer = cached_tokens(base, older, engine.name), cached_tokens(base, newer, engine.name)
        # small requests take about one block each from the head of the free queue
        started, fillers = time.monotonic(), 0
        while cached_tokens(base, older, engine.name) == full_older:
            assert fillers < 600 and time.monotonic() - started < 300, "the older prompt was never evicted"
            send(engine.url, completion(f"filler {fillers} {text('order', 6)}", max_tokens=1))
            fillers += 1
        left_older, left_newer = cached_tokens(base, older, engine.name), cached_tokens(base, newer, engine.name)
        print(f"after {fillers} fillers: older {left_older} of {full_older} credited, newer {left_newer} "
              f"of {full_newer}")
        assert left_newer == full_newer          # freed later: still whole
        assert 0 < left_older < full_older       # freed first, and from its tail: its head is still there
        assert hits_for(engine.url, completion(text("freed-first", 300))) == left_older
        # the hit just recomputed the older prompt's lost tail: the engine announces those blocks again
        wait_for(lambda: cached_tokens(base, older, engine.name) == full_older, 10, "the tail announced again")


def test_a_block_computed_twice_stays_credited_until_its_last_copy_is_evicted(agg_engines, real_env, tmp_path):
    """Two identical greedy requests decoding side by side fill identical output blocks: vLLM keeps both
    copies under one hash, announces each (BlockStored twice) and removes each on its own eviction. The
    router counts copies, so evicting the first copy leaves the prefix credited, as the engine still
    hits it through the second."""
    engine = agg_engines[0]
    with running_router(tmp_path, [router_pod(e) for e in agg_engines], tokenizer=str(real_env.tokenizer),
                        speculative_ttl_s=0.05) as base:
        twin = {**completion(text("twins", 300), max_tokens=160), "ignore_eos": True, "return_token_ids": True}
        copies = index_count(base, "duplicate_copies")
        with ThreadPoolExecutor(2) as pool:
            a, b = (r.json()["choices"][0] for r in pool.map(lambda body: send(engine.url, body), [twin, twin]))
        assert a["token_ids"] == b["token_ids"], "greedy twins decoded differently"
        follow = {"model": MODEL_NAME, "prompt": a["prompt_token_ids"] + a["token_ids"], "max_tokens": 2,
                  "temperature": 0}
        wait_for(lambda: index_count(base, "duplicate_copies") > copies, 10, "the second copies announced")
        full = cached_tokens(base, follow, engine.name)
        # 35-token requests evict about one cached block each from the head of the free queue, where the
        # first twin's output blocks went when it finished, ahead of the second's (a full block, cached,
        # and a partial one; vLLM frees an uncached block to the head, so the next request reuses it)
        removed, started, fillers = index_count(base, "copies_removed"), time.monotonic(), 0
        # (stop when the router counts a copy removed, or when its credit drops: without copies counted
        # it would drop at the first copy's removal, which this test exists to catch)
        while index_count(base, "copies_removed") == removed and cached_tokens(base, follow, engine.name) == full:
            assert fillers < 400 and time.monotonic() - started < 240, "no copy was evicted"
            send(engine.url, completion(f"filler {fillers} {text('filler', 6)}", max_tokens=1))
            fillers += 1
        credited = cached_tokens(base, follow, engine.name)
        observed = hits_for(engine.url, follow)
        print(f"twins: {len(a['token_ids'])} output tokens, {index_count(base, 'duplicate_copies') - copies:.0f} "
              f"copies announced; after {fillers} fillers: credited {credited} "
              f"(of {full}), engine hit {observed}")
        assert credited == observed
        assert observed > len(a["prompt_token_ids"])   # past the prompt: the output blocks' survivors


def test_engine_restart_clears_the_pod_and_rebuilds_it(agg_engines, real_env, tmp_path):
    """An engine killed and started again comes back with an empty cache and sequence numbers from 0:
    the router clears the pod on its first new batch (not on a health timeout, which is set out of
    reach here) and indexes what it caches from then on."""
    engine = agg_engines[1]
    with running_router(tmp_path, [router_pod(e) for e in agg_engines], tokenizer=str(real_env.tokenizer),
                        speculative_ttl_s=0.05, forget_after_s=3600, event_silence_s=0) as base:
        before = completion(text("before-restart", 400))
        send(engine.url, before)
        wait_for(lambda: cached_tokens(base, before, engine.name) > 0, 10, "the prompt indexed")
        engine.kill()
        restart(engine)
        # the router marked the pod unhealthy while it was down, and /debug/route lists only healthy
        # pods: wait for its next health check to take it back before asking about its cache
        wait_for(lambda: httpx.get(base + "/ready", timeout=10).json().get("healthy_pods") == len(agg_engines),
                 15, "the restarted pod healthy again")
        after = completion(text("after-restart", 400))
        send(engine.url, after)
        wait_for(lambda: cached_tokens(base, before, engine.name) == 0, 15, "the pod's old entries cleared")
        wait_for(lambda: cached_tokens(base, after, engine.name) > 0, 15, "the new prompt indexed")
        follow = completion(after["prompt"] + " " + text("after-restart-2", 200))
        credited = cached_tokens(base, follow, engine.name)
        observed = hits_for(engine.url, follow)
        print(f"after restart: credited {credited}, engine hit {observed}")
        assert credited == observed > 0
        assert hits_for(engine.url, before) == 0  # the engine lost it too
