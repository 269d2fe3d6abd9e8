"""What a pod publishes its KV events on, against what the router subscribes to (router/event_sources.py).

The unit tests compare endpoint lists with answers shaped as vLLM 0.32's ``GET /kv_event_sources``
(recorded from a real engine); the others run the router in this process in front of loopback pods
that answer that route, and read the gauge and the warning.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from router.config import EventEndpoint
from router.event_sources import compare
from tests.helpers import free_port
from tests.test_router_api import Pod, running_router, settings_for, started

# a real engine's answer (vLLM 0.32 CPU, `--kv-events-config` with a replay socket)
PUBLISHED = {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:30249",
                   "replay_endpoint": "tcp://*:28946", "buffer_steps": 10000, "hwm": 100000,
                   "max_queue_size": 100000, "topic": "kv@agg-0@tiny-llama"}}


def ep(endpoint: str, replay: str | None = None, topic: str = "") -> EventEndpoint:
    return EventEndpoint(endpoint=endpoint, replay=replay, topic=topic)


@pytest.mark.unit
def test_a_subscription_agrees_when_its_port_topic_prefix_and_replay_port_do():
    assert compare([ep("tcp://10.0.0.5:30249", "tcp://10.0.0.5:28946", "kv@agg-0@tiny-llama")], PUBLISHED) == []
    assert compare([ep("tcp://svc:30249", None, "kv@")], PUBLISHED) == []   # a prefix; no replay asked
    assert compare([], {}) == [] and compare([], {"0": {"enable_kv_cache_events": False}}) == []
    # two data-parallel ranks, each subscribed on its own ports
    two = {"0": PUBLISHED["0"], "1": {**PUBLISHED["0"], "endpoint": "tcp://*:30250", "replay_endpoint": "tcp://*:28947"}}
    assert compare([ep("tcp://h:30249", "tcp://h:28946"), ep("tcp://h:30250", "tcp://h:28947")], two) == []


@pytest.mark.unit
@pytest.mark.parametrize("subscribed, published, said", [
    ([ep("tcp://h:5557")], PUBLISHED, "it publishes on tcp://*:30249"),
    ([ep("tcp://h:30249", topic="kv@agg-1@")], PUBLISHED, "rank 0 publishes topic 'kv@agg-0@tiny-llama'"),
    ([ep("tcp://h:30249", "tcp://h:5558")], PUBLISHED, "rank 0's replay endpoint is tcp://*:28946"),
    ([ep("tcp://h:30249", "tcp://h:28946")], {"0": {**PUBLISHED["0"], "replay_endpoint": None}}, "is none"),
    ([ep("tcp://h:30249")], {}, "it publishes no KV events"),
    ([ep("tcp://h:30249")], {"0": {**PUBLISHED["0"], "enable_kv_cache_events": False}}, "publishes no KV events"),
    ([], PUBLISHED, "the router subscribes to none of them"),
    ([ep("tcp://h:30249")], ["not", "an", "object"], "is not an object"),
])
def test_what_disagrees_is_named(subscribed, published, said):
    problems = compare(subscribed, published)
    assert len(problems) == 1 and said in problems[0], problems


@dataclass
class SourcesPod(Pod):
    """A recording pod that answers ``/kv_event_sources`` with ``sources`` (None: a 404, as an older vLLM)."""

    sources: dict | None = field(default_factory=lambda: dict(PUBLISHED))

    def routes(self, app: web.Application) -> None:
        super().routes(app)
        app.router.add_get("/kv_event_sources", self.answer)

    async def answer(self, request: web.Request) -> web.Response:
        if self.sources is None:
            return web.Response(status=404)
        return web.json_response(self.sources)


def gauge(services, pod: str) -> float | None:
    for metric in services.metrics.registry.collect():
        for s in metric.samples:
            if s.name == "kvroute_pod_kv_events_mismatch" and s.labels.get("pod") == pod:
                return s.value
    return None


@pytest.mark.e2e
async def test_the_router_says_which_pods_publish_where_it_does_not_listen(caplog):
    pods = [SourcesPod(f"pod-{i}", free_port()) for i in range(3)]
    pods[2].sources = None
    right = [{"endpoint": "tcp://127.0.0.1:30249", "replay": "tcp://127.0.0.1:28946", "topic": "kv@agg-0@"}]
    wrong = [{"endpoint": "tcp://127.0.0.1:30249", "replay": "tcp://127.0.0.1:28946", "topic": "kv@agg-1@"}]
    fleet = [{"id": p.name, "url": p.url, "model": "m", "kv_events": ev}
             for p, ev in zip(pods, (right, wrong, right))]
    settings = settings_for(pods, kv_events_check_interval_s=0.2)
    settings = settings.model_copy(update={"pods": [type(settings.pods[0]).model_validate(f) for f in fleet]})
    caplog.set_level(logging.WARNING, logger="kvroute.event_sources")
    async with started(pods), running_router(settings) as (_, services):
        for _ in range(100):   # 5 s at most
            if gauge(services, "pod-0") is not None and gauge(services, "pod-1") is not None:
                break
            await asyncio.sleep(0.05)
        assert gauge(services, "pod-0") == 0.0 and gauge(services, "pod-1") == 1.0
        assert gauge(services, "pod-2") is None   # it does not say
        said = [r.getMessage() for r in caplog.records if "pod-1" in r.getMessage()]
        assert len(said) == 1 and "topic 'kv@agg-1@'" in said[0] and "kv@agg-0@tiny-llama" in said[0]
        pods[1].sources = {"0": {**PUBLISHED["0"], "topic": "kv@agg-1@tiny-llama"}}   # redeployed: they agree now
        for _ in range(100):
            if gauge(services, "pod-1") == 0.0:
                break
            await asyncio.sleep(0.05)
        assert gauge(services, "pod-1") == 0.0


@pytest.mark.e2e
def test_simulated_pods_answer_kv_event_sources_as_vllm_and_the_router_agrees(tmp_path):
    """The simulated pod's ``/kv_event_sources`` is vLLM's shape; a router subscribed as the harness
    subscribes (each pod's events and replay ports, no topic) finds every pod agreeing, and one
    subscribed to the neighbour's ports finds both disagreeing."""
    import re

    import httpx

    from tests.faults.harness import Sims, router

    with Sims(2) as sims:
        pods = sims.pods()
        answer = httpx.get(pods[1]["url"] + "/kv_event_sources", timeout=5).json()
        port = pods[1]["kv_events"][0]["endpoint"].rsplit(":", 1)[1]
        assert list(answer) == ["0"] and answer["0"]["endpoint"] == f"tcp://*:{port}", answer
        assert answer["0"]["enable_kv_cache_events"] is True and answer["0"]["topic"].endswith("@sim-model")
        crossed = [{**pods[0], "kv_events": pods[1]["kv_events"]}, {**pods[1], "kv_events": pods[0]["kv_events"]}]
        for fleet, expected in ((pods, {"0.0"}), (crossed, {"1.0"})):
            with router(tmp_path, fleet, kv_events_check_interval_s=0.2) as r:
                deadline = time.monotonic() + 10
                while True:
                    text = httpx.get(r.base + "/metrics", timeout=5).text
                    found = re.findall(r'^kvroute_pod_kv_events_mismatch\{pod="[^"]+"\} (\S+)$', text, re.M)
                    if len(found) == 2 or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
                assert len(found) == 2 and set(found) == expected, text[-2000:]
