"""The immutable inputs of one routing decision: what each candidate pod looks like right now.

A ``Candidate`` joins three sources that change at different speeds: the pod's scraped metrics
(every ~250 ms), the router's own booking of in-flight prefill work (every request), and the prefix
index's answer for this prompt. Scorers see only these values, so a decision can be replayed,
explained (``/debug/route``) and tested on hand-built snapshots.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from statistics import NormalDist


# Candidate, Prediction and decide.Route are made for every pod on every request and never changed
# after: they are not frozen only because a frozen dataclass sets each field through
# object.__setattr__, which made a Candidate cost 2.4 us against 0.6 us, and the decision several us
# more per pod (bench/decision_cost.py; docs/router.md). Treat them as read-only.
@dataclass(slots=True)
class Candidate:
    """One pod as the scheduler sees it for one request."""

    pod_id: str
    role: str = "both"
    model: str = "sim-model"
    # scraped from the pod's /metrics
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    # booked by the router: requests sent there whose first token has not come back yet
    inflight_requests: int = 0
    queue_tokens: float = 0.0
    # calibrated speed of this pod
    prefill_tokens_per_s: float = 20000.0
    overhead_s: float = 0.005
    per_running_s: float = 0.0  # TTFT added per request running beside it (the batch; calibrated)
    # how this pod's predictions have erred: ln(observed / predicted) ~ Normal(mean, sd) (calibrator),
    # over all its predictions, and per size of prediction (``size_bucket``; empty: the pooled one)
    log_error_mean: float = 0.0
    log_error_sd: float = 0.0
    error_by_size: tuple[tuple[float, float], ...] = ()
    # the prefix index's answer for this prompt
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    effective_cached_tokens: float = 0.0
    # held now but expected evicted before the request would start here (indexer.recency); the share
    # of it that such expectations have come true lately is taken off cached_tokens and counted as
    # work. ``evicting_check`` is the prompt block whose re-computation would confirm it (-1: none)
    evicting_tokens: int = 0
    evicting_check: int = -1
    # a stable per-(prompt, pod) number for breaking ties without randomness
    tiebreak: int = 0

    @property
    def load(self) -> int:
        """Requests queued or prefilling here: the router's own plus any it did not send."""
        return self.inflight_requests + max(0, self.waiting - self.inflight_requests)


    def error_model(self, model_ttft_s: float) -> tuple[float, float]:
        """(mean, sd) of ln(observed / predicted) for a prediction of ``model_ttft_s`` on this pod."""
        if not self.error_by_size:
            return self.log_error_mean, self.log_error_sd
        return self.error_by_size[size_bucket(model_ttft_s)]


SIZE_BUCKETS = 10


def size_bucket(predicted_s: float) -> int:
    """The error model's bucket for a prediction: one per doubling, [1/16 s, 1/8 s) is 1 and
    [1 s, 2 s) is 5; below 1/16 s is 0, 16 s and above the last. How far a prediction errs depends on
    its size: a 50 ms one is at the mercy of one engine step, a 1.5 s one is mostly queue, and
    admission cares about the ones near the line."""
    if not predicted_s > 0.0625:
        return 0
    if not predicted_s < 16.0:
        return SIZE_BUCKETS - 1
    return math.floor(math.log2(predicted_s)) + 5


@dataclass(frozen=True, slots=True)
class RequestView:
    """What scheduling needs of a request: its size and its objective."""

    prompt_tokens: int
    objective_s: float | None = None
    exempt: bool = False
    unknown_request_tokens: int = 512
    output_tokens: int = 0  # expected output (max_tokens, else a default): the KV a decode pod must hold
    # one prefill leg can serve it: not so for several prompts or choices, which the sidecar prefills
    # on the decode pod (kvcommon.transfer.one_prefill_cannot_serve), so P/D plans them local
    single_prefill: bool = True


@dataclass(slots=True)  # not frozen: see Candidate
class Prediction:
    """Predicted time to first token on one pod, by part, with the pod's error model: the observed
    TTFT is taken to be ``model_ttft_s x exp(e)`` with ``e ~ Normal(log_mean, log_sd)``. ``ttft_s``
    is that distribution's median, ``model_ttft_s x exp(log_mean)``: the model's parts corrected by
    how this pod's predictions have erred (log_mean 0 and log_sd 0: the model, exactly)."""

    queue_s: float
    prefill_s: float
    overhead_s: float
    uncached_tokens: int
    log_mean: float = 0.0
    log_sd: float = 0.0
    batch_s: float = 0.0  # the running batch's share of the steps the prefill needs

    @property
    def model_ttft_s(self) -> float:
        """The model's own sum of the parts (what the calibrator fits)."""
        return self.queue_s + self.prefill_s + self.overhead_s + self.batch_s

    @property
    def ttft_s(self) -> float:
        # model_ttft_s written out: read for every pod on every request
        t = self.queue_s + self.prefill_s + self.overhead_s + self.batch_s
        return t * math.exp(self.log_mean) if self.log_mean else t

    def miss_probability(self, objective_s: float, ttft_s: float | None = None) -> float:
        """P(observed TTFT > ``objective_s``) around a median of ``ttft_s`` (default: this one's)."""
        return miss_probability(self.ttft_s if ttft_s is None else ttft_s, objective_s, self.log_sd)

    def interval(self, level: float = 0.9, ttft_s: float | None = None) -> tuple[float, float]:
        """The central ``level`` interval of the observed TTFT around a median of ``ttft_s``."""
        t = self.ttft_s if ttft_s is None else ttft_s
        z = _z(level)
        return t * math.exp(-z * self.log_sd), t * math.exp(z * self.log_sd)


@functools.lru_cache(maxsize=16)
def _z(level: float) -> float:
    """The standard normal quantile that bounds a central ``level`` interval (one level per router)."""
    return NormalDist().inv_cdf(0.5 + level / 2.0)


def miss_probability(median_s: float, objective_s: float, log_sd: float) -> float:
    """P(median_s x exp(e) > objective_s), e ~ Normal(0, log_sd); a step at the objective when
    log_sd is 0."""
    if objective_s <= 0:
        return 1.0
    if median_s <= 0:
        return 0.0
    margin = math.log(objective_s / median_s)
    if log_sd <= 0:
        return 0.0 if margin >= 0 else 1.0
    return 1.0 - NormalDist().cdf(margin / log_sd)


@dataclass(frozen=True, slots=True)
class KVRoom:
    """A decode pod's KV: its capacity (when it reports one) and what the router has booked there."""

    capacity_tokens: int | None = None
    booked_tokens: float = 0.0
    active_requests: int = 0


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """Every healthy pod of one model as one decision sees it, built from the live state by
    ``router.routing.take_snapshot`` (or by hand in tests and the offline simulator)."""

    model: str
    candidates: tuple[Candidate, ...]
    kv: Mapping[str, KVRoom] = field(default_factory=dict)  # decode pods

    def by_role(self, role: str) -> list[Candidate]:
        return [c for c in self.candidates if c.role == role]

    def candidate(self, pod_id: str) -> Candidate:
        return next(c for c in self.candidates if c.pod_id == pod_id)

    @property
    def disaggregated(self) -> bool:
        """Decode pods are up: requests go through the P/D planner."""
        return any(c.role == "decode" for c in self.candidates)
