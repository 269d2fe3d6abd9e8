"""Churn: pods come and go all day (rollouts, autoscaling, preemption), each with a new name and IP.
What the router keeps per pod must go with a pod that left the fleet (discovery removed it), and
stay for a pod that is only unhealthy (it comes back). Probed with many pods joining and leaving a
live router; these tests pin what the probe found growing by one series per departed pod."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvcommon.settings import build_settings
from router.config import PodConfig, RouterSettings
from router.discovery import DiscoveredPod
from router.service import Services
from router.watchdog import EventSilenceWatchdog

CYCLES = 40


def _series(services: Services, pod: str) -> list[str]:
    text = services.metrics.exposition().decode()
    return [line for line in text.splitlines() if not line.startswith("#") and f'pod="{pod}"' in line]


def _count(services: Services, pod: str, status: str = "200") -> None:
    """What router/lifecycle.py does when an attempt on ``pod`` ends with ``status``."""
    m = services.metrics
    key = (pod, status)
    child = m.request_children.get(key)
    if child is None:
        child = m.request_children[key] = m.requests.labels(pod, "predicted-ttft", status)
    child.inc()


def test_a_departed_pods_request_series_go_and_an_unhealthy_pods_stay():
    settings = build_settings(RouterSettings, {"pods": [{"id": "stays", "url": "http://127.0.0.1:9", "model": "m"}]})
    services = Services(settings)
    _count(services, "stays")
    for i in range(CYCLES):
        pid = f"churn-{i}"
        cfg = PodConfig(id=pid, url=f"http://10.0.{i // 250}.{i % 250}:8000", model="m")
        services.fleet_sync.update(pid, DiscoveredPod(cfg, True))
        _count(services, pid)
        _count(services, pid, "502")
        services.fleet_sync.update(pid, None)
        assert _series(services, pid) == []
    assert {k[0] for k in services.metrics.request_children} == {"stays"}
    assert {lv[0] for lv in services.metrics.requests._metrics} == {"stays"}
    services._forget_pod("stays")  # unhealthy for forget_after_s: its series stay
    assert len(_series(services, "stays")) == 2  # _total and _created
    # a pod that left and joins again under its id (an IP handed out again) counts afresh
    cfg = PodConfig(id="churn-0", url="http://10.0.0.0:8000", model="m")
    services.fleet_sync.update("churn-0", DiscoveredPod(cfg, True))
    _count(services, "churn-0")
    assert services.metrics.registry.get_sample_value(
        "kvroute_requests_total", {"pod": "churn-0", "policy": "predicted-ttft", "status": "200"}) == 1


def test_the_watchdog_drops_a_departed_pods_series_and_keeps_an_unhealthy_ones():
    now, requests = [0.0], {}
    streams: dict[str, dict] = {}
    registry = CollectorRegistry()
    dog = EventSilenceWatchdog(lambda: dict(streams), lambda pod: None, lambda pod: requests[pod], silence_s=1.0,
                               registry=registry, clock=lambda: now[0])

    def silent_while_serving(pod: str) -> None:
        streams[f"{pod}@e"] = {"pod_id": pod, "batches": 0, "replayed_batches": 0}
        requests[pod] = 0.0
        dog.check()
        now[0] += 2.0
        requests[pod] = 5.0
        assert dog.check() == [pod]

    silent_while_serving("stays")  # later unhealthy: its streams stay with the subscriber
    for i in range(CYCLES):
        silent_while_serving(f"churn-{i}")
        del streams[f"churn-{i}@e"]  # left the fleet: the subscriber dropped its streams
        dog.check()
        assert registry.get_sample_value("kvroute_event_silence_clears_total", {"pod": f"churn-{i}"}) is None
    silent_while_serving("leaves-now")
    dog.forget("leaves-now")  # Services._leave_pod: at once, not at the next check
    assert registry.get_sample_value("kvroute_event_silence_clears_total", {"pod": "leaves-now"}) is None
    assert set(dog._seen) == {"stays"}
    assert registry.get_sample_value("kvroute_event_silence_clears_total", {"pod": "stays"}) == 1
    dog.forget("never-seen")  # no series, no error


@pytest.mark.e2e
async def test_pods_that_join_serve_and_leave_a_live_router_leave_no_series_behind():
    """The probe, short: pods join a running router, serve requests (their KV-event publisher
    silent, so the watchdog clears them), and leave; their series go with them."""
    from tests.helpers import free_port, until
    from tests.test_router_api import Pod, running_router

    base_pod = Pod("base", free_port())
    await base_pod.start()
    settings = build_settings(RouterSettings, {
        "pods": [{"id": "base", "url": base_pod.url, "model": "other",
                  "kv_events": [f"tcp://127.0.0.1:{free_port()}"]}],
        "port": free_port(), "health_interval_s": 0.05, "scrape_interval_s": 0.05, "event_silence_s": 0.4})
    try:
        async with running_router(settings) as (base, services), httpx.AsyncClient(timeout=10) as client:
            async def cycle(i: int) -> None:
                pod = Pod(f"p{i}", free_port())
                await pod.start()
                pid = f"churn-{i}"
                cfg = PodConfig(id=pid, url=pod.url, model="m", kv_events=[f"tcp://127.0.0.1:{free_port()}"])
                services.fleet_sync.update(pid, DiscoveredPod(cfg, True))
                try:
                    await until(lambda: services.registry.pods[pid].healthy, 5, "the pod healthy")
                    for j in range(4):  # new blocks each time, and no event about them
                        resp = await client.post(base + "/v1/completions", json={
                            "model": "m", "prompt": f"turn {i} {j} " * 30, "max_tokens": 2})
                        assert resp.status_code == 200
                        await asyncio.sleep(0.15)
                    await until(lambda: services.watchdog is not None and
                                services.watchdog.clears._metrics.get((pid,)) is not None, 5, "a silence clear")
                    assert _series(services, pid)
                finally:
                    services.fleet_sync.update(pid, None)
                    await pod.stop()
                assert _series(services, pid) == []

            for i in range(4):
                await asyncio.wait_for(cycle(i), 15)
            assert not [lv for lv in services.metrics.requests._metrics if lv[0].startswith("churn-")]
            # the upstream pool forgot the departed pods' addresses (their idle connections closed)
            assert set(services.dispatcher.client._idle) <= {("http", "127.0.0.1", base_pod.port)}
            assert not [lv for lv in services.watchdog.clears._metrics if lv[0].startswith("churn-")]
    finally:
        await base_pod.stop()


@contextlib.asynccontextmanager
async def router_beside(name: str):
    """A live router serving a pod of model "other", and a recording pod ``name`` (model "m") not yet
    in its fleet: yields (base URL, services, that pod, a client)."""
    from tests.helpers import free_port
    from tests.test_router_api import Pod, running_router

    base_pod, pod = Pod("base", free_port()), Pod(name, free_port())
    await base_pod.start()
    await pod.start()
    settings = build_settings(RouterSettings, {
        "pods": [{"id": "base", "url": base_pod.url, "model": "other"}],
        "port": free_port(), "health_interval_s": 0.05, "scrape_interval_s": 0.05})
    try:
        async with running_router(settings) as (base, services), httpx.AsyncClient(timeout=10) as client:
            yield base, services, pod, client
    finally:
        await pod.stop()
        await base_pod.stop()


@pytest.mark.e2e
async def test_a_pod_that_joins_again_under_a_departed_pods_id_is_counted():
    """The lifecycle counts through the metrics' own cache of children, so a pod that rejoins under a
    departed pod's id (an IP reused by DNS discovery) is counted in a live series, not a dropped one."""
    from tests.helpers import until

    async with router_beside("again") as (base, services, pod, client):
        for _ in range(2):
            cfg = PodConfig(id="10.0.0.7", url=pod.url, model="m")
            services.fleet_sync.update("10.0.0.7", DiscoveredPod(cfg, True))
            await until(lambda: services.registry.pods["10.0.0.7"].healthy, 5, "the pod healthy")
            resp = await client.post(base + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
            assert resp.status_code == 200
            assert services.metrics.registry.get_sample_value(
                "kvroute_requests_total", {"pod": "10.0.0.7", "policy": "predicted-ttft", "status": "200"}) == 1
            services.fleet_sync.update("10.0.0.7", None)


@pytest.mark.e2e
async def test_a_departed_pod_that_stays_up_has_its_idle_connections_closed():
    """A pod that leaves the fleet but never closes its connections (a lost node, a partition) kept
    the router's idle connection to it, and its address in the pool, for ever: both go when it leaves."""
    from tests.helpers import until

    async with router_beside("stays-up") as (base, services, pod, client):
        cfg = PodConfig(id="stays-up", url=pod.url, model="m")
        services.fleet_sync.update("stays-up", DiscoveredPod(cfg, True))
        await until(lambda: services.registry.pods["stays-up"].healthy, 5, "the pod healthy")
        resp = await client.post(base + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
        assert resp.status_code == 200
        key = ("http", "127.0.0.1", pod.port)
        pool = services.dispatcher.client
        assert pool._idle.get(key)  # the answer's connection waits for the next request
        conn = pool._idle[key][0]
        services.fleet_sync.update("stays-up", None)
        assert key not in pool._idle
        await until(lambda: conn.closed, 5, "the idle connection closed")
