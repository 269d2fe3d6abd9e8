"""Notices a KV-event publisher that has gone silent while its pod keeps serving.

An idle pod publishes nothing, and that is fine: its cache does not change. A pod that keeps
getting requests but whose publisher says nothing (a crashed publisher thread, a firewall, a wrong
endpoint after a redeploy) has a cache that drifts away from the index: the router would keep
sending prompts there for blocks long evicted. So when a pod's events have stopped for
``silence_s`` while the router had it compute new blocks (which vLLM announces in the step that
fills them, before the first token), its index entries are dropped (it is then routed
on load alone until events resume, when the subscriber's gap replay refills it), a counter goes up
and a warning says so, once per silence.

What counts as serving: requests that stored at least one new full block (the router's
``event_sources``), not every request. A request answered wholly from cache stores nothing and
publishes nothing, and a request's answer ends after its own events were applied; counting those
dropped the index of every pod that went idle after a request (seen against real vLLM). At least
``min_requests`` of them must have been answered since the last batch, so one whose first token
overtook its own batch on the way to the router does not count as silence.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger("kvroute.watchdog")


@dataclass
class _Seen:
    batches: int
    requests: float
    since: float
    cleared: bool = False


class EventSilenceWatchdog:
    def __init__(self, stats: Callable[[], dict[str, dict[str, Any]]], clear_pod: Callable[[str], None],
                 requests_to: Callable[[str], float], silence_s: float, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic, min_requests: int = 2) -> None:
        self.stats, self.clear_pod, self.requests_to = stats, clear_pod, requests_to
        self.silence_s, self.clock, self.min_requests = silence_s, clock, min_requests
        self.clears = Counter("kvroute_event_silence_clears", "Index entries dropped because a pod's KV-event "
                              "publisher was silent while it served requests", ["pod"], registry=registry)
        self._seen: dict[str, _Seen] = {}
        self._task: asyncio.Task | None = None

    def _batches(self) -> dict[str, int]:
        per_pod: dict[str, int] = {}
        for st in self.stats().values():
            pod = st.get("pod_id")
            if pod is not None:
                per_pod[pod] = per_pod.get(pod, 0) + int(st.get("batches") or 0) + int(st.get("replayed_batches") or 0)
        return per_pod

    def check(self) -> list[str]:
        """One look at every pod; returns the pods whose entries were dropped now."""
        now, dropped = self.clock(), []
        per_pod = self._batches()
        for pod in [p for p in self._seen if p not in per_pod]:  # left the fleet: forget it (pods churn)
            self.forget(pod)
        for pod, batches in per_pod.items():
            requests = self.requests_to(pod)
            seen = self._seen.get(pod)
            if seen is None or batches != seen.batches:
                self._seen[pod] = _Seen(batches, requests, now)
                continue
            if seen.cleared or now - seen.since < self.silence_s or requests - seen.requests < self.min_requests:
                continue
            seen.cleared = True
            self.clears.labels(pod).inc()
            log.warning("pod %s: KV event publisher silent for %.1f s while the pod served %d request(s); "
                        "dropping its index entries until events resume", pod, now - seen.since,
                        int(requests - seen.requests))
            try:
                self.clear_pod(pod)
            except Exception:  # noqa: BLE001 - never fatal
                log.exception("clearing pod %s failed", pod)
            dropped.append(pod)
        return dropped

    def forget(self, pod: str) -> None:
        """``pod`` left the fleet: drop what is kept for it, its ``clears`` series included (pods
        churn, each with a new id: a series per pod ever seen would grow without bound). A pod that
        is merely unhealthy keeps its event streams, so it stays here."""
        self._seen.pop(pod, None)
        try:
            self.clears.remove(pod)
        except KeyError:  # never cleared: no series
            pass

    async def _run(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a watchdog must not die
                log.exception("event watchdog check failed")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(min(1.0, self.silence_s / 4)))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


def start_for(services: Any) -> EventSilenceWatchdog | None:
    """The watchdog of a router's ``Services`` (None when ``event_silence_s`` is 0), started."""
    silence_s = services.settings.event_silence_s
    if not silence_s:
        return None

    def stats() -> dict[str, dict[str, Any]]:
        return services.subscriber.stats() if services.subscriber is not None else {}

    def clear(pod: str) -> None:
        if services.index is not None:
            services.index.clear_pod(pod)

    def event_sources(pod: str) -> float:
        router = services.router
        return float(router.event_sources.get(pod, 0)) if router is not None else 0.0

    dog = EventSilenceWatchdog(stats, clear, event_sources, silence_s, registry=services.metrics.registry)
    dog.start()
    return dog
