"""The two planners: one interface, a fleet snapshot in, a ``Decision`` out.

``AggregatedPlanner`` ranks pods that prefill and decode alike (scorers, ``decide.py``);
``PDPlanner`` ranks decode pods, each with its choice of local or remote prefill (``pd.py``).
Both are pure over the snapshot, so the live router, ``/debug/route`` and the offline simulator
run the same code. ``Router.plan`` picks the P/D planner when the snapshot has decode pods.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from .decide import Decision, Route, decide
from .pd import DecodeView, Option, PDParams, decide_pd
from .predictor import predict
from .scorers import PolicyState, Scoring
from .snapshot import Candidate, FleetSnapshot, Prediction, RequestView

AGGREGATED_ROLES = ("both",)


class Planner(Protocol):
    def decide(self, snapshot: FleetSnapshot, request: RequestView, dry_run: bool = False) -> Decision: ...


@dataclass
class AggregatedPlanner:
    """Pods of role ``both`` (or, if none is up, every pod of the model) ranked by the scorers.
    ``predictor`` gives each pod's prediction: the router's model (``predictor.predict``), or, in
    ``kvroute simulate``'s ``true-state`` policy, the pod model's true TTFT."""

    scoring: Scoring
    state: PolicyState = field(default_factory=PolicyState)
    admission: bool = True
    slack: float = 1.0
    miss_tolerance: float | None = None
    predictor: Callable[[Candidate, RequestView], Prediction] = predict

    def decide(self, snapshot: FleetSnapshot, request: RequestView, dry_run: bool = False) -> Decision:
        cands = [c for c in snapshot.candidates if c.role in AGGREGATED_ROLES] or list(snapshot.candidates)
        return decide(cands, request, self.scoring, self.state, admission=self.admission, slack=self.slack,
                      dry_run=dry_run, miss_tolerance=self.miss_tolerance, predictor=self.predictor)


@dataclass
class PDPlanner:
    """Decode pods ranked by KV room, decode speed and TTFT, each with local or remote prefill."""

    params: PDParams
    admission: bool = True
    slack: float = 1.0
    miss_tolerance: float | None = None

    def decide(self, snapshot: FleetSnapshot, request: RequestView, dry_run: bool = False) -> Decision:
        decodes = []
        for c in snapshot.by_role("decode"):
            room = snapshot.kv.get(c.pod_id)
            decodes.append(DecodeView(candidate=c, kv_capacity_tokens=room.capacity_tokens if room else None,
                                      kv_booked_tokens=room.booked_tokens if room else 0.0,
                                      active_requests=room.active_requests if room else 0))
        pd = decide_pd(decodes, snapshot.by_role("prefill"), request, request.output_tokens, self.params,
                       admission=self.admission, slack=self.slack, miss_tolerance=self.miss_tolerance)
        by_id = {c.pod_id: c for c in snapshot.candidates}
        return Decision(ranked=[by_id[o.decode_pod] for o in pd.ranked],
                        predictions={o.decode_pod: _prediction(o) for o in pd.ranked}, verdict=pd.verdict,
                        routes={o.decode_pod: _route(o, request) for o in pd.ranked}, pd=pd)


def _route(o: Option, request: RequestView) -> Route:
    if o.mode == "remote" and o.remote is not None:
        r = o.remote
        return Route(pod_id=o.decode_pod, prefill_pod=r.prefill_pod, prediction=r.prediction, ttft_s=o.ttft_s,
                     cached_tokens=max(request.prompt_tokens - r.prediction.uncached_tokens, 0), mode="remote",
                     kv_tokens=o.kv_needed_tokens, transfer_tokens=r.transfer_tokens, transfer_s=r.transfer_s)
    return Route(pod_id=o.decode_pod, prefill_pod=o.decode_pod, prediction=o.local, ttft_s=o.ttft_s,
                 cached_tokens=max(request.prompt_tokens - o.local.uncached_tokens, 0), mode="local",
                 kv_tokens=o.kv_needed_tokens)


def _prediction(o: Option) -> Prediction:
    """The chosen path of one decode pod as a plain prediction (for the shared accounting and errors)."""
    if o.mode == "remote" and o.remote is not None:
        p = o.remote.prediction
        return Prediction(queue_s=p.queue_s, prefill_s=p.prefill_s, overhead_s=o.ttft_s - p.queue_s - p.prefill_s,
                          uncached_tokens=p.uncached_tokens)
    return o.local
