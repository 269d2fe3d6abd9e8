"""End to end: simulated pods publishing real KV events over ZeroMQ, the real router in front."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

import httpx
import orjson
import pytest
import yaml

from kvcommon.settings import build_settings
from router.config import RouterSettings
from simulator.testing import consecutive_free_ports, running_sims
from tests.helpers import free_port, kvroute_process, serve_routes, until
from tests.test_router_api import running_router


def fleet(urls: list[str], events_base: int | None) -> list[dict]:
    pods = []
    for i, url in enumerate(urls):
        pod = {"id": f"sim-{i}", "url": url, "model": "sim-model"}
        if events_base is not None:
            pod["kv_events"] = [{"endpoint": f"tcp://127.0.0.1:{events_base + 2 * i}",
                                 "replay": f"tcp://127.0.0.1:{events_base + 2 * i + 1}"}]
        pods.append(pod)
    return pods


def test_follow_up_turn_lands_on_the_pod_holding_its_prefix(tmp_path):
    """A served `kvroute serve` (YAML fleet) keeps a conversation on the pod that cached it, from
    the pods' own KV events, while other conversations spread over the fleet."""
    events = consecutive_free_ports(8)
    # a slow prefill (about 0.2 s for a first turn) keeps the six first turns in flight together even
    # when a busy machine delays their sends, so the router's bookings are what spreads them
    with running_sims(4, ["--enable-prompt-tokens-details",
                          "--timing", "seed", "--kv-events-port", str(events), "--block-size", "16",
                          "--prefill-tokens-per-s", "4000"]) as urls:
        port = free_port()
        cfg = tmp_path / "router.yaml"
        cfg.write_text(yaml.safe_dump({"port": port, "pods": fleet(urls, events), "speculative_ttl_s": 0.2,
                                       "scrape_interval_s": 0.1, "prefill_tokens_per_s": 4000,
                                       "prediction_log_path": str(tmp_path / "predictions.jsonl")}))
        with kvroute_process(["serve", "--config", str(cfg)], ready_url=f"http://127.0.0.1:{port}/ready"):
            base = f"http://127.0.0.1:{port}"
            with httpx.Client(base_url=base, timeout=30) as c:
                # /ready needs one healthy pod; spreading needs all four in the candidate set
                asyncio.run(until(lambda: c.get("/ready").json().get("healthy_pods") == 4, 20, "all pods healthy"))
                first_pods: dict[int, str] = {}
                histories = {}

                async def first_turn(ac: httpx.AsyncClient, s: int) -> None:
                    messages = [{"role": "system", "content": f"You are assistant number {s}. " + "Be brief. " * 60},
                                {"role": "user", "content": f"Question one of session {s}?"}]
                    r = await ac.post("/v1/chat/completions", json={"model": "sim-model", "messages": messages,
                                                                    "max_tokens": 8, "stream": True})
                    assert r.status_code == 200
                    first_pods[s] = r.headers["x-kvroute-pod"]
                    chunks = [orjson.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
                    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch.get("choices"))
                    histories[s] = messages + [{"role": "assistant", "content": text}]

                async def first_turns() -> None:
                    async with httpx.AsyncClient(base_url=base, timeout=30) as ac:
                        await asyncio.gather(*(first_turn(ac, s) for s in range(6)))

                asyncio.run(first_turns())  # sent together, so booked work spreads them
                assert len(set(first_pods.values())) >= 3  # new conversations spread out
                # the prediction log has a line per streamed first turn: where, what was predicted, what came
                lines = [orjson.loads(ln) for ln in (tmp_path / "predictions.jsonl").read_bytes().splitlines()]
                assert sorted(ln["pod"] for ln in lines) == sorted(first_pods.values())
                assert all(ln["observed_s"] > 0 and ln["predicted_s"] > 0 and ln["work_tokens"] > 0 for ln in lines)
                time.sleep(0.5)  # speculative credit (0.2 s) expires: only real events remain
                metrics = c.get("/metrics").text
                # kvroute serve moved its start-up heap (~78,000 objects) out of full collections
                frozen = re.search(r"^kvroute_gc_frozen_objects (\S+)$", metrics, re.M)
                assert frozen is not None and float(frozen.group(1)) > 10_000
                for pod in set(first_pods.values()):
                    line = next(ln for ln in metrics.splitlines()
                                if ln.startswith(f'kvroute_pod_index_blocks{{pod="{pod}"}}'))
                    assert float(line.split()[-1]) > 0
                for s, history in histories.items():
                    follow = history + [{"role": "user", "content": "And a follow-up?"}]
                    body = {"model": "sim-model", "messages": follow, "max_tokens": 4}
                    explained = c.post("/debug/route", json=body).json()
                    row = next(p for p in explained["pods"] if p["pod"] == first_pods[s])
                    assert row["cached_tokens_by_tier"].get("GPU", 0) >= 400
                    r = c.post("/v1/chat/completions", json=body)
                    assert r.status_code == 200
                    assert r.headers["x-kvroute-pod"] == first_pods[s]
                    # the pod agrees it served the prefix from cache
                    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 400


