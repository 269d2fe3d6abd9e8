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
* Each of those API servers has a /metrics of its own, with only its engine (``engine="r"``, its own
  blocks; a dense model's independent per-rank servers: ``engine="0"``): a pod's one ``metrics_url``
  gave ranks above 0 no load and no KV capacity; ``metrics_urls`` gives each rank its own page.
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


# ---------------------------------------------------------------------------------------------
# external-lb: each rank's API server has a /metrics page of its own (PodConfig.metrics_urls)
# ---------------------------------------------------------------------------------------------

def rank_page(label: str, blocks: int, waiting: int, running: int, usage: float) -> str:
    """What one rank's own API server shows: its one engine, its own blocks."""
    return (f'vllm:cache_config_info{{block_size="32",engine="{label}",model_name="m",num_gpu_blocks="{blocks}"}} 1.0\n'
            f'vllm:num_requests_waiting{{engine="{label}",model_name="m"}} {waiting}.0\n'
            f'vllm:num_requests_running{{engine="{label}",model_name="m"}} {running}.0\n'
            f'vllm:kv_cache_usage_perc{{engine="{label}",model_name="m"}} {usage}\n')


async def _scraped(pages: dict[str, str], steer: bool = True, **pod: object) -> dict[str, tuple]:
    """Each routable unit of a pod after one health check and one scrape: its ranks' pages served at
    ``pages``' paths (in rank order) on one loopback server, which is also the pod's url (/health)."""
    from aiohttp import web

    from tests.helpers import serve_routes

    def page(text: str):
        async def handler(request):
            return web.Response(text=text, content_type="text/plain")
        return handler

    routes = [web.get(path + "/metrics", page(text)) for path, text in pages.items()]
    async with serve_routes(web.get("/health", page("ok")), *routes) as port:
        base = f"http://127.0.0.1:{port}"
        config = PodConfig.model_validate({**pod, "url": base, "metrics_urls": [base + path for path in pages]})
        units = data_parallel_ranks(config, steer)
        reg = PodRegistry(units, timeout_s=5.0)
        await reg.start()
        try:
            return {u.id: (reg.pods[u.id].waiting, reg.pods[u.id].running, reg.pods[u.id].num_gpu_blocks,
                           reg.pods[u.id].kv_usage, reg.pods[u.id].block_size) for u in units}
        finally:
            await reg.stop()


@pytest.mark.e2e
@pytest.mark.parametrize("labels", [("0", "1"), ("0", "0")], ids=["global-rank-labels", "independent-servers"])
async def test_each_rank_of_an_external_lb_pod_reads_its_own_servers_page(labels):
    """vLLM 0.32's external-lb rank r (``--data-parallel-rank r``, MoE models) labels its page with its
    global rank and shows its own engine's blocks (``core_client.py``: ``engine_ranks_managed = [r]``); a
    dense model's per-rank servers are independent vLLMs (vLLM refuses external-lb DP for them), each
    ``engine="0"``. Rank 0's page alone (the pod's one metrics_url) left rank 1 with no load and no capacity."""
    pod = {"id": "dec", "role": "decode", "data_parallel_size": 2}
    pages = {"/r0": rank_page(labels[0], 300, 2, 5, 0.25), "/r1": rank_page(labels[1], 200, 7, 1, 0.75)}
    assert await _scraped(pages, **pod) == {"dec#0": (2, 5, 300, 0.25, 32), "dec#1": (7, 1, 200, 0.75, 32)}
    # not steered: one candidate, read from rank 0's server (where a sidecar sends a request naming no rank)
    assert await _scraped(pages, steer=False, **pod) == {"dec": (2, 5, 300, 0.25, 32)}


@pytest.mark.e2e
async def test_a_ranks_page_that_shows_several_engines_is_filtered_by_its_label():
    """A rank's page that fronts several engines (vLLM's summed blocks under each label) is read as the
    pod's one page is: the rank's engine label, its share of the blocks."""
    got = await _scraped({"/a": PAGE, "/b": PAGE}, id="dp", data_parallel_size=2)
    assert {k: v[1:3] for k, v in got.items()} == {"dp#0": (3, 300), "dp#1": (1, 300)}


def test_metrics_urls_are_checked_against_the_pods_ranks():
    def err(**kw) -> str:
        with pytest.raises(ValueError) as exc:
            PodConfig(id="p", url="http://10.0.0.1:8000", **kw)
        return str(exc.value)

    two = ["http://10.0.0.1:8200", "http://10.0.0.1:8201"]
    ok = PodConfig(id="p", url="http://10.0.0.1:8000", data_parallel_size=2, metrics_urls=[two[0], two[1] + "/"])
    assert ok.metrics_urls == two  # a trailing slash goes, as the pod url's does
    by_events = PodConfig(id="p", url="http://10.0.0.1:8000", kv_events=["tcp://a:1", "tcp://a:2"], metrics_urls=two)
    assert [u.metrics_urls for u in data_parallel_ranks(by_events)] == [two, two]
    assert "3 metrics_urls entries for 2 data-parallel engines" in err(data_parallel_size=2,
                                                                        metrics_urls=[*two, "http://10.0.0.1:8202"])
    assert "metrics_urls is for a data-parallel pod" in err(metrics_urls=two[:1])
    assert "exclude each other" in err(data_parallel_size=2, metrics_urls=two, metrics_url="http://10.0.0.1:8200")
    assert "metrics_urls entry 1 must start with http:// or https://, not tcp://" in err(
        data_parallel_size=2, metrics_urls=[two[0], "tcp://10.0.0.1:8201"])
    assert "metrics_urls entry 0 must name a host" in err(data_parallel_size=2, metrics_urls=["http://", two[1]])
    assert "entries 0 and 1 are the same page" in err(data_parallel_size=2, metrics_urls=[two[0], two[0]])


def test_discovery_gives_an_external_lb_pods_ranks_their_own_pages():
    from router.config import RouterSettings
    from router.discovery.dns import pod_for_address
    from router.discovery.kubernetes import pod_from_object

    ann = {"kvroute.io/model": "m", "kvroute.io/http-port": "8000", "kvroute.io/engine-port": "8200",
           "kvroute.io/data-parallel-size": "2"}
    obj = {"metadata": {"name": "dec-1", "labels": {"kvroute.io/role": "decode"}, "annotations": ann},
           "status": {"podIP": "10.1.2.3", "phase": "Running"}}
    c = pod_from_object(obj).config
    assert (c.metrics_url, c.metrics_urls) == ("http://10.1.2.3:8200", [])  # internal-lb: one page
    ann["kvroute.io/data-parallel-mode"] = "external-lb"
    c = pod_from_object(obj).config
    assert (c.metrics_url, c.metrics_urls) == (None, ["http://10.1.2.3:8200", "http://10.1.2.3:8201"])
    ann["kvroute.io/data-parallel-mode"] = "external"
    assert pod_from_object(obj) is None  # an unknown mode is skipped, as an unknown role is
    settings = RouterSettings(discovery="dns", discovery_dns_name="x", discovery_engine_port=8200,
                              discovery_data_parallel_size=2, discovery_data_parallel_mode="external-lb")
    c = pod_for_address("10.1.2.4", settings).config
    assert (c.metrics_url, c.metrics_urls) == (None, ["http://10.1.2.4:8200", "http://10.1.2.4:8201"])
