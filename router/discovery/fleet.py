"""Reconciling a discovered fleet with the router's, and the numbers that tell how it went.

A source says what the fleet *should* be (every pod it knows, with a readiness verdict); this module
compares that with what the router has and applies the difference through three callbacks:
``join(pod)``, ``leave(pod_id)`` and ``set_ready(pod_id, ready)``. A pod whose address, ports, role
or model changed leaves and joins again, because its cache and event streams are not the old ones.
Working from whole snapshots (not single events) is what makes a periodic re-list repair anything a
lost watch event left behind. Between snapshots a source that hears of single changes (a Kubernetes
watch event) applies each with :meth:`FleetSync.update`, which compares that one pod's routable
units only: a burst of N events over a fleet of M pods costs O(N), not O(N x M) as a whole-fleet
sync per event did (1.3 ms of event loop per event at 1,000 pods).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.config import PodConfig

log = logging.getLogger("kvroute.discovery")


@dataclass(frozen=True)
class DiscoveredPod:
    """A pod as discovery sees it: how to reach it, and whether it may take traffic."""

    config: PodConfig
    ready: bool = True

    @property
    def id(self) -> str:
        return self.config.id


@dataclass(frozen=True)
class FleetChanges:
    join: list[DiscoveredPod]
    leave: list[str]
    ready: dict[str, bool]


def diff_fleet(current: Mapping[str, DiscoveredPod], desired: Mapping[str, DiscoveredPod]) -> FleetChanges:
    """What turns ``current`` into ``desired`` (a changed config is a leave plus a join)."""
    join: list[DiscoveredPod] = []
    leave: list[str] = []
    ready: dict[str, bool] = {}
    for pid in current:
        if pid not in desired:
            leave.append(pid)
    for pid, pod in desired.items():
        old = current.get(pid)
        if old is None:
            join.append(pod)
        elif old.config != pod.config:
            leave.append(pid)
            join.append(pod)
        elif old.ready != pod.ready:
            ready[pid] = pod.ready
    return FleetChanges(join, leave, ready)


@dataclass
class DiscoveryStats:
    mode: str = "static"
    syncs: int = 0
    relists: int = 0
    watch_restarts: int = 0
    watch_events: int = 0
    gone: int = 0
    joins: int = 0
    leaves: int = 0
    readiness_changes: int = 0
    skipped_pods: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    last_sync: float | None = None

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


class FleetSync:
    """Applies whole-fleet snapshots (:meth:`sync`) and single-pod changes (:meth:`update`) from a
    discovery source to the router through callbacks."""

    def __init__(self, join: Callable[[DiscoveredPod], None], leave: Callable[[str], None],
                 set_ready: Callable[[str, bool], None], *, mode: str = "static",
                 clock: Callable[[], float] = time.monotonic,
                 expand: Callable[[PodConfig], list[PodConfig]] | None = None):
        self._join, self._leave, self._set_ready = join, leave, set_ready
        self._expand = expand  # a data-parallel pod -> one routable pod per engine (config.data_parallel_ranks)
        self.current: dict[str, DiscoveredPod] = {}
        self._units: dict[str, list[str]] = {}  # source pod id -> the ids of its units in ``current``
        self.stats = DiscoveryStats(mode=mode)
        self._clock = clock

    def sync(self, desired: Iterable[DiscoveredPod] | Mapping[str, DiscoveredPod]) -> FleetChanges:
        """Make the fleet exactly ``desired`` (a whole snapshot: a pod it lacks leaves)."""
        wanted = dict(desired) if isinstance(desired, Mapping) else {p.id: p for p in desired}
        units: dict[str, list[str]] = {}
        if self._expand is not None:
            expanded: dict[str, DiscoveredPod] = {}
            for pid, pod in wanted.items():
                for unit in self._expand(pod.config):
                    expanded[unit.id] = DiscoveredPod(unit, pod.ready)
                    units.setdefault(pid, []).append(unit.id)
            wanted = expanded
        else:
            units = {pid: [pid] for pid in wanted}
        changes = diff_fleet(self.current, wanted)
        self._apply(changes, wanted)
        self._units = units
        return changes

    def update(self, pod_id: str, pod: DiscoveredPod | None) -> FleetChanges:
        """One source pod changed (``pod``) or went (None); the rest of the fleet is left as it is.

        The same changes a :meth:`sync` of the whole fleet with just this pod changed would make, in
        the same order (leaves, joins, readiness), at the cost of this pod's units only."""
        wanted: dict[str, DiscoveredPod] = {}
        if pod is not None:
            if self._expand is None:
                wanted[pod.id] = pod
            else:
                for unit in self._expand(pod.config):
                    wanted[unit.id] = DiscoveredPod(unit, pod.ready)
        # what this pod had, plus whatever already holds an id it now wants (never join over a live id)
        mine = [uid for uid in self._units.get(pod_id, ()) if uid in self.current]
        held = {uid: self.current[uid] for uid in (*mine, *wanted) if uid in self.current}
        changes = diff_fleet(held, wanted)
        self._apply(changes, wanted)
        if wanted:
            self._units[pod_id] = list(wanted)
        else:
            self._units.pop(pod_id, None)
        return changes

    def _apply(self, changes: FleetChanges, wanted: Mapping[str, DiscoveredPod]) -> None:
        for pid in changes.leave:
            self.current.pop(pid, None)
            self.stats.leaves += 1
            log.info("pod %s left the fleet", pid)
            self._safely(self._leave, pid)
        for pod in changes.join:
            self.current[pod.id] = pod
            self.stats.joins += 1
            log.info("pod %s joined the fleet at %s (%s)", pod.id, pod.config.url,
                     "ready" if pod.ready else "not ready")
            self._safely(self._join, pod)
        for pid, ready in changes.ready.items():
            self.current[pid] = wanted[pid]
            self.stats.readiness_changes += 1
            self._safely(self._set_ready, pid, ready)
        self.stats.syncs += 1
        self.stats.last_sync = self._clock()

    def _safely(self, fn: Callable, *args) -> None:
        try:
            fn(*args)
        except Exception:  # one pod's trouble must not stop the rest of the fleet from syncing
            self.stats.error("apply")
            log.exception("applying a fleet change (%s) failed", getattr(fn, "__name__", fn))


