"""Routing policies as small named scorers: each ranks the candidates, best first.

A scorer is a pure function ``(candidates, request, predictions, state) -> ranked candidates``.
``SCORERS`` maps the policy names used in config to them, so a new policy is a new function and
one line here. Ties never fall to chance (except in ``random``): they go by load, then by a stable
per-(prompt, pod) number, so ``/debug/route`` and the real decision agree and cold prefixes spread
over the fleet the way rendezvous hashing spreads keys.
"""

from __future__ import annotations

import random as _random
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .snapshot import Candidate, Prediction, RequestView


@dataclass
class PolicyState:
    """The little state some policies keep between requests (owned by the router, passed in)."""

    rng: _random.Random = field(default_factory=lambda: _random.Random(0))
    rr_next: int = 0
    affinity_bonus_s: float = 0.0
    work_weight: float = 0.0


Ranked = list[Candidate]
Scorer = Callable[[Sequence[Candidate], RequestView, dict[str, Prediction], PolicyState], Ranked]


def _by_load(c: Candidate) -> tuple:
    return (c.load, c.queue_tokens, c.running, c.tiebreak)


def score_random(cands, request, predictions, state: PolicyState) -> Ranked:
    ranked = list(cands)
    state.rng.shuffle(ranked)
    return ranked


def score_round_robin(cands, request, predictions, state: PolicyState) -> Ranked:
    ordered = sorted(cands, key=lambda c: c.pod_id)
    if not ordered:
        return []
    start = state.rr_next % len(ordered)
    state.rr_next = start + 1
    return ordered[start:] + ordered[:start]


def score_least_load(cands, request, predictions, state) -> Ranked:
    return sorted(cands, key=_by_load)


def score_cache_only(cands, request, predictions, state) -> Ranked:
    return sorted(cands, key=lambda c: (-c.effective_cached_tokens,) + _by_load(c))


def score_predicted_ttft(cands, request, predictions, state: PolicyState) -> Ranked:
    """Lowest predicted TTFT first.

    With ``work_weight`` > 0 the cost also counts the prefill work a pod would have to add
    (``work_weight`` x this request's own prefill time), which keeps sessions on the pod that
    holds their context unless its queue really costs more; that spares the fleet's capacity
    and cache space for later requests. Pods predicted to meet the request's objective always
    rank before pods predicted to miss it, so the extra term never causes a miss by itself.
    """
    best_cached = max((c.effective_cached_tokens for c in cands), default=0.0)
    objective = request.objective_s

    def key(c: Candidate) -> tuple:
        p = predictions[c.pod_id]
        ttft = p.ttft_s
        cost = ttft + state.work_weight * p.prefill_s
        if state.affinity_bonus_s and best_cached > 0 and c.effective_cached_tokens >= best_cached:
            cost -= state.affinity_bonus_s
        misses = objective is not None and ttft > objective
        return (misses, round(ttft if misses else cost, 6)) + _by_load(c)

    return sorted(cands, key=key)


SCORERS: dict[str, Scorer] = {
    "random": score_random,
    "round-robin": score_round_robin,
    "least-load": score_least_load,
    "cache-only": score_cache_only,
    "predicted-ttft": score_predicted_ttft,
}

# Policies whose ranking changes state; /debug/route runs them on a copy.
STATEFUL = frozenset({"random", "round-robin"})
