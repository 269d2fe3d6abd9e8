"""Simulator pieces P/D relies on: the advertised NIXL host, EOS on the first token, exact output counts."""

from __future__ import annotations

import asyncio
import json

import httpx

from simulator.settings import SimSettings
from simulator.testing import running_sims

PROMPT = "The quick brown fox jumps over the lazy dog. " * 8

PRODUCER = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


def test_advertised_host_defaults_to_a_concrete_host():
    assert SimSettings(host="10.1.2.3").advertised_host == "10.1.2.3"
    assert SimSettings(host="0.0.0.0").advertised_host == "127.0.0.1"
    assert SimSettings(host="0.0.0.0", nixl_side_channel_host="10.0.0.7").advertised_host == "10.0.0.7"


def test_prefill_names_its_side_channel_host_and_eos_on_the_first_token_returns_null_params():
    with running_sims(1, ["--nixl-side-channel-host", "localhost"]) as (url,):
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": PRODUCER}
        out = httpx.post(url + "/v1/completions", json=body, timeout=10).json()
        assert out["kv_transfer_params"]["remote_host"] == "localhost"
        assert out["choices"][0]["finish_reason"] == "length"
        # EOS on the one token: finish 'stop', no blocks kept, kv_transfer_params null
        r = httpx.post(url + "/v1/completions", json=body, headers={"x-sim-fault": "eos=1"}, timeout=10)
        out = r.json()
        assert out["choices"][0]["finish_reason"] == "stop"
        assert out.get("kv_transfer_params") is None
        assert out["usage"]["completion_tokens"] == 1
        metrics = httpx.get(url + "/metrics", timeout=5).text
        assert "kvsim_nixl_leases 1.0" in metrics  # only the first request's lease is held
        # ignore_eos and min_tokens defer the EOS
        r = httpx.post(url + "/v1/completions", headers={"x-sim-fault": "eos=1"}, timeout=10,
                       json={"model": "sim-model", "prompt": PROMPT, "max_tokens": 5, "min_tokens": 3})
        assert r.json()["usage"]["completion_tokens"] == 3 and r.json()["choices"][0]["finish_reason"] == "stop"
        r = httpx.post(url + "/v1/completions", headers={"x-sim-fault": "eos=1"}, timeout=10,
                       json={"model": "sim-model", "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["choices"][0]["finish_reason"] == "length"
        # pod-wide at run time, and a clear error for a bad value
        assert httpx.post(url + "/sim/faults", json={"eos_after": 0}, timeout=5).status_code == 400
        httpx.post(url + "/sim/faults", json={"eos_after": 2}, timeout=5).raise_for_status()
        r = httpx.post(url + "/v1/completions", timeout=10, json={"model": "sim-model", "prompt": PROMPT, "max_tokens": 5})
        assert r.json()["usage"]["completion_tokens"] == 2


def test_every_answer_counts_exactly_max_tokens_under_preemption():
    """min_tokens = max_tokens with ignore_eos under load: recompute preemptions must not change the
    count of output tokens (every answer 4, streamed or not), and the pod must really preempt."""
    args = ["--num-gpu-blocks", "24", "--max-num-batched-tokens", "64"]
    with running_sims(1, args) as (url,):
        async def one(client: httpx.AsyncClient, i: int, stream: bool) -> int:
            body = {"model": "sim-model", "prompt": f"r{i} " + "x" * (100 + i % 37), "max_tokens": 4,
                    "min_tokens": 4, "ignore_eos": True}
            if stream:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
            r = await client.post(url + "/v1/completions", json=body)
            if not stream:
                return r.json()["usage"]["completion_tokens"]
            events = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]
            texts = [e for e in events if e["choices"] and e["choices"][0]["text"]]
            assert len(texts) == events[-1]["usage"]["completion_tokens"]
            return events[-1]["usage"]["completion_tokens"]

        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(one(client, i, i % 2 == 0) for i in range(60)))

        counts = asyncio.run(burst())
        assert counts == [4] * 60
        text = httpx.get(url + "/metrics", timeout=5).text
        preempted = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("vllm:num_preemptions_total"))
        assert preempted > 0


def test_prefill_that_stops_on_eos_is_decoded_without_params_through_the_sidecar():
    """The EOS fault on the prefill pod only: its one token ends the request, it answers null
    kv_transfer_params, and the sidecar decodes without them (local prefill on the decode pod)."""
    from tests.helpers import free_port, kvroute_process

    with running_sims(2) as (p_url, d_url):
        side = free_port()
        target = p_url.removeprefix("http://")
        args = ["sidecar", "--host", "127.0.0.1", "--port", str(side), "--vllm-url", d_url,
                "--prefill-allowlist", json.dumps([target])]
        with kvroute_process(args, ready_url=f"http://127.0.0.1:{side}/health"):
            httpx.post(p_url + "/sim/faults", json={"eos_after": 1}, timeout=5).raise_for_status()
            r = httpx.post(f"http://127.0.0.1:{side}/v1/completions", headers={"x-prefiller-host-port": target},
                           json={"model": "sim-model", "prompt": PROMPT, "max_tokens": 5}, timeout=20)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvroute-prefill"] == "local"
            assert r.json()["usage"]["completion_tokens"] == 5  # the decode pod has no EOS fault
            metrics = httpx.get(f"http://127.0.0.1:{side}/metrics", timeout=5).text
            assert "kvroute_sidecar_prefill_without_kv_transfer_params_total 1.0" in metrics
            assert "kvsim_nixl_leases 0.0" in httpx.get(p_url + "/metrics", timeout=5).text
            decoder = httpx.get(d_url + "/metrics", timeout=5).text
            assert not any(line.startswith("kvsim_nixl_transfers_total") and not line.endswith(" 0.0")
                           for line in decoder.splitlines())  # no NIXL transfer of any outcome
