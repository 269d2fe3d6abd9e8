"""Two router replicas (two real `kvroute serve` processes) over one simulated fleet, sharing
nothing: each subscribes to every pod's KV events, so a prefix cached through replica A shows in
replica B's index within a second; and work A has in flight on a pod reaches B's TTFT predictions
through the pod's own `vllm:num_requests_waiting/running`, which B scrapes."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import yaml

from simulator.testing import consecutive_free_ports, running_sims
from tests.helpers import free_ports, kvroute_process

PREFILL_TOKENS_PER_S = 4000.0


def fleet(urls: list[str], events: int) -> list[dict]:
    return [{"id": f"sim-{i}", "url": url, "model": "sim-model",
             "kv_events": [{"endpoint": f"tcp://127.0.0.1:{events + 2 * i}",
                            "replay": f"tcp://127.0.0.1:{events + 2 * i + 1}"}]}
            for i, url in enumerate(urls)]


@contextlib.contextmanager
def two_routers(tmp_path, urls: list[str], events: int):
    bases = []
    with contextlib.ExitStack() as stack:
        for name, port in zip("ab", free_ports(2)):
            cfg = tmp_path / f"router-{name}.yaml"
            cfg.write_text(yaml.safe_dump({
                "port": port, "pods": fleet(urls, events), "scrape_interval_s": 0.1, "speculative_ttl_s": 0.2,
                "prefill_tokens_per_s": PREFILL_TOKENS_PER_S, "calibrate": False,
                "unknown_request_tokens": 4000}))
            stack.enter_context(kvroute_process(["serve", "--config", str(cfg)],
                                                ready_url=f"http://127.0.0.1:{port}/ready"))
            bases.append(f"http://127.0.0.1:{port}")
        yield bases


def row(explained: dict, pod: str) -> dict:
    return next(p for p in explained["pods"] if p["pod"] == pod)


async def test_replicas_share_the_index_through_events_and_load_through_pod_metrics(tmp_path):
    events = consecutive_free_ports(4)
    sim_args = ["--timing", "seed", "--kv-events-port", str(events), "--block-size", "16",
                "--prefill-tokens-per-s", str(PREFILL_TOKENS_PER_S)]
    with running_sims(2, sim_args) as urls, two_routers(tmp_path, urls, events) as (a, b):
        async with httpx.AsyncClient(timeout=60) as c:
            # 1. A prefix cached through A appears in B's index, from the pods' events alone.
            prompt = "Replicas share nothing but the pods' events. " * 40
            follow_up = {"model": "sim-model", "prompt": prompt + "And then?", "max_tokens": 4}
            before = (await c.post(f"{b}/debug/route", json=follow_up)).json()
            assert all(p["cached_tokens"] == 0 for p in before["pods"])
            r = await c.post(f"{a}/v1/completions", json={"model": "sim-model", "prompt": prompt, "max_tokens": 4})
            assert r.status_code == 200
            pod = r.headers["x-kvroute-pod"]
            answered = time.monotonic()
            while True:
                explained = (await c.post(f"{b}/debug/route", json=follow_up)).json()
                if row(explained, pod)["cached_tokens"] >= len(prompt) - 16:
                    break
                assert time.monotonic() - answered < 3.0, f"B never saw the prefix: {explained}"
                await asyncio.sleep(0.01)
            converged = time.monotonic() - answered
            assert explained["chosen"] == pod  # B now routes the follow-up where A's request left the cache
            assert row(explained, pod)["pending_requests"] == 0  # ... knowing it from events, not bookings
            metrics = (await c.get(f"{b}/metrics")).text
            lag = next(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith(f'kvroute_pod_event_lag_seconds{{pod="{pod}"}}'))
            print(f"B's index showed the prefix {converged * 1000:.0f} ms after A's answer "
                  f"(B's event lag, publish to apply: {lag * 1000:.1f} ms)")

            # 2. Work A has in flight reaches B's predictions through the pods' metrics.
            probe = {"model": "sim-model", "prompt": "A fresh prompt nobody has sent. " * 120, "max_tokens": 1}
            idle = (await c.post(f"{b}/debug/route", json=probe)).json()
            idle_ms = {p["pod"]: p["predicted_ttft_ms"] for p in idle["pods"]}

            async def long_request(i: int) -> str:
                body = {"model": "sim-model", "prompt": f"Long request {i}. " + "x" * 4000, "max_tokens": 2}
                resp = await c.post(f"{a}/v1/completions", json=body)
                assert resp.status_code == 200
                return resp.headers["x-kvroute-pod"]

            tasks = [asyncio.create_task(long_request(i)) for i in range(6)]
            peak: dict[str, float] = {}
            foreign_waiting: dict[str, int] = {}
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline and not all(t.done() for t in tasks):
                busy = (await c.post(f"{b}/debug/route", json=probe)).json()
                for p in busy["pods"]:
                    assert p["pending_requests"] == 0  # B booked none of it
                    peak[p["pod"]] = max(peak.get(p["pod"], 0.0), p["predicted_ttft_ms"])
                    foreign_waiting[p["pod"]] = max(foreign_waiting.get(p["pod"], 0), p["waiting"])
                await asyncio.sleep(0.05)
            served = await asyncio.gather(*tasks)
            for pod in set(served):
                assert foreign_waiting[pod] >= 1
                assert peak[pod] >= idle_ms[pod] + 500, (idle_ms, peak)
            print(f"B's predicted TTFT for the probe: idle {idle_ms} ms, while A's requests ran {peak} ms")
