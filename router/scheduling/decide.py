"""One routing decision: predict on every candidate, rank by the policy, admit or reject.

The live router and ``/debug/route`` both call ``decide``; only the live router then books the
work and sends the request.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

from .admission import Verdict, admit
from .predictor import predict
from .scorers import SCORERS, STATEFUL, PolicyState
from .snapshot import Candidate, Prediction, RequestView


@dataclass(frozen=True, slots=True)
class Decision:
    ranked: list[Candidate]              # best first; the router tries them in this order
    predictions: dict[str, Prediction]   # per pod id
    verdict: Verdict

    @property
    def chosen(self) -> Candidate | None:
        return self.ranked[0] if self.ranked and self.verdict.admitted else None

    @property
    def best_prediction(self) -> Prediction | None:
        return min(self.predictions.values(), key=lambda p: p.ttft_s, default=None)


def decide(candidates: Sequence[Candidate], request: RequestView, policy: str, state: PolicyState,
           admission: bool = True, slack: float = 1.0, dry_run: bool = False) -> Decision:
    """Rank ``candidates`` for ``request`` under ``policy``; ``dry_run`` leaves ``state`` untouched."""
    scorer = SCORERS[policy]
    if dry_run and policy in STATEFUL:
        state = copy.deepcopy(state)
    predictions = {c.pod_id: predict(c, request) for c in candidates}
    ranked = scorer(candidates, request, predictions, state) if candidates else []
    verdict = admit(min(predictions.values(), key=lambda p: p.ttft_s, default=None), request, admission, slack)
    return Decision(ranked=ranked, predictions=predictions, verdict=verdict)