async def test_calibration_converges_on_a_pod_of_known_speed():
    rate = 4000.0
    sim_args = ["--timing", "seed", "--prefill-tokens-per-s", str(rate), "--decode-s-per-token", "0.001"]
    with running_sims(1, sim_args) as urls:
        settings = build_settings(RouterSettings, {"pods": fleet(urls, None), "port": free_port(),
                                                   "prefill_tokens_per_s": 20000.0, "calibration_halflife": 20})
        async with running_router(settings) as (base, services):
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                for i in range(24):
                    n = 200 + (i % 6) * 250  # 200..1450 new tokens, each prompt unique
                    prompt = f"{i:04d}" + "x" * n
                    r = await c.post("/v1/completions", json={"model": "sim-model", "prompt": prompt,
                                                              "max_tokens": 1, "stream": True})
                    assert r.status_code == 200
        cal = services.router.calibrator.pod("sim-0")
        assert cal.samples == 24
        assert abs(cal.rate - rate) / rate < 0.25, cal.rate


@pytest.mark.parametrize("pod_block_size", [16, 32])
async def test_a_pod_without_events_is_credited_at_most_the_kv_blocks_it_reports(pod_block_size):
    """A pod without KV events is indexed from the router's own routes; once a scrape gives its
    ``num_gpu_blocks`` (vllm:cache_config_info), the index keeps at most that many of its blocks, the
    first-routed prompt going first, as the engine's LRU would evict it. The pod's blocks may be
    larger than the router's: 16 of 32 tokens hold what 32 of 16 do."""
    blocks = 512 // pod_block_size
    with running_sims(1, ["--timing", "seed", "--block-size", str(pod_block_size),
                          "--num-gpu-blocks", str(blocks)]) as urls:
        settings = build_settings(RouterSettings, {"pods": fleet(urls, None), "port": free_port(),
                                                   "scrape_interval_s": 0.1, "block_size": 16})
        async with running_router(settings) as (base, services):
            pod = services.registry.pods["sim-0"]
            await until(lambda: pod.num_gpu_blocks == blocks, 10, "the pod's num_gpu_blocks scraped")
            prompts = [f"{i:03d}" + "abcdefgh" * 16 for i in range(6)]  # 131 tokens: 8 full blocks each
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                for prompt in prompts:
                    r = await c.post("/v1/completions", json={"model": "sim-model", "prompt": prompt, "max_tokens": 1})
                    assert r.status_code == 200
                explain = [(await c.post("/debug/route", json={"model": "sim-model", "prompt": p})).json()
                           for p in (prompts[0], prompts[-1])]
            held = services.index.pod_stats("sim-0")["predicted"]
            assert 30 <= held <= 32  # 48 credited; a sixteenth of the 32 under it after an eviction
            cached = [next(row for row in e["pods"] if row["pod"] == "sim-0")["cached_tokens"] for e in explain]
            assert cached[0] == 0 and cached[1] == 128


