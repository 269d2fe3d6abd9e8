"""Data-parallel pods against vLLM 0.32 (the review of 2026-12-06).

* vLLM's publisher of rank r offsets its PUB and replay ports by r and tags each batch with r
  (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``): a pod the router does not steer per
  engine has one stream per rank, all indexed under one pod id, each under its own rank. A restart
  of one rank's engine, found on reconnect, must clear that rank, not rank 0.
* vLLM's API server reports ``num_gpu_blocks`` in ``vllm:cache_config_info`` as the sum over the
  engines it fronts (``core_client.py``, ``_apply_ready_response``), under each engine's label: one
  engine's capacity is that sum over the engines.
* With ``--data-parallel-external-lb`` each of vLLM's API servers fronts one engine
  (``arg_utils.py``: ``data_parallel_size_local = 1``) and refuses any ``X-data-parallel-rank`` but 0
  (``input_processor.py``: out of range is a 400); the sidecar turns kvroute's rank header on its
  first port into that rank's API server.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import zmq.asyncio

from indexer import wire
from indexer.index import PrefixIndex
from indexer.subscriber import KVEventSubscriber
from router.config import PodConfig, data_parallel_ranks
from router.pods import PodRegistry, parse_vllm_metrics
from sidecar.config import SidecarSettings
from sidecar.dataparallel import DataParallel, RankError
from tests.helpers import free_ports
from tests.test_subscriber import BS, MODEL, Publisher, toks, until


@pytest.mark.e2e
async def test_a_rank_whose_engine_restarts_idle_is_cleared_and_the_other_rank_kept():
    ctx = zmq.asyncio.Context()
    p0, r0, p1, r1 = free_ports(4)
    pubs = [Publisher(ctx, p0, r0), Publisher(ctx, p1, r1)]
    ix = PrefixIndex(block_size=BS)
    sub = KVEventSubscriber(ix, context=ctx, replay_timeout_s=1.0, reconnect_min_s=0.05, reconnect_max_s=0.2)
    for p, r in ((p0, r0), (p1, r1)):  # one pod, one stream per rank (as service.py subscribes an unsteered pod)
        sub.add_endpoint("pod-a", f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{r}", topic="kv@", model=MODEL)
    await sub.start()
    try:
        deadline = time.monotonic() + 10
        while not (ix.blocks_of("pod-a", 0) and ix.blocks_of("pod-a", 1)):
            await pubs[0].publish([wire.stored([1, 2], None, toks(2), BS)], dp_rank=0)
            await pubs[1].publish([wire.stored([11, 12], None, toks(2, base=100), BS)], dp_rank=1)
            await asyncio.sleep(0.05)
            assert time.monotonic() < deadline, sub.stats()
        rank0 = ix.blocks_of("pod-a", 0)
        assert len(rank0) == 2 and len(ix.blocks_of("pod-a", 1)) == 2
        await pubs[1].stop()
        pubs[1]._start()  # rank 1's engine restarted on its ports, silent: found out on reconnect
        await until(lambda: not ix.blocks_of("pod-a", 1), timeout=10)
        assert ix.blocks_of("pod-a", 0) == rank0
        assert [s["restarts"] for s in sub.stats().values()] == [0, 1]
    finally:
        await sub.stop()
        for pub in pubs:
            await pub.stop()
        ctx.destroy(linger=0)


# vLLM 0.32's page for a 2-engine pod whose engines have 300 blocks each: the sum on every engine label
PAGE = """\
vllm:cache_config_info{block_size="32",engine="0",model_name="m",num_gpu_blocks="600"} 1.0
vllm:cache_config_info{block_size="32",engine="1",model_name="m",num_gpu_blocks="600"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
"""


def test_each_engine_of_a_data_parallel_pod_gets_its_share_of_the_reported_blocks():
    pod = PodConfig(id="dp", url="http://10.0.0.1:8000", data_parallel_size=2)
    units = data_parallel_ranks(pod)
    reg = PodRegistry(units)
    for u in units:
        reg.apply_metrics(u.id, parse_vllm_metrics(PAGE, str(u.dp_rank)))
    assert [(reg.pods[u.id].num_gpu_blocks, reg.pods[u.id].running) for u in units] == [(300, 3), (300, 1)]
    whole = PodRegistry([pod])  # not steered: the pod as one candidate holds every engine's blocks
    whole.apply_metrics("dp", parse_vllm_metrics(PAGE))
    assert (whole.pods["dp"].num_gpu_blocks, whole.pods["dp"].running) == (600, 4)


def test_external_lb_sidecar_takes_the_routers_rank_header_to_that_ranks_server():
    dp = DataParallel(SidecarSettings(port=9000, data_parallel_size=3, vllm_url="http://127.0.0.1:8200"))
    hdr = [(b"x-data-parallel-rank", b"2")]
    scope = {"headers": list(hdr), "server": ("127.0.0.1", 9000)}
    assert dp.rank(scope) == 2
    assert dp.decoder(2)[0] == "http://127.0.0.1:8202"
    # rank 2's API server fronts one engine: the header would be refused there, so it does not go on
    assert not [k for k, _ in scope["headers"] if k.lower() == b"x-data-parallel-rank"]
    for raw in (b"3", b"-1"):  # out of range: refused here as vLLM refuses it
        with pytest.raises(RankError):
            dp.rank({"headers": [(b"x-data-parallel-rank", raw)], "server": ("127.0.0.1", 9000)})
    junk = {"headers": [(b"x-data-parallel-rank", b"two")], "server": ("127.0.0.1", 9000)}
    assert dp.rank(junk) is None and not junk["headers"]  # not an integer: ignored, as vLLM ignores it
    on_port = {"headers": list(hdr), "server": ("127.0.0.1", 9001)}
    assert dp.rank(on_port) == 1 and not on_port["headers"]  # a rank port decides
    internal = DataParallel(SidecarSettings(port=9000, data_parallel_size=3, data_parallel_mode="internal-lb",
                                            vllm_url="http://127.0.0.1:8200"))
    scope = {"headers": list(hdr), "server": ("127.0.0.1", 9000)}
    assert internal.rank(scope) is None and scope["headers"] == hdr  # internal-lb: vLLM reads it itself


@pytest.mark.e2e
def test_simulated_data_parallel_pod_reports_the_blocks_of_all_its_engines():
    from simulator.testing import free_port
    from tests.helpers import kvroute_process

    port = free_port()
    with kvroute_process(["sim", "--port", str(port), "--data-parallel-size", "2", "--num-gpu-blocks", "300"],
                         f"http://127.0.0.1:{port}/health"):
        page = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    infos = [line for line in page.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert len(infos) == 2 and all('num_gpu_blocks="600"' in line for line in infos), infos


@pytest.mark.e2e
def test_routers_rank_header_through_an_external_lb_sidecar_reaches_that_ranks_server():
    """kvroute's router sends a decode pod's rank as X-data-parallel-rank to its sidecar's first port.
    Behind an external-lb sidecar each rank's API server fronts one engine: a single-engine server
    refuses rank 1 as vLLM does, and the sidecar sends the request to rank 1's server instead."""
    from simulator.testing import consecutive_free_ports
    from tests.helpers import kvroute_process, metric

    base = consecutive_free_ports(2)
    side = consecutive_free_ports(2)
    while side <= base + 1 and base <= side + 1:
        side = consecutive_free_ports(2)
    ranks = [f"http://127.0.0.1:{base + r}" for r in range(2)]
    body = {"model": "sim-model", "prompt": "Each engine keeps its own prefix cache. " * 8, "max_tokens": 2}
    with kvroute_process(["sim", "--port", str(base), "--count", "2", "--host", "127.0.0.1"],
                         ready_url=ranks[1] + "/health"):
        r = httpx.post(ranks[0] + "/v1/completions", json=body, headers={"X-data-parallel-rank": "1"}, timeout=20)
        assert r.status_code == 400 and r.json()["error"]["message"] == "data_parallel_rank 1 is out of range [0, 1)."
        r = httpx.post(ranks[0] + "/v1/completions", json=body, headers={"X-data-parallel-rank": "x"}, timeout=20)
        assert r.status_code == 200, r.text  # not an integer: vLLM ignores it
        args = ["sidecar", "--host", "127.0.0.1", "--port", str(side), "--vllm-url", ranks[0],
                "--data-parallel-size", "2"]
        with kvroute_process(args, ready_url=f"http://127.0.0.1:{side + 1}/health"):
            before = [metric(u, "vllm:prompt_tokens_total") for u in ranks]
            r = httpx.post(f"http://127.0.0.1:{side}/v1/completions", json=body, timeout=20,
                           headers={"X-data-parallel-rank": "1"})
            assert r.status_code == 200, r.text
            n = r.json()["usage"]["prompt_tokens"]
            assert [metric(u, "vllm:prompt_tokens_total") for u in ranks] == [before[0], before[1] + n]
            r = httpx.post(f"http://127.0.0.1:{side}/v1/completions", json=body, timeout=20,
                           headers={"X-data-parallel-rank": "2"})
            assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]
