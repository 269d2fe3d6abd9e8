"""The router's P/D mode: state and I/O around the pure decision in ``scheduling/pd.py``.

When a model has healthy decode pods, each request is planned here instead of by the aggregated
policies: decode pods are candidates (addressed at their sidecar, ``url``), prefill pods are the
targets named in ``x-prefiller-host-port``. This module keeps what the pure functions need and
cannot know: the KV the router has sent to each decode pod and not yet seen start, the prefill work
booked on prefill pods, the address of each prefill pod as the sidecar must be told it, and the
calibration from the sidecar's ``x-kvroute-prefill-ms`` answer header.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping
from urllib.parse import urlsplit

import orjson
from prometheus_client import CollectorRegistry, Counter, Histogram

from router.scheduling.pd import DecodeView, Option, PDDecision, PDParams, decide_pd
from router.scheduling.decide import Decision
from router.scheduling.snapshot import Prediction, RequestView

if TYPE_CHECKING:  # pragma: no cover
    from router.config import PodConfig, RouterSettings
    from router.routing import Booking, Plan, Router

PREFILL_HEADER = "x-prefiller-host-port"
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
PREFILL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)


def host_port(url: str) -> str:
    """``host:port`` of a pod URL as the sidecar's header wants it (IPv6 bracketed, default ports filled)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def prefill_targets(pods: Iterable["PodConfig"]) -> list[str]:
    """The published prefill set: every prefill pod's ``host:port`` the router may name (sorted, unique)."""
    return sorted({host_port(p.url) for p in pods if p.role == "prefill"})


def params_from_settings(s: "RouterSettings") -> PDParams:
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


@dataclass
class PDBooking:
    """What one P/D request holds: prefill work on the prefill pod (remote) and KV on the decode pod."""

    mode: str
    decode_pod: str
    prefill_pod: str | None
    prefill_ticket: int | None
    prefill_work_tokens: float
    kv_ticket: int
    released: bool = False