async def test_unhealthy_pod_leaves_the_candidate_set_and_its_entries_age_out():
    with running_sims(1, ["--enable-prompt-tokens-details",
                          "--timing", "seed"]) as alive, contextlib.ExitStack() as stack:
        doomed = stack.enter_context(running_sims(1, ["--enable-prompt-tokens-details", "--timing", "seed"]))
        settings = build_settings(RouterSettings, {"pods": fleet(alive + doomed, None), "port": free_port(),
                                                   "health_interval_s": 0.1, "unhealthy_after": 1,
                                                   "forget_after_s": 0.3, "policy": "round-robin"})
        async with running_router(settings) as (base, services):
            async with httpx.AsyncClient(base_url=base, timeout=10) as c:
                served = set()
                for i in range(2):
                    r = await c.post("/v1/completions", json={"model": "sim-model", "prompt": f"{i}" * 64,
                                                              "max_tokens": 1})
                    assert r.status_code == 200
                    served.add(r.headers["x-kvroute-pod"])
                assert served == {"sim-0", "sim-1"}
                assert services.index.pod_stats("sim-1")["predicted"] > 0
                stack.close()  # sim-1's process goes away
                deadline = time.monotonic() + 5
                while not services.registry.pods["sim-1"].forgotten and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert not services.registry.pods["sim-1"].healthy
                assert services.index.pod_stats("sim-1")["predicted"] == 0
                for i in range(4):
                    r = await c.post("/v1/completions", json={"model": "sim-model", "prompt": f"{i} " * 40,
                                                              "max_tokens": 1})
                    assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "sim-0"


def test_several_worker_processes_serve_on_one_port():
    with running_sims(2, ["--enable-prompt-tokens-details", "--timing", "seed"]) as urls:
        port = free_port()
        pods = orjson.dumps(fleet(urls, None)).decode()
        with kvroute_process(["serve", "--port", str(port), "--workers", "2", "--pods", pods],
                             ready_url=f"http://127.0.0.1:{port}/ready", timeout=30):
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
                for i in range(8):
                    r = c.post("/v1/completions", json={"model": "sim-model", "prompt": f"q{i} " * 20, "max_tokens": 2},
                               headers={"connection": "close"})  # new connections reach both workers
                    assert r.status_code == 200 and r.headers["x-kvroute-pod"] in {"sim-0", "sim-1"}
                    assert r.json()["choices"][0]["finish_reason"] == "length"


@contextlib.contextmanager
def one_pod_router(tmp_path, *sim_args: str):
    """``kvroute serve`` in front of one simulated pod (seed timing, block size 16, KV events) with a
    short speculative credit; yields a client of the router and the pod's URL."""
    events = consecutive_free_ports(2)
    with running_sims(1, ["--enable-prompt-tokens-details",
                          "--timing", "seed", "--kv-events-port", str(events), "--block-size", "16",
                          *sim_args]) as urls:
        port = free_port()
        cfg = tmp_path / "router.yaml"
        cfg.write_text(yaml.safe_dump({"port": port, "pods": fleet(urls, events), "speculative_ttl_s": 0.05}))
        with kvroute_process(["serve", "--config", str(cfg)], ready_url=f"http://127.0.0.1:{port}/ready"), \
                httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            yield c, urls[0]


