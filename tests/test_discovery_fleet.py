"""The reconciler every discovery mode feeds: whole-fleet snapshots in, joins/leaves/readiness out."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from router.config import PodConfig, data_parallel_ranks
from router.discovery.fleet import DiscoveredPod, DiscoveryCollector, FleetSync, diff_fleet


def pod(name: str, ip: str = "10.0.0.1", ready: bool = True, role: str = "both") -> DiscoveredPod:
    return DiscoveredPod(PodConfig(id=name, url=f"http://{ip}:8000", role=role, kv_events=[f"tcp://{ip}:5557"]), ready)


def test_diff_tells_joins_leaves_and_readiness_and_treats_a_changed_pod_as_new():
    current = {p.id: p for p in (pod("a"), pod("b"), pod("c"), pod("d"))}
    desired = {p.id: p for p in (pod("a"), pod("b", ready=False), pod("c", ip="10.0.0.9"), pod("e"))}
    changes = diff_fleet(current, desired)
    assert sorted(changes.leave) == ["c", "d"]           # d is gone; c moved (new IP, new cache)
    assert sorted(p.id for p in changes.join) == ["c", "e"]
    assert changes.ready == {"b": False}
    assert diff_fleet(desired, desired) == diff_fleet({}, {})  # nothing to do


def test_sync_applies_changes_in_order_and_one_failure_does_not_stop_the_rest():
    calls: list[tuple] = []

    def join(p: DiscoveredPod) -> None:
        if p.id == "bad":
            raise RuntimeError("boom")
        calls.append(("join", p.id))

    sync = FleetSync(join, lambda pid: calls.append(("leave", pid)), lambda pid, r: calls.append(("ready", pid, r)),
                     mode="kubernetes")
    sync.sync([pod("a"), pod("bad"), pod("b")])
    assert calls == [("join", "a"), ("join", "b")]
    assert sync.stats.errors == {"apply": 1}
    calls.clear()
    sync.sync([pod("a", ip="10.0.0.2"), pod("b", ready=False)])
    # leaves first (bad, gone; and the old incarnation of a), then joins, then readiness
    assert calls == [("leave", "bad"), ("leave", "a"), ("join", "a"), ("ready", "b", False)]
    assert (sync.stats.joins, sync.stats.leaves, sync.stats.readiness_changes) == (4, 2, 1)

    registry = CollectorRegistry()
    registry.register(DiscoveryCollector(sync, lambda: {"ready": 1, "not_ready": 1, "unhealthy": 0}))
    text = generate_latest(registry).decode()
    assert 'kvroute_discovery_pods{state="not_ready"} 1.0' in text
    assert 'kvroute_discovery_changes_total{change="leave"} 2.0' in text
    assert 'kvroute_discovery_errors_total{kind="apply"} 1.0' in text
    assert "kvroute_discovery_last_sync_age_seconds" in text


def test_a_discovered_data_parallel_pod_joins_and_leaves_as_one_pod_per_engine():
    calls: list[tuple] = []
    sync = FleetSync(lambda p: calls.append(("join", p.id, [e.endpoint for e in p.config.kv_events], p.ready)),
                     lambda pid: calls.append(("leave", pid)), lambda pid, r: calls.append(("ready", pid, r)),
                     expand=data_parallel_ranks)
    dp = PodConfig(id="v", url="http://10.0.0.1:8000", kv_events=[f"tcp://10.0.0.1:{5557 + r}" for r in range(2)])
    sync.sync([DiscoveredPod(dp, ready=True)])
    assert calls == [("join", "v#0", ["tcp://10.0.0.1:5557"], True), ("join", "v#1", ["tcp://10.0.0.1:5558"], True)]
    calls.clear()
    sync.sync([DiscoveredPod(dp, ready=False)])
    assert calls == [("ready", "v#0", False), ("ready", "v#1", False)]
    calls.clear()
    sync.sync([])
    assert sorted(calls) == [("leave", "v#0"), ("leave", "v#1")]


def test_a_single_pod_update_makes_the_changes_a_whole_snapshot_would_in_the_same_order():
    """``update`` (one pod changed or gone) against ``sync`` of the whole fleet with that change, over
    a long random run of joins, moves, readiness flips, data-parallel resizes and leaves."""
    import random

    def recorder() -> tuple[FleetSync, list[tuple]]:
        calls: list[tuple] = []
        sync = FleetSync(lambda p: calls.append(("join", p.id, p.config, p.ready)),
                         lambda pid: calls.append(("leave", pid)), lambda pid, r: calls.append(("ready", pid, r)),
                         expand=data_parallel_ranks)
        return sync, calls

    def dp_pod(name: str, ip: int, dp: int, ready: bool) -> DiscoveredPod:
        host = f"10.0.0.{ip}"
        return DiscoveredPod(PodConfig(id=name, url=f"http://{host}:8000", data_parallel_size=dp,
                                       kv_events=[f"tcp://{host}:{5557 + r}" for r in range(dp)]), ready)

    rng = random.Random(7)
    whole, whole_calls = recorder()
    single, single_calls = recorder()
    fleet: dict[str, DiscoveredPod] = {}
    for name in ("a", "b", "c"):  # a first list
        fleet[name] = dp_pod(name, 1, 1, True)
    whole.sync(fleet)
    single.sync(fleet)
    for _ in range(2000):
        name = rng.choice("abcdefgh")
        new = None if rng.random() < 0.25 else dp_pod(name, rng.randint(1, 3), rng.choice((1, 1, 2, 3)),
                                                      rng.random() < 0.6)
        if new is None:
            fleet.pop(name, None)
        else:
            fleet[name] = new
        whole_calls.clear()
        single_calls.clear()
        whole.sync(fleet)
        single.update(name, new)
        assert single_calls == whole_calls
        assert single.current == whole.current
    whole.sync({})
    single.sync({})  # a re-list after updates still knows every unit the updates made
    assert single.current == whole.current == {}
