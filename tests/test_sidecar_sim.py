"""The sidecar between simulated vLLM pods (``kvroute sim``): NIXL legs, lease, fallback, 4xx, cancellation.

One ``kvroute sim --count 2`` process runs the prefill pod (port P) and the decode pod (P+1); the
sidecar fronts the decode pod. Steps are capped at 64 tokens so that a slowed-down prefill reaches
a step boundary (where an engine notices an abort) soon after the client leaves. Every check reads
the pods' own metrics, so it sees what vLLM would: the prefill pod's lease on the prompt blocks, the
decoder's NIXL read, aborts.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from simulator.testing import consecutive_free_ports
from tests.helpers import free_ports, kvroute_process, metric

PROMPT = "The quick brown fox jumps over the lazy dog. " * 12  # ~540 byte tokens, 33 blocks


def wait_metric(base: str, name: str, want: float, timeout: float = 5.0, **labels: str) -> float:
    deadline = time.monotonic() + timeout
    while True:
        value = metric(base, name, **labels)
        if value == want or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


@pytest.fixture(scope="module")
def fleet():
    """(prefill pod URL, decode pod URL, sidecar URL, the header value naming the prefill pod)."""
    base = consecutive_free_ports(2)
    p_url, d_url = f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"
    side_port = next(p for p in free_ports(3) if p not in (base, base + 1))
    side_url = f"http://127.0.0.1:{side_port}"
    with kvroute_process(["sim", "--port", str(base), "--count", "2", "--host", "127.0.0.1",
                          "--max-num-batched-tokens", "64"],
                         ready_url=d_url + "/health"):
        args = ["sidecar", "--host", "127.0.0.1", "--port", str(side_port), "--vllm-url", d_url,
                "--prefill-allowlist", json.dumps([f"127.0.0.1:{base}"]), "--prefill-timeout", "10"]
        with kvroute_process(args, ready_url=side_url + "/health"):
            yield p_url, d_url, side_url, f"127.0.0.1:{base}"


@pytest.fixture(autouse=True)
def _no_faults(fleet):
    p_url = fleet[0]
    yield
    httpx.post(p_url + "/sim/faults", json={"status": None, "delay_s": 0, "slowdown": 1.0}, timeout=5)


def test_both_legs_move_the_kv_and_the_lease_ends_when_the_decoder_reads(fleet):
    p_url, d_url, side_url, target = fleet
    reads = metric(p_url, "kvsim_nixl_reads_total")
    transfers = metric(d_url, "kvsim_nixl_transfers_total", outcome="ok")
    external = metric(d_url, "vllm:external_prefix_cache_hits_total")
    r = httpx.post(side_url + "/v1/completions", timeout=20, headers={"x-prefiller-host-port": target},
                   json={"model": "sim-model", "prompt": PROMPT + "one", "max_tokens": 6})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 6
    assert out.get("kv_transfer_params") is None
    assert metric(p_url, "kvsim_nixl_reads_total") == reads + 1
    assert metric(d_url, "kvsim_nixl_transfers_total", outcome="ok") == transfers + 1
    # the decoder got the prompt from the prefill pod (vLLM counts the whole prompt as external,
    # the last token too, though it recomputes that one for its logits)
    prompt_tokens = out["usage"]["prompt_tokens"]
    assert metric(d_url, "vllm:external_prefix_cache_hits_total") == external + prompt_tokens
    assert wait_metric(p_url, "kvsim_nixl_leases", 0) == 0
    assert metric(p_url, "kvsim_nixl_lease_timeouts_total") == 0


def test_streaming_through_both_legs_with_the_sdk(fleet):
    p_url, d_url, side_url, target = fleet
    transfers = metric(d_url, "kvsim_nixl_transfers_total", outcome="ok")
    client = openai.OpenAI(base_url=side_url + "/v1", api_key="none", max_retries=0, timeout=20)
    stream = client.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": PROMPT + "two"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}, extra_headers={"x-prefiller-host-port": target})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 8
    assert text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    assert metric(d_url, "kvsim_nixl_transfers_total", outcome="ok") == transfers + 1
    assert wait_metric(p_url, "kvsim_nixl_leases", 0) == 0


def test_prefill_pod_error_falls_back_to_local_prefill(fleet):
    p_url, d_url, side_url, target = fleet
    httpx.post(p_url + "/sim/faults", json={"status": 503}, timeout=5).raise_for_status()
    transfers = metric(d_url, "kvsim_nixl_transfers_total")
    fallbacks = metric(side_url, "kvroute_sidecar_prefill_fallbacks_total", reason="server_error")
    r = httpx.post(side_url + "/v1/completions", timeout=20, headers={"x-prefiller-host-port": target},
                   json={"model": "sim-model", "prompt": PROMPT + "three", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    assert metric(d_url, "kvsim_nixl_transfers_total") == transfers  # no NIXL read: computed locally
    assert metric(side_url, "kvroute_sidecar_prefill_fallbacks_total", reason="server_error") == fallbacks + 1


def test_prefill_pod_4xx_is_returned_unchanged(fleet):
    p_url, d_url, side_url, target = fleet
    before = metric(d_url, "vllm:request_success_total")
    r = httpx.post(side_url + "/v1/completions", timeout=20, headers={"x-prefiller-host-port": target},
                   json={"model": "no-such-model", "prompt": "x", "max_tokens": 3})
    assert r.status_code == 404
    assert "no-such-model" in r.json()["error"]["message"]
    assert metric(d_url, "vllm:request_success_total") == before


def test_client_leaving_mid_prefill_aborts_it_on_the_prefill_pod(fleet):
    p_url, d_url, side_url, target = fleet
    httpx.post(p_url + "/sim/faults", json={"slowdown": 50.0}, timeout=5).raise_for_status()
    aborts = metric(p_url, "vllm:request_success_total", finished_reason="abort")
    decoded = metric(d_url, "vllm:request_success_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(side_url + "/v1/completions", timeout=0.5, headers={"x-prefiller-host-port": target},
                   json={"model": "sim-model", "prompt": PROMPT * 3 + "four", "max_tokens": 3})
    assert wait_metric(p_url, "vllm:request_success_total", aborts + 1, finished_reason="abort") == aborts + 1
    assert wait_metric(p_url, "kvsim_nixl_leases", 0) == 0
    assert metric(d_url, "vllm:request_success_total") == decoded
