"""Prometheus metrics of the router, ``kvroute_`` prefix, on an explicit registry (no globals).

Counters and histograms are updated on the request path; per-pod gauges (health, load, booked
work, calibrated rate, index size, event lag) are read from their owners at scrape time by a
custom collector, so nothing has to push them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)
# up to seconds: a big prompt tokenized on the event loop, or a stalled loop, must not read as 0.1 s
ROUTING_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvroute_requests", "Requests answered, by pod, policy and HTTP status",
                                ["pod", "policy", "status"], registry=r)
        # ``requests``' children by (pod, status), looked up once per pod and status (labels() builds a
        # key and takes a lock per call): the one cache of them, so that ``forget_pod`` drops a
        # departed pod's children here and in the counter together
        self.request_children: dict[tuple[str, str], Any] = {}
        self.routing_seconds = Histogram("kvroute_routing_seconds", "Time to decide where a request goes "
                                         "(tokenize, index lookup, predict, rank)", buckets=ROUTING_BUCKETS, registry=r)
        self.predicted_ttft = Histogram("kvroute_predicted_ttft_seconds", "Predicted TTFT on the chosen pod",
                                        buckets=TTFT_BUCKETS, registry=r)
        self.observed_ttft = Histogram("kvroute_observed_ttft_seconds", "Observed TTFT (first upstream byte)",
                                       buckets=TTFT_BUCKETS, registry=r)
        self.prediction_error = Histogram("kvroute_ttft_prediction_error_seconds",
                                          "Absolute error of the TTFT prediction", buckets=TTFT_BUCKETS, registry=r)
        # _sum / _count of this one is the mean absolute percentage error (MAPE) of the predictions
        self.prediction_relative_error = Histogram(
            "kvroute_ttft_prediction_relative_error", "Absolute error of the TTFT prediction over the observed TTFT",
            buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0), registry=r)
        # inside / (inside + below + above) is how often the observed TTFT fell in the predicted interval
        self.ttft_interval = Counter("kvroute_ttft_interval", "Observed TTFTs against the predicted interval "
                                     "(ttft_interval_level): inside, below or above it", ["outcome"], registry=r)
        self.rejections = Counter("kvroute_rejections", "Requests rejected, by reason", ["reason"], registry=r)
        self.retries = Counter("kvroute_retries", "Requests retried on another pod, by cause", ["cause"], registry=r)
        self.prompt_tokens = Counter("kvroute_prompt_tokens", "Prompt tokens routed", registry=r)
        self.estimated_cached_tokens = Counter("kvroute_estimated_cached_tokens",
                                               "Prompt tokens the index said the chosen pod had cached", registry=r)
        self.tokenize_failures = Counter("kvroute_tokenize_failures", "Prompts a pod's /tokenize could not "
                                         "tokenize (tokenizer: remote), routed on load alone, by reason",
                                         ["reason"], registry=r)
        self.tokenize_inline = Counter("kvroute_tokenize_inline", "Large prompts offered to the event loop (it "
                                       "was not crowded) by outcome: done, or too-new (more than "
                                       "tokenize_inline_chars past the cached prefix: tokenized off the loop)",
                                       ["outcome"], registry=r)
        self.tokenize_crowded = Counter("kvroute_tokenize_crowded", "Prompts sent to the tokenize process because "
                                        "the event loop was crowded (tokenize_crowded_bytes and _share)", registry=r)
        self.client_disconnects = Counter("kvroute_client_disconnects", "Streams the client left early", registry=r)
        self.gc_frozen_objects = Gauge("kvroute_gc_frozen_objects", "Objects alive at start-up that kvroute serve "
                                       "moved out of the garbage collector's full collections (gc.freeze)",
                                       registry=r)

    def forget_pod(self, pod_id: str) -> None:
        """``pod_id`` left the fleet: drop its ``kvroute_requests_total`` series (pods churn, each with a
        new id; a series per pod ever seen would grow without bound). Not for a pod that is only
        unhealthy: it comes back, and its series with it. A departed pod that joins again starts
        its series anew (a counter reset, which ``rate()`` takes in its stride), provided whoever
        counts took the child from ``request_children`` (a child cached elsewhere outlives its series)."""
        for key in [k for k in self.request_children if k[0] == pod_id]:
            del self.request_children[key]
        for labels in [lv for lv in list(self.requests._metrics) if lv[0] == pod_id]:
            self.requests.remove(*labels)

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class FleetCollector(Collector):
    """Per-pod gauges read at scrape time from ``snapshot()`` -> {pod: {name: value}}."""

    GAUGES = {
        "healthy": "1 if the pod is in the candidate set",
        "waiting": "Requests waiting on the pod for capacity (its own metric, less those deferred)",
        "waiting_deferred": "Requests waiting on the pod for a KV transfer or other transient constraint "
                            "(its own metric, reason=deferred)",
        "running": "Requests running on the pod (its own metric)",
        "kv_usage": "KV cache usage 0..1 (its own metric)",
        "scrape_age_seconds": "Seconds since the pod's /metrics was last read (waiting, running and KV "
                              "usage are that old; absent before the first read)",
        "booked_requests": "Requests the router sent there that have not produced a first token",
        "booked_tokens": "Prefill tokens the router has booked there",
        "prefill_tokens_per_s": "Calibrated prefill rate",
        "overhead_seconds": "Calibrated fixed TTFT overhead",
        "per_running_seconds": "Calibrated TTFT added per request running on the pod (the batch)",
        "mean_abs_prediction_error_seconds": "Mean absolute TTFT prediction error",
        "index_blocks": "Blocks of the pod in the prefix index",
        "event_lag_seconds": "Lag of the pod's KV events (publish to apply)",
        "event_age_seconds": "Seconds since the pod's last KV event",
    }

    def __init__(self, snapshot: Callable[[], dict[str, dict[str, Any]]],
                 extra: Callable[[], dict[str, float]] | None = None):
        self._snapshot = snapshot
        self._extra = extra

    def describe(self):
        return []

    def collect(self):
        snap = self._snapshot()
        for name, doc in self.GAUGES.items():
            g = GaugeMetricFamily(f"kvroute_pod_{name}", doc, labels=["pod"])
            for pod, values in snap.items():
                v = values.get(name)
                if v is not None:
                    g.add_metric([pod], float(v))
            yield g
        if self._extra:
            for name, value in self._extra().items():
                g = GaugeMetricFamily(f"kvroute_{name}", name.replace("_", " "))
                g.add_metric([], float(value))
                yield g


class IndexCollector(Collector):
    """``kvroute_index_operations_total{kind}``: the prefix index's own counters (blocks stored,
    removed, evicted by the cap, duplicate copies announced and removed, orphans, refusals, ...),
    read at scrape time from ``PrefixIndex.stats()``."""

    def __init__(self, stats: Callable[[], dict[str, Any]], kinds: tuple[str, ...]):
        self._stats = stats
        self._kinds = kinds

    def describe(self):
        return []

    def collect(self):
        stats = self._stats()
        family = CounterMetricFamily("kvroute_index_operations", "Prefix index operations and anomalies, by kind",
                                     labels=["kind"])
        for kind in self._kinds:
            family.add_metric([kind], float(stats.get(kind, 0)))
        yield family
