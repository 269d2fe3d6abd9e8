"""Prefill/decode disaggregation's I/O around the pure planner (``scheduling/planners.PDPlanner``).

When a model has healthy decode pods, requests go to a decode pod's sidecar (its ``url``) and the
prefill pod is named in ``x-prefiller-host-port``. This module holds what that needs besides the
decision: the prefill pods' addresses as the sidecar must be told them (and the list the sidecars'
allowlists read), the client-``kv_transfer_params`` strip, the sidecar's report of its prefill leg
(``x-kvroute-prefill``/``-ms``, from which the router calibrates the prefill pod), the
``kvroute_pd_*`` metrics and ``/debug/route``'s P/D part.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvcommon.transfer import drop_client_params
from router.config import PodConfig, RouterSettings
from router.scheduling.decide import Route
from router.scheduling.pd import PDDecision, PDParams

if TYPE_CHECKING:
    from router.pods import PodState

PREFILL_HEADER = "x-prefiller-host-port"
RANK_HEADER = "x-data-parallel-rank"   # vLLM: which of the pod's data-parallel engines takes the request
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
PREFILL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)


def host_port(url: str) -> str:
    """``host:port`` of a pod URL as the sidecar's header wants it (IPv6 bracketed, default ports filled)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def prefill_targets(pods: Iterable[PodConfig]) -> list[str]:
    """The published prefill set: every prefill pod's ``host:port`` the router may name (sorted, unique)."""
    return sorted({host_port(p.url) for p in pods if p.role == "prefill"})


def params_from_settings(s: RouterSettings) -> PDParams:
    return PDParams(decider=s.pd_decider, non_cached_tokens=s.pd_non_cached_tokens, prompt_tokens=s.pd_prompt_tokens,
                    kv_bytes_per_token=s.kv_bytes_per_token, link_bandwidth_bytes_per_s=s.kv_link_bandwidth_bytes_per_s,
                    link_latency_s=s.kv_link_latency_ms / 1000.0, decode_step_s=s.pd_decode_step_ms / 1000.0,
                    tpot_tolerance=s.pd_tpot_tolerance, work_weight=s.work_weight,
                    remote_margin_s=s.pd_remote_margin_ms / 1000.0)


class PDMetrics:
    """P/D counters on the router's registry (``kvroute_pd_*``)."""

    def __init__(self, registry: CollectorRegistry):
        self.decisions = Counter("kvroute_pd_decisions", "P/D decisions by decider and outcome "
                                 "(remote, local, rejected)", ["decider", "outcome"], registry=registry)
        self.transfer_predicted = Histogram("kvroute_pd_transfer_predicted_seconds", "Predicted KV transfer time "
                                            "of requests sent for remote prefill", buckets=TRANSFER_BUCKETS,
                                            registry=registry)
        self.transfer_tokens = Counter("kvroute_pd_transfer_predicted_tokens", "Tokens of KV predicted to move "
                                       "from prefill to decode pods", registry=registry)
        self.prefill_observed = Histogram("kvroute_pd_prefill_leg_seconds", "Prefill leg durations the sidecars "
                                          "reported (x-kvroute-prefill-ms)", buckets=PREFILL_BUCKETS, registry=registry)
        self.sidecar_outcomes = Counter("kvroute_pd_sidecar_prefill", "How sidecars served remote-prefill requests "
                                        "(x-kvroute-prefill: remote, local, fallback)", ["outcome"], registry=registry)
        self.stripped = Counter("kvroute_client_kv_transfer_params_stripped", "Client bodies whose "
                                "kv_transfer_params the router removed", registry=registry)


def pd_metrics(registry: CollectorRegistry) -> PDMetrics:
    """The P/D metrics of ``registry``: one set per registry, so a second router on the same registry
    (a restart in-process, a test) shares it."""
    found = getattr(registry, "_kvroute_pd_metrics", None)
    if found is None:
        found = PDMetrics(registry)
        registry._kvroute_pd_metrics = found  # type: ignore[attr-defined]
    return found


def computed_whole(pod: PodState) -> bool:
    """Whether a request of a route with no prefill leg may go to ``pod``: any pod but a prefill pod.
    A P/D sidecar runs the two legs for the chat and completion routes only and passes every other
    route to its decode engine as it is, which computes the prompt itself (its ``kv_both`` NIXL role
    computes prompts as an aggregated engine does): in the P/D planner the decode pod's local path
    (``no prefill pod is available``), booked and predicted as one."""
    return pod.config.role != "prefill"


