"""Scheduling: pure functions that rank pods for a request from a snapshot.

``snapshot`` (the inputs), ``predictor`` (TTFT per pod), ``scorers`` (one function per policy),
``admission`` (early rejection), ``decide`` (all of it together), ``calibrator`` (learning each
pod's speed from what was observed).
"""

from .admission import Verdict, admit
from .calibrator import Calibrator
from .decide import Decision, decide
from .predictor import predict, uncached_tokens
from .scorers import SCORERS, PolicyState
from .snapshot import Candidate, Prediction, RequestView

__all__ = ["Calibrator", "Candidate", "Decision", "PolicyState", "Prediction", "RequestView", "SCORERS",
           "Verdict", "admit", "decide", "predict", "uncached_tokens"]
