"""The silent-publisher rule, as a pure decision on a fake clock."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from router.watchdog import EventSilenceWatchdog


def test_silence_counts_only_while_the_pod_is_served_and_once_per_silence():
    now, batches, requests, cleared = [0.0], {"p": 5}, {"p": 10.0}, []
    registry = CollectorRegistry()
    dog = EventSilenceWatchdog(lambda: {"p@e": {"pod_id": "p", "batches": batches["p"], "replayed_batches": 0}},
                               cleared.append, lambda pod: requests[pod], silence_s=3.0, registry=registry,
                               clock=lambda: now[0])
    assert dog.check() == []            # first look
    now[0] = 10.0
    assert dog.check() == []            # silent for 10 s, but idle: its cache did not change
    requests["p"] = 11.0
    now[0] = 11.0
    assert dog.check() == []            # one answer since the last batch: it may have overtaken its own batch
    requests["p"] = 12.0
    assert dog.check() == ["p"]         # silent while it stored new blocks: dropped
    now[0] = 20.0
    requests["p"] = 30.0
    assert dog.check() == []            # once per silence
    assert cleared == ["p"]
    assert registry.get_sample_value("kvroute_event_silence_clears_total", {"pod": "p"}) == 1
    batches["p"] = 6                    # events resume: a new silence can be noticed again
    now[0] = 21.0
    assert dog.check() == []
    requests["p"] = 32.0
    now[0] = 25.0
    assert dog.check() == ["p"]


def test_an_idle_pod_keeps_its_index_after_requests_that_stored_nothing_new(tmp_path):
    """A pod's answers end after the events they caused, and a prompt answered wholly from cache
    publishes nothing: neither is a silent publisher. The pod goes idle for longer than
    ``event_silence_s`` after both kinds, and its index entries stay."""
    import time

    import httpx
    import yaml

    from simulator.testing import consecutive_free_ports, running_sims, sim_kv_events
    from tests.helpers import free_port, kvroute_process, metric

    events = consecutive_free_ports(2)
    with running_sims(1, ["--kv-events-port", str(events), "--block-size", "16"]) as urls:
        port = free_port()
        cfg = tmp_path / "router.yaml"
        cfg.write_text(yaml.safe_dump({"port": port, "event_silence_s": 1.0, "speculative_ttl_s": 0.05,
                                       "pods": [{"id": "p", "url": urls[0], "kv_events": sim_kv_events(events, 0)}]}))
        base = f"http://127.0.0.1:{port}"
        with kvroute_process(["serve", "--config", str(cfg)], ready_url=base + "/ready"):
            body = {"model": "sim-model", "prompt": "an idle pod keeps what it cached " * 20, "max_tokens": 2}

            def cached() -> int:
                rows = httpx.post(base + "/debug/route", json=body, timeout=10).json()["pods"]
                return sum(rows[0]["cached_tokens_by_tier"].values()) if rows else 0

            assert httpx.post(base + "/v1/completions", json=body, timeout=10).status_code == 200
            deadline = time.monotonic() + 5
            while cached() == 0:
                assert time.monotonic() < deadline, "the prompt was never indexed"
                time.sleep(0.05)
            for _ in range(3):  # answered from cache: no new block, no event
                assert httpx.post(base + "/v1/completions", json=body, timeout=10).status_code == 200
            time.sleep(3.0)  # idle for three silences
            assert metric(base, "kvroute_event_silence_clears_total") == 0
            assert cached() > 0


def test_the_prediction_log_stays_within_its_bound_across_restarts(tmp_path):
    """The prediction log (router/predlog.py, here for want of a module of its own) is appended to:
    a restarted router must count what earlier runs wrote, or each start adds max_bytes more."""
    import types

    from router.predlog import PredictionLog

    booking = types.SimpleNamespace(pod_id="p", prefill_pod=None, mode="aggregated", work_tokens=100.0,
                                    cached_tokens=16, new_blocks=2, running=1, predicted_ttft_s=0.1,
                                    model_ttft_s=0.1, ttft_low_s=0.05, ttft_high_s=float("inf"))
    path = tmp_path / "predictions.jsonl"
    for _ in range(3):  # three runs of the router
        log = PredictionLog(str(path), 2_000)
        for _ in range(100):
            log.write(booking, 0.1)
        log.close()
    assert 1_000 < path.stat().st_size <= 2_000


def test_pods_that_left_are_forgotten_and_one_that_comes_back_is_watched_afresh():
    """Rollouts replace every pod: the watchdog's memory follows the fleet instead of growing with
    every pod it ever saw, and a pod id that returns (a DNS-discovered IP) starts a new silence."""
    fleet, now, cleared = {"p"}, [0.0], []
    requests = {"p": 0.0}
    dog = EventSilenceWatchdog(lambda: {f"{p}@e": {"pod_id": p, "batches": 0} for p in fleet}, cleared.append,
                               lambda pod: requests.get(pod, 0.0), silence_s=3.0, registry=CollectorRegistry(),
                               clock=lambda: now[0])
    assert dog.check() == []
    now[0], requests["p"] = 5.0, 5.0
    assert dog.check() == ["p"]
    for rollout in range(50):
        fleet = {f"pod-{rollout}-{i}" for i in range(4)}
        dog.check()
    assert len(dog._seen) == 4
    fleet = {"p"}                          # the old id is back, a new pod that has not published yet
    now[0] = 6.0
    assert dog.check() == []
    now[0], requests["p"] = 10.0, 10.0
    assert dog.check() == ["p"]            # its own silence is noticed
    assert cleared == ["p", "p"]
