"""The timing models: a prefix hit cuts TTFT by about the uncached part's compute time.

Assertions use the sim's own simulated figures (``x-sim-ttft-s``: first-token time minus arrival,
``x-sim-prefill-compute-s``) with wide slack, never tight wall-clock thresholds.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from simulator.testing import consecutive_free_ports
from tests.helpers import kvroute_process

PER_TOKEN = 5e-5  # the default cost-model compute time per token


def post(url: str, prompt: list[int], max_tokens: int = 1) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}, timeout=30)
    assert r.status_code == 200, r.text
    return r


def ttft(r: httpx.Response) -> float:
    return float(r.headers["x-sim-ttft-s"])


@pytest.fixture(scope="module")
def cost_pod():
    port = consecutive_free_ports(1)
    with kvroute_process(["sim", "--port", str(port), "--max-num-batched-tokens", "8192"],
                         ready_url=f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def seed_pod():
    port = consecutive_free_ports(1)
    with kvroute_process(["sim", "--port", str(port), "--timing", "seed", "--block-size", "64",
                          "--num-gpu-blocks", "3000", "--prefill-tokens-per-s", "20000",
                          "--decode-s-per-token", "0.001"],
                         ready_url=f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


def test_cost_mode_prefix_hit_cuts_ttft_by_the_uncached_part(cost_pod):
    system = list(range(100, 7100))  # a 7000-token shared prefix
    cold = post(cost_pod, system + list(range(20000, 21000)))          # 8000 tokens, nothing cached
    warm = post(cost_pod, system + list(range(30000, 31000)))          # shares 7000 tokens = 437 blocks
    assert int(cold.headers["x-sim-cached-tokens"]) == 0
    assert int(warm.headers["x-sim-cached-tokens"]) == 437 * 16
    saved = ttft(cold) - ttft(warm)
    expected = 437 * 16 * PER_TOKEN  # compute time of the tokens the hit skips (~0.35 s)
    assert ttft(warm) < ttft(cold) / 3
    assert 0.7 * expected < saved < 1.3 * expected + 0.05


def test_cost_mode_chunked_prefill_takes_several_steps(cost_pod):
    r = post(cost_pod, list(range(40000, 60000)))  # 20000 tokens > the 8192-token budget: 3 chunks
    compute = float(r.headers["x-sim-prefill-compute-s"])
    assert compute == pytest.approx(3 * 0.004 + 20000 * PER_TOKEN, rel=0.1)


def test_seed_mode_computes_only_the_uncached_part(seed_pod):
    system = list(range(100, 6500))  # 6400 tokens = 100 blocks of 64
    cold = post(seed_pod, system + list(range(20000, 21600)))  # 8000 tokens
    warm = post(seed_pod, system + list(range(30000, 31600)))
    assert int(warm.headers["x-sim-cached-tokens"]) == 6400
    assert float(cold.headers["x-sim-prefill-compute-s"]) == pytest.approx(8000 / 20000, rel=1e-6)
    assert float(warm.headers["x-sim-prefill-compute-s"]) == pytest.approx(1600 / 20000, rel=1e-6)
    saved = ttft(cold) - ttft(warm)
    assert 0.7 * (6400 / 20000) < saved < 1.3 * (6400 / 20000) + 0.05


async def test_seed_mode_is_one_fifo_server(seed_pod):
    async with httpx.AsyncClient(timeout=30) as c:
        async def one(i: int) -> httpx.Response:
            await asyncio.sleep(0.02 * i)  # keep the arrival order
            return await c.post(seed_pod + "/v1/completions",
                                json={"prompt": list(range(100000 * (i + 1), 100000 * (i + 1) + 4000)),
                                      "max_tokens": 1})
        rs = await asyncio.gather(*(one(i) for i in range(3)))
    t = [ttft(r) for r in rs]
    # each 4000-token prefill takes 0.2 s and they queue behind one another
    assert t[0] < t[1] < t[2]
    assert t[2] > 0.45
