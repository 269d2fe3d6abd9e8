"""Simulator pieces P/D relies on: the advertised NIXL host, EOS on the first token, exact output counts,
and the decode side's metrics under vLLM's names (as real vLLM 0.32 reports them, tests/real_vllm/test_pd.py)."""

from __future__ import annotations

import asyncio
import json

import httpx

from simulator.settings import SimSettings
from simulator.testing import running_sims
from tests.helpers import metric

PROMPT = "The quick brown fox jumps over the lazy dog. " * 8

PRODUCER = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


def test_advertised_host_defaults_to_a_concrete_host():
    assert SimSettings(host="10.1.2.3").advertised_host == "10.1.2.3"
    assert SimSettings(host="0.0.0.0").advertised_host == "127.0.0.1"
    assert SimSettings(host="0.0.0.0", nixl_side_channel_host="10.0.0.7").advertised_host == "10.0.0.7"


def test_prefill_names_its_side_channel_host_and_eos_on_the_first_token_still_leases_the_blocks():
    with running_sims(1, ["--nixl-side-channel-host", "localhost"]) as (url,):
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": PRODUCER}
        out = httpx.post(url + "/v1/completions", json=body, timeout=10).json()
        assert out["kv_transfer_params"]["remote_host"] == "localhost"
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["kv_transfer_params"]["remote_prefill_cached_tokens"] == 0
        # EOS on the one token: finish 'stop', and (vLLM 0.32 leases on a stop too) the blocks kept and
        # kv_transfer_params answered, naming this request's blocks
        r = httpx.post(url + "/v1/completions", json=body, headers={"x-sim-fault": "eos=1"}, timeout=10)
        out = r.json()
        assert out["choices"][0]["finish_reason"] == "stop"
        params = out["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_num_tokens"] == out["usage"]["prompt_tokens"]
        assert isinstance(params["remote_block_ids"][0], list) and params["remote_block_ids"][0]
        # the second run of the prompt hit the first one's cached blocks: the params say so
        assert params["remote_prefill_cached_tokens"] == (out["usage"]["prompt_tokens"] - 1) // 16 * 16
        assert out["usage"]["completion_tokens"] == 1
        metrics = httpx.get(url + "/metrics", timeout=5).text
        assert "kvsim_nixl_leases 2.0" in metrics  # both requests' leases are held
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
        r = httpx.post(url + "/v1/completions", timeout=10,
                       json={"model": "sim-model", "prompt": PROMPT, "max_tokens": 5})
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


def test_prefill_that_stops_on_eos_is_still_read_over_nixl_through_the_sidecar():
    """The EOS fault on the prefill pod only: its one token ends the request ('stop'), yet, as vLLM 0.32
    does, it keeps its blocks and answers kv_transfer_params, so the sidecar's decode leg reads them
    (a remote prefill, not a local one) and the decoder (no EOS fault) generates every token."""
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
            assert r.headers["x-kvroute-prefill"] == "remote"
            assert r.json()["usage"]["completion_tokens"] == 5  # the decode pod has no EOS fault
            metrics = httpx.get(f"http://127.0.0.1:{side}/metrics", timeout=5).text
            assert "kvroute_sidecar_prefill_without_kv_transfer_params_total 0.0" in metrics
            assert "kvsim_nixl_leases 0.0" in httpx.get(p_url + "/metrics", timeout=5).text  # read, released
            assert metric(d_url, "kvsim_nixl_transfers_total", outcome="ok") == 1


def test_decode_leg_metrics_are_vllms():
    """What real vLLM 0.32 reports on the decoder of a NIXL read (tests/real_vllm/test_pd.py checks the
    engine): every prompt token past its own prefix hit is external_kv_transfer (local_compute 0, though
    the last one is recomputed), external hits the same, and one vllm:nixl_bytes_transferred observation
    of the whole blocks moved (the partial last one included; blocks it holds are not moved)."""
    kv_bytes = 512
    with running_sims(2, ["--kv-bytes-per-token", str(kv_bytes)]) as (p_url, d_url):
        def legs(prompt: str) -> dict:
            pre = httpx.post(p_url + "/v1/completions", timeout=10, json={
                "model": "sim-model", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": PRODUCER}).json()
            return httpx.post(d_url + "/v1/completions", timeout=10, json={
                "model": "sim-model", "prompt": prompt, "max_tokens": 3,
                "kv_transfer_params": pre["kv_transfer_params"]}).json()

        def source(name: str) -> float:
            return metric(d_url, "vllm:prompt_tokens_by_source_total", source=name)

        out = legs(PROMPT)
        n = out["usage"]["prompt_tokens"]
        assert n % 16  # a partial last block
        assert out["kv_transfer_params"] is None
        assert (source("local_compute"), source("local_cache_hit"), source("external_kv_transfer")) == (0, 0, n)
        assert metric(d_url, "vllm:external_prefix_cache_hits_total") == n
        assert metric(d_url, "vllm:nixl_bytes_transferred_count") == 1
        assert metric(d_url, "vllm:nixl_bytes_transferred_sum") == -(-n // 16) * 16 * kv_bytes
        assert metric(d_url, "vllm:nixl_xfer_time_seconds_count") == 1
        # a longer prompt sharing those blocks: the decoder's own full blocks are hits, only the rest moves
        longer = PROMPT + "and then some more words to make a few blocks"
        out = legs(longer)
        m = out["usage"]["prompt_tokens"]
        hit = n // 16 * 16
        assert source("local_cache_hit") == hit and source("local_compute") == 0
        assert source("external_kv_transfer") == n + (m - hit)
        assert metric(d_url, "vllm:nixl_bytes_transferred_sum") == \
            (-(-n // 16) + -(-m // 16) - n // 16) * 16 * kv_bytes
        # a request without params is computed here: local_compute, no NIXL
        httpx.post(d_url + "/v1/completions", timeout=10,
                   json={"model": "sim-model", "prompt": "fresh words nobody sent", "max_tokens": 1})
        assert source("local_compute") > 0 and metric(d_url, "vllm:nixl_bytes_transferred_count") == 2
        assert metric(d_url, "vllm:nixl_num_failed_transfers_total") == 0