def test_cache_salt_keeps_a_tenants_prefix_apart_in_the_router_and_the_pod(tmp_path):
    """A salted prompt is cached under a chain of its own (vLLM folds ``cache_salt`` into the first
    block's hash and announces it in that block's ``extra_keys``): the router credits the same salt's
    prefix, as the pod then hits it, and nothing to another salt or to no salt."""
    with one_pod_router(tmp_path) as (c, pod_url):
        prefix = "The tenant's long shared context. " * 40
        first = {"model": "sim-model", "prompt": prefix, "max_tokens": 2, "cache_salt": "tenant-a"}
        assert c.post("/v1/completions", json=first).status_code == 200
        follow = {"model": "sim-model", "prompt": prefix + "And now a question?", "max_tokens": 2}

        def credited(body: dict) -> int:
            row = c.post("/debug/route", json=body).json()["pods"][0]
            return int(sum(row["cached_tokens_by_tier"].values()))

        asyncio.run(until(lambda: credited({**follow, "cache_salt": "tenant-a"}) > 0, 10, "the salted prefix"))
        seen = {}
        for salt in ("tenant-b", None, "tenant-a"):   # the same salt last: the others must miss
            body = follow if salt is None else {**follow, "cache_salt": salt}
            before = credited(body)
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            seen[salt] = (before, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert seen["tenant-b"] == (0, 0) and seen[None] == (0, 0), seen
        assert seen["tenant-a"][0] == seen["tenant-a"][1] > 0, seen
        with httpx.Client(base_url=pod_url, timeout=30) as pod:
            for bad in ("", 7, ["x"]):    # refused as vLLM refuses it, by the router and by the pod
                for target in (c, pod):
                    r = target.post("/v1/completions", json={**follow, "cache_salt": bad})
                    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_a_hybrid_models_sliding_window_evictions_leave_the_full_attention_prefix_credited(tmp_path):
    """A hybrid pod (full attention + a 2-block sliding window, the same hashes in both groups): when a
    request finishes, the window group drops all but its last two blocks (BlockRemoved, group_idx 1),
    the full-attention group keeps them. The router keeps crediting the prefix, and the pod hits it."""
    with one_pod_router(tmp_path, "--hybrid-window-blocks", "2") as (c, _):
        prefix = "A long system prompt for a hybrid model. " * 20
        assert c.post("/v1/completions", json={"model": "sim-model", "prompt": prefix, "max_tokens": 2}
                      ).status_code == 200
        follow = {"model": "sim-model", "prompt": prefix + "Then a question?", "max_tokens": 2}

        def credited() -> int:
            row = c.post("/debug/route", json=follow).json()["pods"][0]
            return int(sum(row["cached_tokens_by_tier"].values()))

        def removals() -> float:  # applied (wrongly, were it so) or skipped as another group's
            return sum(float(ln.split()[-1]) for ln in c.get("/metrics").text.splitlines()
                       if ln.startswith(('kvroute_index_operations_total{kind="skipped_group"}',
                                         'kvroute_index_operations_total{kind="blocks_removed"}')))

        asyncio.run(until(lambda: removals() > 0, 10, "the window group's removals to arrive"))
        before = credited()
        r = c.post("/v1/completions", json=follow)
        assert r.status_code == 200, r.text
        hit = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert before == hit and hit >= len(prefix.encode()) // 16 * 16 - 16, (before, hit)


def test_a_lora_adapters_requests_go_to_its_pods_and_match_only_its_own_prefixes(tmp_path):
    """Two simulated pods of one base model, one of them also serving the adapter ``sql`` (vLLM's
    --lora-modules): the router lists the adapter with its base as ``parent``, sends its requests only
    to the pod serving it, and keys them as vLLM does (the adapter in every block's hash and in the
    events' ``lora_name``/``extra_keys``), so an adapter's follow-up is credited exactly what the pod
    then hits while the base model's cached copy of the same text counts for nothing."""
    events = consecutive_free_ports(4)
    with running_sims(1, ["--enable-prompt-tokens-details",
                          "--timing", "seed", "--kv-events-port", str(events), "--block-size", "16",
                          "--lora-modules", '["sql=/adapters/sql"]']) as with_lora, \
            running_sims(1, ["--enable-prompt-tokens-details",
                             "--timing", "seed", "--kv-events-port", str(events + 2), "--block-size", "16"]) as plain:
        port = free_port()
        pods = fleet(with_lora + plain, events)
        pods[0]["lora_adapters"] = ["sql"]
        cfg = tmp_path / "router.yaml"
        cfg.write_text(yaml.safe_dump({"port": port, "pods": pods, "speculative_ttl_s": 0.05}))
        with kvroute_process(["serve", "--config", str(cfg)], ready_url=f"http://127.0.0.1:{port}/ready"), \
                httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            asyncio.run(until(lambda: c.get("/ready").json().get("healthy_pods") == 2, 20, "both pods healthy"))
            listed = {m["id"]: m["parent"] for m in c.get("/v1/models").json()["data"]}
            assert listed == {"sim-model": None, "sql": "sim-model"}
            with httpx.Client(base_url=with_lora[0], timeout=30) as pod:
                cards = {m["id"]: (m["root"], m["parent"]) for m in pod.get("/v1/models").json()["data"]}
                assert cards == {"sim-model": ("sim-model", None), "sql": ("/adapters/sql", "sim-model")}

            prefix = "SELECT the customers who ordered twice last month from the orders table. " * 12
            follow = prefix + "Now group them by region."

            def credited(model: str, prompt: str) -> dict[str, int]:
                rows = c.post("/debug/route", json={"model": model, "prompt": prompt}).json()["pods"]
                return {r["pod"]: int(sum(r["cached_tokens_by_tier"].values())) for r in rows}

            # the base model's copy of the prefix on the adapter's pod (sent to the pod itself)
            with httpx.Client(base_url=with_lora[0], timeout=30) as pod:
                r = pod.post("/v1/completions", json={"model": "sim-model", "prompt": prefix, "max_tokens": 2})
                assert r.status_code == 200
            asyncio.run(until(lambda: credited("sim-model", follow)["sim-0"] > 0, 10, "the base model's prefix"))
            assert set(credited("sql", follow)) == {"sim-0"}            # only the adapter's pod is a candidate
            assert credited("sql", follow) == {"sim-0": 0}             # and the base model's blocks do not count

            for _ in range(3):                                          # every adapter request: its pod
                r = c.post("/v1/completions", json={"model": "sql", "prompt": prefix, "max_tokens": 2})
                assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "sim-0", r.text
                assert r.json()["model"] == "sql"
            asyncio.run(until(lambda: credited("sql", follow)["sim-0"] > 0, 10, "the adapter's prefix"))
            before = credited("sql", follow)["sim-0"]
            r = c.post("/v1/completions", json={"model": "sql", "prompt": follow, "max_tokens": 2})
            assert r.status_code == 200
            assert before == r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert c.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404


def test_a_data_parallel_pods_engines_are_routed_apart_and_follow_ups_stay_on_theirs(tmp_path):
    """One simulated pod with four data-parallel engines (vLLM's --data-parallel-size 4: one HTTP
    server, an event stream per rank): the router makes a candidate of each engine (``sim-0#r``, its
    own index, load and bookings, in /debug/route too), sends each request to its engine with
    X-data-parallel-rank, and so keeps every conversation's follow-up on the engine holding it, where
    vLLM's own balancer, blind to the cache, would scatter them."""
    ranks = 4
    events = consecutive_free_ports(2 * ranks)
    with running_sims(1, ["--enable-prompt-tokens-details",
                          "--timing", "seed", "--kv-events-port", str(events), "--block-size", "16",
                          "--data-parallel-size", str(ranks)]) as urls:
        port = free_port()
        pod = {"id": "sim-0", "url": urls[0], "model": "sim-model",
               "kv_events": [{"endpoint": f"tcp://127.0.0.1:{events + r}",
                              "replay": f"tcp://127.0.0.1:{events + ranks + r}"} for r in range(ranks)]}
        cfg = tmp_path / "router.yaml"
        cfg.write_text(yaml.safe_dump({"port": port, "pods": [pod], "speculative_ttl_s": 0.05}))
        with kvroute_process(["serve", "--config", str(cfg)], ready_url=f"http://127.0.0.1:{port}/ready"), \
                httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            asyncio.run(until(lambda: c.get("/ready").json().get("healthy_pods") == ranks, 20, "every engine healthy"))
            rows = c.post("/debug/route", json={"model": "sim-model", "prompt": "hello"}).json()["pods"]
            assert sorted(r["pod"] for r in rows) == [f"sim-0#{r}" for r in range(ranks)]
            first: dict[int, tuple[str, str]] = {}

            async def first_turns() -> None:   # together, so the router's bookings spread them
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as ac:
                    async def one(s: int) -> None:
                        prompt = f"Conversation {s}: " + f"the shared history of session {s}. " * 30
                        r = await ac.post("/v1/completions", json={"model": "sim-model", "prompt": prompt,
                                                                   "max_tokens": 4})
                        assert r.status_code == 200, r.text
                        first[s] = (r.headers["x-kvroute-pod"], prompt + r.json()["choices"][0]["text"])
                    await asyncio.gather(*(one(s) for s in range(8)))

            asyncio.run(first_turns())
            assert len({p for p, _ in first.values()}) >= 2, first   # engines are candidates apart

            def credited(engine: str, prompt: str) -> int:
                rows = c.post("/debug/route", json={"model": "sim-model", "prompt": prompt}).json()["pods"]
                return next(int(sum(r["cached_tokens_by_tier"].values())) for r in rows if r["pod"] == engine)

            for engine, history in first.values():  # each engine's own BlockStored (the speculation lapsed)
                asyncio.run(until(lambda e=engine, h=history: credited(e, h) > 0, 10, f"{engine}'s events"))
            for s, (engine, history) in first.items():
                r = c.post("/v1/completions", json={"model": "sim-model", "prompt": history + " And then?",
                                                    "max_tokens": 2})
                assert r.status_code == 200 and r.headers["x-kvroute-pod"] == engine, (s, engine, r.headers)
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 20, r.json()["usage"]
            # a client cannot pick the engine itself: its header is dropped, the router's reaches the pod
            engine, history = first[0]
            other = "3" if engine != "sim-0#3" else "2"
            r = c.post("/v1/completions", json={"model": "sim-model", "prompt": history + " Again?", "max_tokens": 1},
                       headers={"x-data-parallel-rank": other})
            assert r.status_code == 200 and r.headers["x-kvroute-pod"] == engine
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_the_engines_of_a_data_parallel_pod_share_one_scrape_of_its_page():
    """Each engine of a data-parallel pod is scraped as a pod of its own, from the same /metrics page:
    one fetch per half interval serves them all (four fetches for four engines made a busy pod slow
    enough to mislead its engines' calibration), and each reads its own engine's samples."""
    from aiohttp import web

    from router.config import PodConfig, data_parallel_ranks
    from router.pods import PodRegistry

    fetches = []
    page = "".join(f'vllm:num_requests_waiting{{engine="{r}",model_name="m"}} {r + 1}.0\n'
                   f'vllm:num_requests_running{{engine="{r}",model_name="m"}} {10 * r}.0\n' for r in range(4))

    async def metrics(request: web.Request) -> web.Response:
        fetches.append(request.path)
        return web.Response(text=page)

    async def run() -> None:
        async with serve_routes(web.get("/metrics", metrics)) as port:
            pod = PodConfig(id="p", url=f"http://127.0.0.1:{port}", model="m", data_parallel_size=4)
            reg = PodRegistry(data_parallel_ranks(pod), scrape_interval_s=10.0, timeout_s=5.0)
            await reg.start()   # a health check and a scrape of every engine
            try:
                await asyncio.gather(*(reg.scrape(p) for p in reg.pods.values()))
                assert len(fetches) == 1, fetches
                assert [(p.id, p.waiting, p.running) for p in reg.pods.values()] == [
                    (f"p#{r}", r + 1, 10 * r) for r in range(4)]
            finally:
                await reg.stop()

    asyncio.run(run())
