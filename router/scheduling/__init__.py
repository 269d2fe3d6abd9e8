"""Scheduling: pure functions that rank pods for a request from a snapshot of the fleet.

``snapshot`` (the inputs: candidates, the request, the fleet), ``predictor`` (TTFT per pod),
``scorers`` (cost plugins and the named policies built from them), ``admission`` (early
rejection), ``decide`` (the aggregated decision and the ``Decision``/``Route`` both planners
return), ``pd`` (prefill/decode disaggregation), ``planners`` (the two planners behind one
interface), ``calibrator`` (learning each pod's speed from what was observed).
"""

from .admission import Verdict, admit
from .calibrator import Calibrator
from .decide import Decision, Route, decide
from .planners import AggregatedPlanner, PDPlanner, Planner
from .predictor import predict, uncached_tokens
from .scorers import (
           SCORERS,
           PolicyState,
           ScoreInput,
           Scorer,
           ScorerSpec,
           Scoring,
           build_scoring,
           presets,
           rank,
           register,
)
from .snapshot import Candidate, FleetSnapshot, KVRoom, Prediction, RequestView

__all__ = ["AggregatedPlanner", "Calibrator", "Candidate", "Decision", "FleetSnapshot", "KVRoom", "PDPlanner",
           "Planner", "PolicyState", "Prediction", "RequestView", "Route", "SCORERS", "ScoreInput", "Scorer",
           "ScorerSpec", "Scoring", "Verdict", "admit", "build_scoring", "decide", "predict", "presets", "rank",
           "register", "uncached_tokens"]
