"""NIXL prefill/decode between two simulated pods, both legs driven by hand (no sidecar)."""

from __future__ import annotations

import time

import httpx
import msgspec
import pytest
import zmq

from simulator.testing import consecutive_free_ports
from tests.helpers import kvroute_process, metric

PROMPT = list(range(3000, 3200))  # 200 tokens = 12 full blocks of 16 + 8


@pytest.fixture(scope="module")
def pair():
    base = consecutive_free_ports(6)
    http, ev = base, base + 2
    with kvroute_process(["sim", "--enable-prompt-tokens-details",
                          "--port", str(http), "--count", "2", "--kv-events-port", str(ev),
                          "--nixl-lease-timeout-s", "1.5", "--nixl-latency-s", "0.05"],
                         ready_url=f"http://127.0.0.1:{http + 1}/health"):
        yield f"http://127.0.0.1:{http}", f"http://127.0.0.1:{http + 1}", f"tcp://127.0.0.1:{ev + 2}"


def prefill_leg(p_url: str, prompt: list[int]) -> dict:
    r = httpx.post(p_url + "/v1/completions", headers={"x-request-id": "pd-1"}, json={
        "prompt": prompt, "max_tokens": 1, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                               "remote_block_ids": None, "remote_host": None, "remote_port": None}})
    assert r.status_code == 200, r.text
    return r.json()


def test_prefill_then_decode_moves_kv_and_ends_the_lease(pair):
    p_url, d_url, d_events = pair
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 3000)
        sub.connect(d_events)
        time.sleep(0.3)

        p = prefill_leg(p_url, PROMPT)
        assert p["usage"]["completion_tokens"] == 1 and p["choices"][0]["finish_reason"] == "length"
        kv = p["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        for key in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size"):
            assert kv[key] is not None, key
        assert kv["remote_host"] == "127.0.0.1" and f":{kv['remote_port']}" in p_url
        groups = kv["remote_block_ids"]
        assert isinstance(groups, list) and len(groups) == 1 and len(groups[0]) == 13  # ceil(200 / 16)
        assert kv["remote_num_tokens"] == 200

        # the producer holds the blocks until the decoder reads them
        assert metric(p_url, "kvsim_nixl_leased_blocks") == 13
        assert metric(p_url, "kvsim_nixl_leases") == 1
        assert metric(p_url, "vllm:kv_cache_usage_perc") > 0

        d = httpx.post(d_url + "/v1/completions", headers={"x-request-id": "pd-1"},
                       json={"prompt": PROMPT, "max_tokens": 5, "kv_transfer_params": kv})
        assert d.status_code == 200, d.text
        out = d.json()
        assert out["usage"]["completion_tokens"] == 5 and out["kv_transfer_params"] is None
        # vLLM 0.32 reports the prefill pod's own hits (kv_transfer_params' remote_prefill_cached_tokens,
        # 0 here: P was cold), not the 199 transferred tokens (v1/engine/output_processor.py)
        assert kv["remote_prefill_cached_tokens"] == 0
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert d.headers["x-sim-cached-tokens"] == "199"  # the decoder did receive all but the last token
        assert metric(d_url, "kvsim_nixl_transfers_total", outcome="ok") == 1
        # vLLM 0.32 counts the whole prompt as transferred (measured: external hits = prompt tokens)
        assert metric(d_url, "vllm:external_prefix_cache_hits_total") == 200
        assert metric(d_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 200
        assert metric(d_url, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0
        # the decoder only computed the last prompt token itself
        assert float(d.headers["x-sim-prefill-compute-s"]) < 0.02
        # the read ended the lease
        assert metric(p_url, "kvsim_nixl_leased_blocks") == 0
        assert metric(p_url, "kvsim_nixl_reads_total") == 1

        # the decoder announced the received blocks: BlockStored with the prompt's tokens
        stored = []
        while sum(len(e["block_hashes"]) for e in stored) < 12:
            _, _, payload = sub.recv_multipart()
            stored += [e for e in msgspec.msgpack.decode(payload)[1] if e["type"] == "BlockStored"]
        assert stored[0]["parent_block_hash"] is None
        assert [t for e in stored for t in e["token_ids"]][:192] == PROMPT[:192]

        # a second read of the same lease is refused: the decoder falls back to local prefill
        again = httpx.post(d_url + "/v1/completions", json={"prompt": PROMPT[:100] + [1] * 100, "max_tokens": 1,
                                                            "kv_transfer_params": kv})
        assert again.status_code == 200
        assert metric(d_url, "kvsim_nixl_transfers_total", outcome="failed") == 1
    finally:
        ctx.destroy(0)


def test_lease_times_out_without_a_read(pair):
    p_url, d_url, _ = pair
    before = metric(p_url, "kvsim_nixl_lease_timeouts_total")
    kv = prefill_leg(p_url, list(range(7000, 7100)))["kv_transfer_params"]
    assert metric(p_url, "kvsim_nixl_leased_blocks") == 7
    deadline = time.monotonic() + 10
    while metric(p_url, "kvsim_nixl_leased_blocks") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(p_url, "kvsim_nixl_leased_blocks") == 0
    assert metric(p_url, "kvsim_nixl_lease_timeouts_total") == before + 1
    # the decoder's read now fails and it computes the prompt itself
    d = httpx.post(d_url + "/v1/completions", json={"prompt": list(range(7000, 7100)), "max_tokens": 1,
                                                    "kv_transfer_params": kv})
    assert d.status_code == 200
    assert d.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_decoder_refuses_hosts_outside_the_allowlist(pair):
    p_url, d_url, _ = pair
    kv = prefill_leg(p_url, list(range(8000, 8050)))["kv_transfer_params"]
    bad = {**kv, "remote_host": "10.255.255.1"}
    before = metric(d_url, "kvsim_nixl_transfers_total", outcome="invalid")
    d = httpx.post(d_url + "/v1/completions", json={"prompt": list(range(8000, 8050)), "max_tokens": 1,
                                                    "kv_transfer_params": bad}, timeout=5)
    assert d.status_code == 200
    assert metric(d_url, "kvsim_nixl_transfers_total", outcome="invalid") == before + 1
    # flat (pre-0.33) remote_block_ids are accepted too
    flat = {**kv, "remote_block_ids": kv["remote_block_ids"][0]}
    d = httpx.post(d_url + "/v1/completions", json={"prompt": list(range(8000, 8050)), "max_tokens": 1,
                                                    "kv_transfer_params": flat})
    assert d.headers["x-sim-cached-tokens"] == "49"


def test_decode_leg_reports_the_prefill_pods_hits_as_cached_tokens(pair):
    """vLLM 0.32: the scheduler adds ``remote_prefill_cached_tokens`` (P's prefix-cache hits) to the
    prefill answer's params (v1/core/sched/scheduler.py), and a decode request carrying it reports that
    number as ``prompt_tokens_details.cached_tokens`` (v1/engine/output_processor.py), whatever it
    transferred; without it (a proxy that dropped it), the decoder's own count."""
    p_url, d_url, _ = pair
    prompt = list(range(9000, 9100))
    prefill_leg(p_url, prompt)                       # warm P: the next prefill of it hits 96 tokens
    kv = prefill_leg(p_url, prompt)["kv_transfer_params"]
    assert kv["remote_prefill_cached_tokens"] == 96
    d = httpx.post(d_url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "kv_transfer_params": kv})
    assert d.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert d.headers["x-sim-cached-tokens"] == "99"
    kv = prefill_leg(p_url, prompt)["kv_transfer_params"]
    kv.pop("remote_prefill_cached_tokens")
    d = httpx.post(d_url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "kv_transfer_params": kv})
    assert d.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 99


