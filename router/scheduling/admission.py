"""Early rejection: say no at once when even the best pod is predicted to miss the objective."""

from __future__ import annotations

from dataclasses import dataclass

from .snapshot import Prediction, RequestView


@dataclass(frozen=True, slots=True)
class Verdict:
    admitted: bool
    reason: str  # "ok", "no-objective", "exempt", "slo" (rejected), "no-pods" (rejected)


def admit(best: Prediction | None, request: RequestView, enabled: bool = True, slack: float = 1.0) -> Verdict:
    if best is None:
        return Verdict(False, "no-pods")
    if not enabled or request.objective_s is None:
        return Verdict(True, "no-objective")
    if request.exempt:
        return Verdict(True, "exempt")
    if best.ttft_s > request.objective_s * slack:
        return Verdict(False, "slo")
    return Verdict(True, "ok")
