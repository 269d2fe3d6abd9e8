"""The sidecar in front of a data-parallel decode pod (``--data-parallel-size``), as llm-d's sidecar does it.

``external-lb``: one simulated API server per rank on consecutive ports (``kvroute sim --count 3``:
the prefill pod on P, decode ranks 0 and 1 on P+1 and P+2). ``internal-lb``: one simulated server
with two engines (``kvroute sim --data-parallel-size 2``), which honours ``X-data-parallel-rank``.
Each check reads which engine counted the prompt in its own metrics.
"""

from __future__ import annotations

import json

import httpx
import pytest

from sidecar.config import SidecarSettings
from sidecar.dataparallel import DataParallel, RankError
from simulator.testing import consecutive_free_ports
from tests.helpers import kvroute_process, metric

PROMPT = "Data parallel engines each keep their own cache. " * 8
BODY = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2}


def _ports_apart(n: int, other: int, other_n: int) -> int:
    """The first of ``n`` consecutive free ports, none of them in ``other`` .. ``other + other_n - 1``."""
    while True:
        first = consecutive_free_ports(n)
        if first + n <= other or first >= other + other_n:
            return first


def _scope(port: int, headers: list[tuple[bytes, bytes]] | None = None) -> dict:
    return {"headers": headers or [], "server": ("127.0.0.1", port)}


def test_rank_from_port_and_header_and_refusals():
    dp = DataParallel(SidecarSettings(port=9000, data_parallel_size=4, vllm_url="http://127.0.0.1:8200",
                                      pod_ip="10.1.2.3"))
    assert dp.ports == [9000, 9001, 9002, 9003]
    assert dp.rank(_scope(9000)) is None  # the first port: the decoder (or the router's rank header) decides
    assert dp.rank(_scope(9002)) == 2
    assert dp.rank(_scope(9000, [(b"x-data-parallel-host-port", b"10.1.2.3:9003")])) == 3
    assert dp.rank(_scope(9000, [(b"X-Data-Parallel-Host-Port", b"127.0.0.1:9001")])) == 1
    assert dp.decoder(3) == ("http://127.0.0.1:8203", [])
    assert dp.decoder(None) == ("http://127.0.0.1:8200", [])
    for bad in (b"10.1.2.3:9004", b"10.9.9.9:9001", b"evil.example:9001", b"10.1.2.3", b"10.1.2.3:8999", b""):
        with pytest.raises(RankError):
            dp.rank(_scope(9000, [(b"x-data-parallel-host-port", bad)]))
    with pytest.raises(RankError):  # two different answers: refused rather than guessed
        dp.rank(_scope(9000, [(b"x-data-parallel-host-port", b"10.1.2.3:9001"),
                              (b"x-data-parallel-host-port", b"10.1.2.3:9002")]))
    internal = DataParallel(SidecarSettings(port=9000, data_parallel_size=2, data_parallel_mode="internal-lb",
                                            vllm_url="http://127.0.0.1:8200"))
    assert internal.decoder(1) == ("http://127.0.0.1:8200", [("X-data-parallel-rank", "1")])
    with pytest.raises(ValueError):
        SidecarSettings(port=65535, data_parallel_size=2)


@pytest.fixture(scope="module")
def external():
    """(prefill URL, [rank 0 URL, rank 1 URL], [sidecar port 0 URL, sidecar port 1 URL], prefill target)."""
    base = consecutive_free_ports(3)
    side = _ports_apart(2, base, 3)
    pods = [f"http://127.0.0.1:{base + i}" for i in range(3)]
    with kvroute_process(["sim", "--port", str(base), "--count", "3", "--host", "127.0.0.1"],
                         ready_url=pods[2] + "/health"):
        args = ["sidecar", "--host", "127.0.0.1", "--port", str(side), "--vllm-url", pods[1],
                "--data-parallel-size", "2", "--prefill-allowlist", json.dumps([f"127.0.0.1:{base}"])]
        sides = [f"http://127.0.0.1:{side + r}" for r in range(2)]
        with kvroute_process(args, ready_url=sides[1] + "/health"):
            yield pods[0], pods[1:], sides, f"127.0.0.1:{base}"


