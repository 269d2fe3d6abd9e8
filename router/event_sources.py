"""Checks what each pod publishes its KV events on against what the router subscribes to.

A router that subscribes to the wrong port or topic of a pod hears nothing from it, and nothing says
why: the pod serves, its cache fills, and the index never learns of it (the event watchdog and the
``KvroutePodWithoutKVEvents`` alert see the silence, not its cause). vLLM 0.32 answers
``GET /kv_event_sources`` with each engine's ``--kv-events-config``, by data-parallel rank::

    {"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
           "replay_endpoint": "tcp://*:5558", "topic": "kv@pod-0@model", ...}}

So every ``kv_events_check_interval_s`` the router reads it from each healthy pod (the server of
each rank for an ``external-lb`` pod: ``metrics_urls``) and compares it with the pod's ``kv_events``:
each endpoint the router subscribes to must be a publisher's port (the host is not compared: the
pod binds ``*``, the router connects to an address that may be a Service's), its topic a prefix of
that publisher's topic (ZeroMQ matches topics by prefix), its replay endpoint that publisher's
replay port; and a pod that publishes must be subscribed to. ``kvroute_pod_kv_events_mismatch``
is 1 for a pod where they disagree, 0 where they agree, and absent where the pod does not say (an
older vLLM, a 404); a warning names the difference when a pod turns to disagreeing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

import aiohttp
import orjson
from prometheus_client import CollectorRegistry, Gauge

from router.config import EventEndpoint
from router.pods import PodRegistry, PodState

log = logging.getLogger("kvroute.event_sources")
PATH = "/kv_event_sources"
MAX_ANSWER_BYTES = 1 << 20  # a few hundred bytes a rank


def _port(endpoint: str) -> str:
    """What identifies a publisher across hosts: a TCP endpoint's port, an IPC endpoint's path."""
    if endpoint.startswith("tcp://"):
        return endpoint.rsplit(":", 1)[-1].rstrip("/")
    return endpoint


def compare(subscribed: Iterable[EventEndpoint], published: Any) -> list[str]:
    """What disagrees between the router's endpoints of one pod and the pod's answer to
    ``/kv_event_sources`` (empty: nothing)."""
    if not isinstance(published, dict):
        return ["its /kv_event_sources answer is not an object"]
    publishers = {}
    for rank, cfg in published.items():
        if (isinstance(cfg, dict) and cfg.get("enable_kv_cache_events") and cfg.get("publisher") == "zmq"
                and isinstance(cfg.get("endpoint"), str)):
            publishers[_port(cfg["endpoint"])] = (rank, cfg)
    subscribed = list(subscribed)
    if not publishers:
        return [f"it publishes no KV events, and the router subscribes to {len(subscribed)} endpoint(s)"] \
            if subscribed else []
    if not subscribed:
        shown = ", ".join(f"{cfg['endpoint']} topic {cfg.get('topic', '')!r}" for _, cfg in publishers.values())
        return [f"it publishes KV events ({shown}) and the router subscribes to none of them (kv_events)"]
    problems = []
    for e in subscribed:
        found = publishers.get(_port(e.endpoint))
        if found is None:
            problems.append(f"the router subscribes to {e.endpoint}; it publishes on "
                            f"{', '.join(cfg['endpoint'] for _, cfg in publishers.values())}")
            continue
        rank, cfg = found
        topic = cfg.get("topic") or ""
        if not topic.startswith(e.topic):
            problems.append(f"the router subscribes to topic {e.topic!r} on {e.endpoint}; rank {rank} publishes "
                            f"topic {topic!r} (a subscription matches topics that begin with it)")
        replay = cfg.get("replay_endpoint")
        if e.replay is not None and (not isinstance(replay, str) or _port(replay) != _port(e.replay)):
            problems.append(f"the router asks {e.replay} for missed batches; rank {rank}'s replay endpoint is "
                            f"{replay or 'none'}")
    return problems


class PodPoll:
    """A periodic read of one JSON route (``path``) from each healthy pod's server (``start``/``stop``),
    each answer handed to ``apply`` with the units that server describes. Advice only: a pod that does
    not answer, or not with JSON of at most ``MAX_ANSWER_BYTES``, is skipped for that pass."""

    path = ""
    what = ""  # for the log: what a failed pass was checking

    def __init__(self, registry: PodRegistry, interval_s: float, timeout_s: float = 2.0):
        self.registry, self.interval_s = registry, interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None

    def server(self, pod: PodState) -> str:
        """The base URL of the server that answers ``path`` for this unit."""
        return pod.config.url

    def apply(self, pods: list[PodState], answer: Any) -> None:
        raise NotImplementedError

    def after(self) -> None:
        """At the end of each pass (what is kept of pods that left is dropped here)."""

    def _groups(self) -> dict[str, list[PodState]]:
        """The healthy units by the server that describes them."""
        groups: dict[str, list[PodState]] = {}
        for pod in self.registry.pods.values():
            if pod.healthy:
                groups.setdefault(self.server(pod), []).append(pod)
        return groups

    async def _fetch(self, url: str) -> Any:
        assert self._session is not None
        try:
            async with self._session.get(url + self.path) as resp:
                if resp.status != 200:
                    return None  # an older vLLM (or not vLLM): it does not say
                body = await resp.content.read(MAX_ANSWER_BYTES + 1)
                if len(body) > MAX_ANSWER_BYTES:
                    return None
                return orjson.loads(body)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return None

    async def check(self) -> None:
        """One pass over the fleet."""
        for url, pods in self._groups().items():
            answer = await self._fetch(url)
            if answer is not None:
                self.apply(pods, answer)
        self.after()

    async def _loop(self) -> None:
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # advice only: never stop over it
                log.exception("checking the pods' %s failed", self.what)
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=self.timeout)
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None


class EventSourceCheck(PodPoll):
    """The periodic check and its gauge."""

    path = PATH
    what = "KV-event sources"

    def __init__(self, registry: PodRegistry, interval_s: float, metrics: CollectorRegistry | None = None,
                 timeout_s: float = 2.0):
        super().__init__(registry, interval_s, timeout_s)
        self.mismatch = Gauge("kvroute_pod_kv_events_mismatch", "1 when a pod's KV-event publishers "
                              "(its /kv_event_sources) disagree with the router's kv_events for it, 0 when they "
                              "agree (absent: the pod does not say)", ["pod"], registry=metrics)
        self.problems: dict[str, list[str]] = {}

    def server(self, pod: PodState) -> str:
        config = pod.config  # an external-lb rank's own server describes its engine
        return (config.metrics_urls[config.dp_rank or 0] if config.metrics_urls else None) or config.url

    def apply(self, pods: list[PodState], published: Any) -> None:
        problems = compare((e for p in pods for e in p.config.kv_events), published)
        for pod in pods:
            before = self.problems.get(pod.id)
            self.problems[pod.id] = problems
            self.mismatch.labels(pod.id).set(1.0 if problems else 0.0)
            if problems and problems != before:
                log.warning("pod %s: its KV events do not reach the router's index: %s", pod.id,
                            "; ".join(problems))
            elif before and not problems:
                log.info("pod %s: its KV-event publishers now agree with the router's kv_events", pod.id)

    def after(self) -> None:
        for gone in set(self.problems) - set(self.registry.pods):
            del self.problems[gone]
            try:
                self.mismatch.remove(gone)
            except KeyError:
                pass
