"""Early rejection: say no at once when even the best pod is likely to miss the objective.

With ``miss_tolerance`` (the router's ``admission_miss_probability``) a request is rejected when,
on every pod, the probability of missing the objective (``objective x slack``) is above it: the
prediction's error model (``Prediction.miss_probability``) says how far to trust the point
estimate. With a tolerance of 0.5 and an unbiased model this is the point rule; the default,
0.1, also rejects within the prediction's own error of the line (docs/router.md says why). A pod
whose predictions have run late moves the line earlier. ``None`` keeps the point rule.

The ranking asks the same question of each pod (``likely_to_meet``): a pod counts as meeting the
objective only if admission would have admitted the request on it alone, so the request never
goes to a pod whose risk admission would have refused while a safer pod was on the list.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .snapshot import Prediction, RequestView


@dataclass(frozen=True, slots=True)
class Verdict:
    admitted: bool
    reason: str  # "ok", "no-objective", "exempt", "slo" (rejected), "no-pods" (rejected), "kv" (rejected)
    miss_probability: float | None = None  # the best pod's, when the objective was checked


def likely_to_meet(prediction: Prediction, limit_s: float | None, miss_tolerance: float | None,
                   ttft_s: float | None = None) -> bool:
    """Whether one pod (or path: ``ttft_s`` replaces the prediction's TTFT) passes admission's test
    for an objective of ``limit_s`` (``objective x slack``; ``None``: no objective, always true)."""
    if limit_s is None:
        return True
    t = prediction.ttft_s if ttft_s is None else ttft_s
    if miss_tolerance is None:
        return t <= limit_s
    return prediction.miss_probability(limit_s, t) <= miss_tolerance


def objective_limit(request: RequestView, slack: float = 1.0) -> float | None:
    """The line a request's TTFT is judged against: its objective times ``slack``."""
    return None if request.objective_s is None else request.objective_s * slack


def admit(predictions: Iterable[Prediction], request: RequestView, enabled: bool = True, slack: float = 1.0,
          miss_tolerance: float | None = None, ttfts: Iterable[float] | None = None) -> Verdict:
    """Admit or reject on the best of ``predictions`` (``ttfts``, if given, replace their TTFTs: a
    P/D path adds a transfer to its prefill prediction)."""
    preds = list(predictions)
    if not preds:
        return Verdict(False, "no-pods")
    if not enabled or request.objective_s is None:
        return Verdict(True, "no-objective")
    if request.exempt:
        return Verdict(True, "exempt")
    times = list(ttfts) if ttfts is not None else [p.ttft_s for p in preds]
    limit = request.objective_s * slack
    if miss_tolerance is None:
        best = min(times)
        return Verdict(best <= limit, "ok" if best <= limit else "slo")
    risk = min(p.miss_probability(limit, t) for p, t in zip(preds, times, strict=True))
    return Verdict(risk <= miss_tolerance, "ok" if risk <= miss_tolerance else "slo", risk)