def test_a_decode_leg_waiting_for_its_read_counts_as_deferred_waiting():
    """As vLLM 0.32: a request waiting for its KV counts in vllm:num_requests_waiting, and under
    vllm:num_requests_waiting_by_reason{reason="deferred"}, not under "capacity"."""
    import threading

    base = consecutive_free_ports(2)
    with kvroute_process(["sim", "--enable-prompt-tokens-details",
                          "--port", str(base), "--count", "2", "--nixl-latency-s", "1.5"],
                         ready_url=f"http://127.0.0.1:{base + 1}/health"):
        p_url, d_url = f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"
        kv = prefill_leg(p_url, PROMPT)["kv_transfer_params"]
        answers: list[int] = []
        leg = threading.Thread(target=lambda: answers.append(httpx.post(
            d_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": kv},
            timeout=30).status_code))
        leg.start()
        try:
            deadline = time.monotonic() + 5
            while metric(d_url, "vllm:num_requests_waiting") == 0:
                assert time.monotonic() < deadline, "the decode leg never showed as waiting"
                time.sleep(0.05)
            assert metric(d_url, "vllm:num_requests_waiting_by_reason", reason="deferred") == 1
            assert metric(d_url, "vllm:num_requests_waiting_by_reason", reason="capacity") == 0
        finally:
            leg.join(30)
        assert answers == [200]
        assert metric(d_url, "vllm:num_requests_waiting") == 0
        assert metric(d_url, "vllm:num_requests_waiting_by_reason", reason="deferred") == 0
