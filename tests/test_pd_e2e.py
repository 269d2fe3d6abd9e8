"""P/D end to end with real processes: 2 prefill + 2 decode simulated pods, a sidecar beside each
decode pod, and the router in front, all on loopback.

The decode pods are configured with a low prefill-rate prior (busy decoding, they prefill slowly),
so the `predicted` decider sends a cold long prompt to a prefill pod, and decides a follow-up
whose context the decode pod already holds locally. Every check reads what the pods themselves
report (NIXL reads and transfers, leases, KV events through the router's index).
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from simulator.testing import consecutive_free_ports, pd_pods, running_sims
from tests.helpers import free_ports, kvroute_process, metric

SYSTEM = "You are a careful assistant. Answer in one short sentence, citing the manual. " * 20  # ~1,600 tokens


def wait_for(fn, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


@pytest.fixture(scope="module")
def pd_fleet():
    events = consecutive_free_ports(8)
    with running_sims(4, ["--enable-prompt-tokens-details",
                          "--kv-events-port", str(events), "--block-size", "16"]) as urls:
        prefill, decode = urls[:2], urls[2:]
        router_port, *side_ports = [p for p in free_ports(8) if p not in range(events, events + 8)][:3]
        router = f"http://127.0.0.1:{router_port}"
        sidecars = [f"http://127.0.0.1:{p}" for p in side_ports]
        pods = pd_pods(urls, sidecars, events, prefill_tokens_per_s=4000)
        args = ["serve", "--port", str(router_port), "--pods", json.dumps(pods), "--pd-decider", "predicted",
                "--health-interval-s", "0.2", "--scrape-interval-s", "0.1", "--speculative-ttl-s", "0.05",
                "--no-calibrate"]
        with kvroute_process(args, ready_url=router + "/health"):
            procs = []
            try:
                for port, url in zip(side_ports, decode):
                    cm = kvroute_process(["sidecar", "--host", "127.0.0.1", "--port", str(port), "--vllm-url", url,
                                          "--prefill-allowlist-url", router + "/internal/prefill-pods",
                                          "--allowlist-refresh-s", "0.5", "--prefill-timeout", "10"],
                                         ready_url=f"http://127.0.0.1:{port}/health")
                    cm.__enter__()
                    procs.append(cm)
                # the router sees the decode pods once their sidecars answer /health
                assert wait_for(lambda: httpx.post(router + "/debug/route", timeout=5, json={
                    "model": "sim-model", "prompt": "x"}).json().get("pd") is not None, timeout=15)
                yield {"router": router, "prefill": prefill, "decode": decode, "sidecars": sidecars}
            finally:
                for cm in reversed(procs):
                    cm.__exit__(None, None, None)


def test_published_prefill_set_lists_the_prefill_pods(pd_fleet):
    got = httpx.get(pd_fleet["router"] + "/internal/prefill-pods", timeout=5).json()
    assert got == sorted(u.removeprefix("http://") for u in pd_fleet["prefill"])


def test_cold_prompt_goes_through_both_legs_and_a_follow_up_is_decided_local(pd_fleet):
    router, prefill, decode = pd_fleet["router"], pd_fleet["prefill"], pd_fleet["decode"]
    prompt = SYSTEM + "Question: what is the first step?"
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 6}
    plan = httpx.post(router + "/debug/route", json=body, timeout=5).json()["pd"]
    assert plan["mode"] == "remote" and plan["prefill_pod"].startswith("prefill-"), plan
    assert "beats local" in plan["reason"]
    chosen = next(r for r in plan["decode_pods"] if r["decode_pod"] == plan["decode_pod"])
    assert chosen["prefill_pods"][0]["transfer_ms"] > 0 and chosen["has_kv_room"]

    reads = [metric(u, "kvsim_nixl_reads_total") for u in prefill]
    transfers = [metric(u, "kvsim_nixl_transfers_total", outcome="ok") for u in decode]
    r = httpx.post(router + "/v1/completions", json=body, timeout=20)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvroute-prefill"] == "remote"
    assert r.json()["usage"]["completion_tokens"] == 6
    d = int(r.headers["x-kvroute-pod"].removeprefix("decode-"))
    p = int(plan["prefill_pod"].removeprefix("prefill-"))
    # the prefill pod was read once, its lease ended with the read, the decoder got the KV over NIXL
    assert metric(prefill[p], "kvsim_nixl_reads_total") == reads[p] + 1
    assert wait_for(lambda: metric(prefill[p], "kvsim_nixl_leases") == 0)
    assert metric(decode[d], "kvsim_nixl_transfers_total", outcome="ok") == transfers[d] + 1
    # the decode pod's own KV events (not the router's speculation, which expires in 50 ms) show the
    # transferred blocks in the router's index
    n_prompt = r.json()["usage"]["prompt_tokens"]

    def decode_holds_prompt():
        rows = httpx.post(router + "/debug/route", json=body, timeout=5).json()["pods"]
        row = next(x for x in rows if x["pod"] == f"decode-{d}")
        return row["cached_tokens"] >= (n_prompt - 1) // 16 * 16

    time.sleep(0.1)
    assert wait_for(decode_holds_prompt)

    # follow-up turn: the context (prompt + answer) is cached on that decode pod -> decided local
    follow = {"model": "sim-model", "prompt": prompt + r.json()["choices"][0]["text"] + " And the second?",
              "max_tokens": 4}
    plan = httpx.post(router + "/debug/route", json=follow, timeout=5).json()["pd"]
    assert plan["decode_pod"] == f"decode-{d}" and plan["mode"] == "local", json.dumps(plan, indent=1)
    assert "beats remote" in plan["reason"]
    reads = [metric(u, "kvsim_nixl_reads_total") for u in prefill]
    r2 = httpx.post(router + "/v1/completions", json=follow, timeout=20)
    assert r2.status_code == 200 and r2.headers["x-kvroute-pod"] == f"decode-{d}"
    assert "x-kvroute-prefill" not in r2.headers  # passed straight through the sidecar
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= n_prompt - 16
    assert [metric(u, "kvsim_nixl_reads_total") for u in prefill] == reads
    decisions = metric(router, "kvroute_pd_decisions_total", decider="predicted", outcome="local")
    assert decisions >= 1


def test_a_request_of_several_choices_is_planned_and_served_local(pd_fleet):
    # one prefill's kv_transfer_params cannot serve several choices (vLLM answers with one): the router
    # plans the prefill on the decode pod, and no prefill pod is read
    router, prefill = pd_fleet["router"], pd_fleet["prefill"]
    body = {"model": "sim-model", "prompt": SYSTEM + "Question: name three colours.", "max_tokens": 3, "n": 2}
    plan = httpx.post(router + "/debug/route", json=body, timeout=5).json()["pd"]
    assert plan["mode"] == "local" and "several prompts or choices" in plan["reason"], plan
    reads = [metric(u, "kvsim_nixl_reads_total") for u in prefill]
    r = httpx.post(router + "/v1/completions", json=body, timeout=20)
    # the simulated pod serves one choice only and says so: the decode pod's own answer, no prefill leg
    assert r.status_code == 400 and "n > 1" in r.json()["error"]["message"], r.text
    assert r.headers["x-kvroute-pod"].startswith("decode-") and "x-kvroute-prefill" not in r.headers
    assert [metric(u, "kvsim_nixl_reads_total") for u in prefill] == reads


def test_openai_sdk_streams_through_both_legs(pd_fleet):
    router, decode = pd_fleet["router"], pd_fleet["decode"]
    transfers = sum(metric(u, "kvsim_nixl_transfers_total", outcome="ok") for u in decode)
    client = openai.OpenAI(base_url=router + "/v1", api_key="none", max_retries=0, timeout=20)
    raw = client.chat.completions.with_raw_response.create(
        model="sim-model", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Stream it."}],
        max_tokens=8, stream=True, stream_options={"include_usage": True})
    assert raw.headers["x-kvroute-prefill"] == "remote"
    chunks = list(raw.parse())
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 8
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    assert sum(metric(u, "kvsim_nixl_transfers_total", outcome="ok") for u in decode) == transfers + 1
    assert metric(router, "kvroute_pd_prefill_leg_seconds_count") >= 1  # calibration input seen


def test_client_cannot_steer_the_prefill_target_or_the_nixl_read(pd_fleet):
    router, prefill, decode = pd_fleet["router"], pd_fleet["prefill"], pd_fleet["decode"]
    sidecars = pd_fleet["sidecars"]
    reads = sum(metric(u, "kvsim_nixl_reads_total") for u in prefill)
    rejections = sum(metric(s, "kvroute_sidecar_ssrf_rejections_total") for s in sidecars)
    invalid = sum(metric(u, "kvsim_nixl_transfers_total", outcome="invalid") for u in decode)
    stripped = metric(router, "kvroute_client_kv_transfer_params_stripped_total")
    # a short prompt is decided local; the smuggled header would otherwise make the sidecar call a
    # metadata address (a 403) or the named prefill pod (a NIXL read)
    for target in ("169.254.169.254:80", prefill[0].removeprefix("http://")):
        r = httpx.post(router + "/v1/completions", timeout=20,
                       headers={"x-prefiller-host-port": target, "x-prefiller-url": target},
                       json={"model": "sim-model", "prompt": "Hi there.", "max_tokens": 2,
                             "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9",
                                                    "remote_port": 80, "remote_engine_id": "x",
                                                    "remote_request_id": "y", "remote_block_ids": [[0]]}})
        assert r.status_code == 200, r.text
        assert "x-kvroute-prefill" not in r.headers
    assert sum(metric(s, "kvroute_sidecar_ssrf_rejections_total") for s in sidecars) == rejections
    assert sum(metric(u, "kvsim_nixl_reads_total") for u in prefill) == reads
    # the client's kv_transfer_params never reached the decode pod
    assert sum(metric(u, "kvsim_nixl_transfers_total", outcome="invalid") for u in decode) == invalid
    assert metric(router, "kvroute_client_kv_transfer_params_stripped_total") == stripped + 2