def _prompts(urls: list[str]) -> list[float]:
    return [metric(u, "vllm:prompt_tokens_total") for u in urls]


def test_external_lb_port_and_header_pick_the_rank(external):
    prefill, ranks, sides, target = external
    port1 = sides[1].rsplit(":", 1)[1]
    before = _prompts(ranks)
    r = httpx.post(sides[1] + "/v1/completions", json=BODY, timeout=20)
    assert r.status_code == 200, r.text
    n = r.json()["usage"]["prompt_tokens"]
    assert _prompts(ranks) == [before[0], before[1] + n]  # the rank port reached rank 1's API server
    r = httpx.post(sides[0] + "/v1/completions", json=BODY, timeout=20,
                   headers={"x-data-parallel-host-port": f"127.0.0.1:{port1}"})
    assert r.status_code == 200, r.text
    assert _prompts(ranks) == [before[0], before[1] + 2 * n]  # the header did too, from the first port
    r = httpx.post(sides[0] + "/v1/completions", json=BODY, timeout=20)
    assert r.status_code == 200, r.text
    assert _prompts(ranks) == [before[0] + n, before[1] + 2 * n]  # no header on the first port: rank 0
    # the two legs: prefilled on the prefill pod, decoded by the rank the port names
    transfers = [metric(u, "kvsim_nixl_transfers_total", outcome="ok") for u in ranks]
    r = httpx.post(sides[1] + "/v1/completions", json={**BODY, "prompt": PROMPT + " two legs"}, timeout=20,
                   headers={"x-prefiller-host-port": target})
    assert r.status_code == 200, r.text
    assert [metric(u, "kvsim_nixl_transfers_total", outcome="ok") for u in ranks] == [transfers[0], transfers[1] + 1]


def test_external_lb_refuses_an_endpoint_that_is_not_this_pods(external):
    _, ranks, sides, _ = external
    port = int(sides[0].rsplit(":", 1)[1])
    before = _prompts(ranks)
    for value in (f"127.0.0.1:{port + 2}", f"10.0.0.9:{port + 1}", "not a host port"):
        r = httpx.post(sides[0] + "/v1/completions", json=BODY, timeout=20,
                       headers={"x-data-parallel-host-port": value})
        assert r.status_code == 400, (value, r.text)
        err = r.json()["error"]
        assert "x-data-parallel-host-port" in err["message"] and err["type"] == "BadRequestError"
    assert _prompts(ranks) == before  # nothing reached an engine


@pytest.fixture(scope="module")
def internal():
    """(the DP=2 simulated pod's URL, [sidecar port 0 URL, sidecar port 1 URL])."""
    pod = consecutive_free_ports(1)
    side = _ports_apart(2, pod, 1)
    pod_url = f"http://127.0.0.1:{pod}"
    with kvroute_process(["sim", "--port", str(pod), "--host", "127.0.0.1", "--data-parallel-size", "2"],
                         ready_url=pod_url + "/health"):
        args = ["sidecar", "--host", "127.0.0.1", "--port", str(side), "--vllm-url", pod_url,
                "--data-parallel-size", "2", "--data-parallel-mode", "internal-lb"]
        sides = [f"http://127.0.0.1:{side + r}" for r in range(2)]
        with kvroute_process(args, ready_url=sides[1] + "/health"):
            yield pod_url, sides


def test_internal_lb_sets_the_rank_header(internal):
    pod, sides = internal

    def engines() -> list[float]:
        return [metric(pod, "vllm:prompt_tokens_total", engine=str(e)) for e in range(2)]

    before = engines()
    # the rank port's own rank wins over a client's header
    r = httpx.post(sides[1] + "/v1/completions", json=BODY, timeout=20, headers={"X-data-parallel-rank": "0"})
    assert r.status_code == 200, r.text
    n = r.json()["usage"]["prompt_tokens"]
    assert engines() == [before[0], before[1] + n]
    # on the first port the rank header (kvroute's router steering the request) passes through
    for rank in (1, 0):
        r = httpx.post(sides[0] + "/v1/completions", json=BODY, timeout=20,
                       headers={"X-data-parallel-rank": str(rank)})
        assert r.status_code == 200, r.text
    assert engines() == [before[0] + n, before[1] + 2 * n]
