"""The sidecar's Prometheus metrics, on a registry of its own (no process-wide state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvcommon.listener import ListenerCollector

_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class SidecarMetrics:
    """Counters and histograms for the legs, fallbacks and refusals, exposed at ``/metrics``.

    ``leg`` is ``prefill``, ``decode`` (the decode leg of a two-leg request, fallbacks included)
    or ``direct`` (a request with no prefill header, or any other path, proxied to the decoder).
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvroute_sidecar_requests", "Requests received, by how they were handled",
                                ["mode"], registry=r)
        self.legs = Counter("kvroute_sidecar_legs", "Upstream legs by outcome", ["leg", "outcome"], registry=r)
        self.leg_seconds = Histogram("kvroute_sidecar_leg_duration_seconds",
                                     "Leg duration from sending the request to the last byte",
                                     ["leg"], buckets=_DURATION_BUCKETS, registry=r)
        self.fallbacks = Counter("kvroute_sidecar_prefill_fallbacks",
                                 "Two-leg requests served by a local prefill after the prefill leg failed",
                                 ["reason"], registry=r)
        self.no_params = Counter("kvroute_sidecar_prefill_without_kv_transfer_params",
                                 "Prefill legs that returned no kv_transfer_params (the one token ended the "
                                 "request), decoded without a transfer", registry=r)
        self.prefill_skipped = Counter("kvroute_sidecar_prefill_skipped",
                                       "Two-leg requests sent straight to the local decoder because one "
                                       "prefill's kv_transfer_params cannot serve them (several prompts "
                                       "or choices)", ["reason"], registry=r)
        self.ssrf_rejections = Counter("kvroute_sidecar_ssrf_rejections",
                                       "Prefill targets refused", ["reason"], registry=r)
        self.client_params_stripped = Counter("kvroute_sidecar_client_kv_transfer_params_stripped",
                                              "Client-sent kv_transfer_params removed", registry=r)
        self.in_flight = Gauge("kvroute_sidecar_requests_in_flight", "Requests being handled", registry=r)
        self.allowlist_entries = Gauge("kvroute_sidecar_allowlist_entries",
                                       "Allowed prefill networks in the current snapshot", registry=r)
        self.allowlist_refresh_errors = Counter("kvroute_sidecar_allowlist_refresh_errors",
                                                "Failed refreshes of an allowlist source", ["source"], registry=r)
        r.register(ListenerCollector("kvroute_sidecar"))

    def render(self) -> bytes:
        return generate_latest(self.registry)