class DiscoveryCollector(Collector):
    """``kvroute_discovery_*`` series, read at scrape time from the sync's stats and the registry."""

    def __init__(self, sync: FleetSync, pod_states: Callable[[], dict[str, int]],
                 clock: Callable[[], float] = time.monotonic):
        self._sync = sync
        self._pod_states = pod_states
        self._clock = clock

    def describe(self):
        return []

    def collect(self):
        s = self._sync.stats
        g = GaugeMetricFamily("kvroute_discovery_pods", "Discovered pods by state (ready: may take traffic "
                              "once healthy; not_ready: Kubernetes says not Ready or terminating; "
                              "unhealthy: ready but failing the router's checks)", labels=["state"])
        for state, n in self._pod_states().items():
            g.add_metric([state], float(n))
        yield g
        for name, value, doc in (
                ("relists", s.relists, "Full lists of the fleet (start, periodic, after 410 Gone or errors)"),
                ("watch_restarts", s.watch_restarts, "Watch streams opened again after they ended or broke"),
                ("watch_events", s.watch_events, "Watch events received"),
                ("gone", s.gone, "Watches answered 410 Gone (resource version too old), each followed by a re-list"),
                ("syncs", s.syncs, "Fleet snapshots and single-pod updates applied"),
                ("skipped_pods", s.skipped_pods, "Pods seen without what routing needs (no IP yet, no model)")):
            c = CounterMetricFamily(f"kvroute_discovery_{name}", doc)
            c.add_metric([], float(value))
            yield c
        c = CounterMetricFamily("kvroute_discovery_changes", "Fleet changes applied", labels=["change"])
        for change, value in (("join", s.joins), ("leave", s.leaves), ("readiness", s.readiness_changes)):
            c.add_metric([change], float(value))
        yield c
        c = CounterMetricFamily("kvroute_discovery_errors", "Discovery errors by kind", labels=["kind"])
        for kind, value in sorted(s.errors.items()):
            c.add_metric([kind], float(value))
        yield c
        if s.last_sync is not None:
            g = GaugeMetricFamily("kvroute_discovery_last_sync_age_seconds", "Seconds since the fleet was last synced")
            g.add_metric([], self._clock() - s.last_sync)
            yield g
