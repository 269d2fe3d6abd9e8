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
    assert dog.check() == ["p"]         # silent while served: dropped
    now[0] = 20.0
    requests["p"] = 30.0
    assert dog.check() == []            # once per silence
    assert cleared == ["p"]
    assert registry.get_sample_value("kvroute_event_silence_clears_total", {"pod": "p"}) == 1
    batches["p"] = 6                    # events resume: a new silence can be noticed again
    now[0] = 21.0
    assert dog.check() == []
    requests["p"] = 31.0
    now[0] = 25.0
    assert dog.check() == ["p"]