class PDRouting:
    """P/D planning and accounting; one per router, used only for models with decode pods."""

    def __init__(self, settings: "RouterSettings", registry: CollectorRegistry):
        self.settings = settings
        self.params = params_from_settings(settings)
        # one set per registry: a second router on the same registry (a restart in-process) shares it
        self.metrics = getattr(registry, "_kvroute_pd_metrics", None) or PDMetrics(registry)
        registry._kvroute_pd_metrics = self.metrics  # type: ignore[attr-defined]
        self._kv: dict[str, dict[int, float]] = {}
        self._ids = itertools.count(1)

    # ---- request body ----------------------------------------------------------------------
    def sanitize_body(self, raw: bytes, body: dict[str, Any]) -> bytes:
        """Drop a client's ``kv_transfer_params``: its ``remote_host`` would steer a NIXL read."""
        if not self.settings.strip_client_kv_transfer_params or "kv_transfer_params" not in body:
            return raw
        del body["kv_transfer_params"]
        self.metrics.stripped.inc()
        return orjson.dumps(body)

    # ---- planning --------------------------------------------------------------------------
    def active(self, router: "Router", model: str) -> bool:
        return any(p.config.role == "decode" and p.config.model == model for p in router.registry.healthy())

    def output_tokens(self, body: Mapping[str, Any]) -> int:
        value = body.get("max_completion_tokens", body.get("max_tokens"))
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        return self.settings.pd_expected_output_tokens

    def kv_booked(self, pod_id: str) -> tuple[int, float]:
        held = self._kv.get(pod_id)
        return (len(held), sum(held.values())) if held else (0, 0.0)

    def plan(self, router: "Router", kind: str, model: str, tokens: list[int], keys: list[int],
             request: RequestView, body: Mapping[str, Any], dry_run: bool) -> "Plan":
        from router.routing import Plan

        healthy = [p for p in router.registry.healthy() if p.config.model == model]
        decodes = [p for p in healthy if p.config.role == "decode"]
        prefills = [p for p in healthy if p.config.role == "prefill"]
        cands = router.candidates(decodes + prefills, keys, tokens)
        by_id = {c.pod_id: c for c in cands}
        views = []
        for p in decodes:
            active, booked = self.kv_booked(p.id)
            capacity = p.num_gpu_blocks * (p.block_size or router.block_size) if p.num_gpu_blocks else None
            views.append(DecodeView(candidate=by_id[p.id], kv_capacity_tokens=capacity, kv_booked_tokens=booked,
                                    active_requests=active))
        pd = decide_pd(views, [by_id[p.id] for p in prefills], request, self.output_tokens(body), self.params,
                       admission=self.settings.admission, slack=self.settings.admission_slack)
        decision = Decision(ranked=[by_id[o.decode_pod] for o in pd.ranked],
                            predictions={o.decode_pod: _prediction(o) for o in pd.ranked}, verdict=pd.verdict)
        if not dry_run:
            outcome = pd.chosen.mode if pd.chosen else "rejected"
            self.metrics.decisions.labels(pd.decider, outcome).inc()
        return Plan(kind=kind, model=model, tokens=tokens, keys=keys, request=request, decision=decision,
                    pods={p.id: p for p in healthy}, pd=pd)

    def option(self, plan: "Plan", pod_id: str) -> Option:
        return next(o for o in plan.pd.ranked if o.decode_pod == pod_id)

    def headers_for(self, plan: "Plan", pod_id: str, headers: dict[str, str]) -> dict[str, str]:
        """The upstream headers for one decode pod: the prefill pod's address when prefill is remote."""
        if plan.pd is None:
            return headers
        o = self.option(plan, pod_id)
        target = o.prefill_pod
        if target is None or target not in plan.pods:
            return headers
        return {**headers, PREFILL_HEADER: host_port(plan.pods[target].config.url)}

    # ---- accounting ------------------------------------------------------------------------
    def book(self, router: "Router", plan: "Plan", pod_id: str) -> "Booking":
        from router.routing import Booking

        o = self.option(plan, pod_id)
        kv_ticket = next(self._ids)
        self._kv.setdefault(pod_id, {})[kv_ticket] = float(o.kv_needed_tokens)
        router.metrics.prompt_tokens.inc(plan.request.prompt_tokens)
        router.metrics.predicted_ttft.observe(o.ttft_s)
        if o.mode == "remote" and o.remote is not None:
            r = o.remote
            ticket = router.ledger.book(r.prefill_pod, r.prediction.uncached_tokens)
            prefill_pod, work = r.prefill_pod, r.prediction.queue_s * _rate(plan, r.prefill_pod, router) + \
                r.prediction.uncached_tokens
            router.speculate(r.prefill_pod, plan.keys)
            router.speculate(pod_id, plan.keys)  # the decoder stores the blocks it reads
            self.metrics.transfer_predicted.observe(r.transfer_s)
            self.metrics.transfer_tokens.inc(r.transfer_tokens)
            main_ticket, cached = -1, plan.request.prompt_tokens - r.prediction.uncached_tokens
            queue_tokens = 0.0
        else:
            prefill_pod, ticket, work = None, None, 0.0
            main_ticket = router.ledger.book(pod_id, o.local.uncached_tokens)
            router.speculate(pod_id, plan.keys)
            cached = plan.request.prompt_tokens - o.local.uncached_tokens
            queue_tokens = o.local.queue_s * _rate(plan, pod_id, router) + o.local.uncached_tokens
        router.metrics.estimated_cached_tokens.inc(max(cached, 0))
        booking = Booking(pod_id=pod_id, ticket=main_ticket, work_tokens=queue_tokens, predicted_ttft_s=o.ttft_s,
                          cached_tokens=max(cached, 0), sent_at=router._clock())
        booking.pd = PDBooking(mode=o.mode, decode_pod=pod_id, prefill_pod=prefill_pod, prefill_ticket=ticket,
                               prefill_work_tokens=work, kv_ticket=kv_ticket)
        return booking

    def release(self, router: "Router", booking: "Booking") -> None:
        """First token seen, or the request ended: the prefill is over and the KV shows in the pod's usage."""
        b: PDBooking | None = booking.pd
        if b is None or b.released:
            return
        b.released = True
        if b.prefill_pod is not None and b.prefill_ticket is not None:
            router.ledger.release(b.prefill_pod, b.prefill_ticket)
        held = self._kv.get(b.decode_pod)
        if held is not None:
            held.pop(b.kv_ticket, None)

    def observe_answer(self, router: "Router", booking: "Booking", headers: Mapping[str, str]) -> None:
        """Learn the prefill pod's speed from the sidecar's report of its prefill leg."""
        b: PDBooking | None = booking.pd
        if b is None:
            return
        outcome = headers.get("x-kvroute-prefill")
        if outcome:
            self.metrics.sidecar_outcomes.labels(outcome if outcome in ("remote", "local", "fallback") else "other").inc()
        raw = headers.get("x-kvroute-prefill-ms")
        if raw is None or b.prefill_pod is None or outcome not in ("remote", "local"):
            return
        try:
            seconds = float(raw) / 1000.0
        except ValueError:
            return
        if seconds >= 0:
            self.metrics.prefill_observed.observe(seconds)
            router.calibrator.observe(b.prefill_pod, b.prefill_work_tokens, seconds)


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


def _rate(plan: "Plan", pod_id: str, router: "Router") -> float:
    return router.calibrator.pod(pod_id).rate


def _prediction(o: Option) -> Prediction:
    """The chosen path of one decode pod as a plain prediction (for the shared accounting and errors)."""
    if o.mode == "remote" and o.remote is not None:
        p = o.remote.prediction
        return Prediction(queue_s=p.queue_s, prefill_s=p.prefill_s, overhead_s=o.ttft_s - p.queue_s - p.prefill_s,
                          uncached_tokens=p.uncached_tokens)
    return o.local
