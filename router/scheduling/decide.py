"""One aggregated routing decision: predict on every candidate, rank by the scorers, admit or reject.

The output, ``Decision``, is what both planners (aggregated here, P/D in ``pd.py``) return: the
pods best first, a ``Route`` per pod saying what to book there, and the verdict. The live router
and ``/debug/route`` both call the planners; only the live router then books and sends.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .admission import Verdict, admit
from .pd import PDDecision
from .predictor import predict
from .scorers import PolicyState, Scoring, rank
from .snapshot import Candidate, Prediction, RequestView


@dataclass(slots=True)  # not frozen, for speed: see snapshot.Candidate
class Route:
    """How the request would be served through one pod: what to book there and what to expect.

    ``pod_id`` receives the request; ``prefill_pod`` computes the prompt (``pod_id`` itself, or a
    prefill pod under P/D) and ``prediction`` is its queue and prefill there; ``ttft_s`` is the
    whole predicted time to first token (a KV transfer included); ``kv_tokens`` the KV room the
    request takes on ``pod_id`` (P/D decode pods; 0 when not tracked)."""

    pod_id: str
    prefill_pod: str
    prediction: Prediction
    ttft_s: float
    cached_tokens: int
    mode: str = "aggregated"  # "aggregated", or under P/D "local" / "remote"
    kv_tokens: int = 0
    transfer_tokens: int = 0
    transfer_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Decision:
    ranked: list[Candidate]              # best first; the router tries them in this order
    predictions: dict[str, Prediction]   # per pod id
    verdict: Verdict
    routes: dict[str, Route] = field(default_factory=dict)  # per pod id in ``ranked``
    pd: PDDecision | None = None         # the P/D planner's reasoning, for /debug/route

    @property
    def chosen(self) -> Candidate | None:
        return self.ranked[0] if self.ranked and self.verdict.admitted else None

    @property
    def best_prediction(self) -> Prediction | None:
        return min(self.predictions.values(), key=lambda p: p.ttft_s, default=None)


def decide(candidates: Sequence[Candidate], request: RequestView, scoring: Scoring, state: PolicyState,
           admission: bool = True, slack: float = 1.0, dry_run: bool = False,
           miss_tolerance: float | None = None,
           predictor: Callable[[Candidate, RequestView], Prediction] = predict) -> Decision:
    """Rank ``candidates`` for ``request`` by ``scoring``; ``dry_run`` leaves ``state`` untouched.
    ``predictor`` is ``predictor.predict`` except in ``kvroute simulate``'s ``true-state`` policy."""
    if dry_run and scoring.stateful:
        state = copy.deepcopy(state)
    predictions = {c.pod_id: predictor(c, request) for c in candidates}
    ranked = rank(candidates, request, predictions, scoring, state, slack, miss_tolerance)
    verdict = admit(predictions.values(), request, admission, slack, miss_tolerance)
    routes = {}
    n = request.prompt_tokens
    for c in candidates:
        p = predictions[c.pod_id]
        cached = int(c.effective_cached_tokens)
        # positional (pod_id, prefill_pod, prediction, ttft_s, cached_tokens): once per pod per request
        routes[c.pod_id] = Route(c.pod_id, c.pod_id, p, p.ttft_s, cached if cached < n else n)
    return Decision(ranked=ranked, predictions=predictions, verdict=verdict, routes=routes)