def sanitize_body(raw: bytes, body: dict[str, Any], strip: bool, metrics: PDMetrics) -> bytes:
    """Drop a client's ``kv_transfer_params``, top-level and under ``vllm_xargs``
    (``kvcommon.transfer.drop_client_params``)."""
    if not strip or ("kv_transfer_params" not in body and "vllm_xargs" not in body) \
            or not drop_client_params(body):  # the key tests first: most bodies have neither
        return raw
    metrics.stripped.inc()
    return orjson.dumps(body)


def prefill_header(route: Route, pods: Mapping[str, PodConfig]) -> dict[str, str]:
    """The headers that steer the pod the request is sent to: on a remote route, where its sidecar
    should prefill; and when that pod (the aggregated or decode pod) is one engine of a data-parallel
    pod, vLLM's header naming the engine (the sidecar passes it to the decode leg only). The prefill
    leg carries no rank: llm-d's prefill header has no room for one, so vLLM balances a prefill
    pod's engines."""
    headers: dict[str, str] = {}
    pod = pods.get(route.pod_id)
    if pod is not None and pod.dp_rank is not None:
        headers[RANK_HEADER] = str(pod.dp_rank)
    if route.mode == "remote" and route.prefill_pod in pods:
        headers[PREFILL_HEADER] = host_port(pods[route.prefill_pod].url)
    return headers


def sidecar_prefill_seconds(headers: Mapping[str, str], metrics: PDMetrics, remote: bool) -> float | None:
    """Count how the sidecar served the request (``x-kvroute-prefill``) and, for a request the
    router sent for remote prefill, return the duration of the prefill leg it reported
    (``x-kvroute-prefill-ms``)."""
    outcome = headers.get("x-kvroute-prefill")
    if outcome:
        metrics.sidecar_outcomes.labels(outcome if outcome in ("remote", "local", "fallback") else "other").inc()
    raw = headers.get("x-kvroute-prefill-ms")
    if raw is None or not remote or outcome not in ("remote", "local"):
        return None
    try:
        seconds = float(raw) / 1000.0
    except ValueError:
        return None
    if not 0.0 <= seconds < math.inf:  # negative, NaN or infinite: no duration
        return None
    metrics.prefill_observed.observe(seconds)
    return seconds


def explain_pd(pd: PDDecision) -> dict[str, Any]:
    """``/debug/route``'s P/D part: both choices, every decode pod's options and the decider's reasoning."""
    chosen = pd.chosen
    rows = []
    for o in pd.ranked:
        rows.append({
            "decode_pod": o.decode_pod, "mode": o.mode, "reason": o.reason, "has_kv_room": o.has_room,
            "kv_free_tokens": None if o.kv_free_tokens is None else round(o.kv_free_tokens),
            "kv_needed_tokens": o.kv_needed_tokens, "predicted_tpot_ms": round(o.tpot_s * 1000, 3),
            "uncached_on_decode": o.uncached_on_decode, "predicted_ttft_ms": round(o.ttft_s * 1000, 3),
            "local_ttft_ms": round(o.local.ttft_s * 1000, 3),
            "remote_ttft_ms": round(o.remote.ttft_s * 1000, 3) if o.remote else None,
            "prefill_pods": [{"pod": r.prefill_pod, "predicted_ttft_ms": round(r.ttft_s * 1000, 3),
                              "queue_ms": round(r.prediction.queue_s * 1000, 3),
                              "prefill_ms": round(r.prediction.prefill_s * 1000, 3),
                              "uncached_tokens": r.prediction.uncached_tokens,
                              "transfer_tokens": r.transfer_tokens,
                              "transfer_ms": round(r.transfer_s * 1000, 3)} for r in o.remote_ranking],
        })
    return {"decider": pd.decider, "decode_pod": chosen.decode_pod if chosen else None,
            "prefill_pod": chosen.prefill_pod if chosen else None,
            "mode": chosen.mode if chosen else None, "reason": chosen.reason if chosen else pd.verdict.reason,
            "best_tpot_ms": round(pd.best_tpot_s * 1000, 3) if pd.best_tpot_s is not None else None,
            "notes": pd.notes, "decode_pods": rows}
