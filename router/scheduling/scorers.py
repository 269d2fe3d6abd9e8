"""Scorers: small named plugins, each giving every candidate pod a cost (lower is better).

A policy is a weighted list of scorers; the candidates are ranked by the weighted sum of their
costs. Config names either a preset (``policy: predicted-ttft``, the names kept from before) or
the list itself::

    scorers:
      - {type: predicted-ttft}
      - {type: prefill-work, weight: 3}
      - {type: cache-affinity, params: {bonus_ms: 20}}

**Writing one**: subclass ``Scorer`` in any module imported at start-up, give it a ``name``,
take its parameters as keyword arguments of ``__init__`` (they come from ``params``), and return a
cost per pod id from ``costs``; decorate the class with ``@register``. Costs are in seconds where
they can be (so weights stay comparable); a scorer that keeps state between requests sets
``stateful = True`` and keeps it in ``PolicyState`` (``/debug/route`` runs it on a copy).

Ties never fall to chance (except in ``random``): they go by load, then by a stable per-(prompt,
pod) number, so ``/debug/route`` and the real decision agree and cold prefixes spread over the
fleet the way rendezvous hashing spreads keys. When the ranking uses the objective
(``objective_first``, on whenever ``predicted-ttft`` is listed), pods likely to meet the request's
objective rank before the others, and those go by predicted TTFT alone, so no other scorer can
cause a miss by itself. "Likely to meet" is admission's own test (``admission.likely_to_meet``:
the miss probability within ``admission_miss_probability``), so the request admitted on the
strength of one pod is not then sent to a riskier one because it is cheaper by the other scorers.
"""

from __future__ import annotations

import random as _random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .admission import likely_to_meet, objective_limit
from .snapshot import Candidate, Prediction, RequestView


@dataclass
class PolicyState:
    """The little state some scorers keep between requests (owned by the router, passed in)."""

    rng: _random.Random = field(default_factory=lambda: _random.Random(0))
    rr_next: int = 0


@dataclass(frozen=True, slots=True)
class ScoreInput:
    """What a scorer may read for one request."""

    candidates: Sequence[Candidate]
    request: RequestView
    predictions: Mapping[str, Prediction]
    state: PolicyState


class Scorer:
    """Base class of scorers; see the module docstring."""

    name: ClassVar[str] = ""
    stateful: ClassVar[bool] = False

    @property
    def inert(self) -> bool:
        """True when its parameters make every cost 0 (``build_scoring`` leaves it out)."""
        return False

    def costs(self, x: ScoreInput) -> dict[str, float]:
        raise NotImplementedError


SCORERS: dict[str, type[Scorer]] = {}


def register(cls: type[Scorer]) -> type[Scorer]:
    if not cls.name or cls.name in SCORERS:
        raise ValueError(f"scorer name {cls.name!r} is empty or taken")
    SCORERS[cls.name] = cls
    return cls


@register
class PredictedTTFT(Scorer):
    """The predicted time to first token on the pod (queue + uncached prefill + overhead)."""

    name = "predicted-ttft"

    def costs(self, x: ScoreInput) -> dict[str, float]:
        return {c.pod_id: x.predictions[c.pod_id].ttft_s for c in x.candidates}


@register
class PrefillWork(Scorer):
    """The prefill work this request adds to the pod (its own uncached prefill time): weighted, it
    keeps sessions on the pod holding their context unless that pod's queue really costs more,
    sparing the fleet's capacity and cache space for later requests."""

    name = "prefill-work"

    def costs(self, x: ScoreInput) -> dict[str, float]:
        return {c.pod_id: x.predictions[c.pod_id].prefill_s for c in x.candidates}


@register
class CacheAffinity(Scorer):
    """A credit of ``bonus_ms`` for the pods holding the longest cached prefix of the prompt."""

    name = "cache-affinity"

    def __init__(self, bonus_ms: float = 0.0):
        self.bonus_s = float(bonus_ms) / 1000.0

    @property
    def inert(self) -> bool:
        return self.bonus_s == 0.0  # the preset's default (affinity_bonus_ms 0)

    def costs(self, x: ScoreInput) -> dict[str, float]:
        best = max((c.effective_cached_tokens for c in x.candidates), default=0.0)
        return {c.pod_id: -self.bonus_s if best > 0 and c.effective_cached_tokens >= best else 0.0
                for c in x.candidates}


@register
class Cache(Scorer):
    """The share of the prompt the pod does NOT hold (0 = all of it cached, 1 = none)."""

    name = "cache"

    def costs(self, x: ScoreInput) -> dict[str, float]:
        n = max(x.request.prompt_tokens, 1)
        return {c.pod_id: 1.0 - min(c.effective_cached_tokens / n, 1.0) for c in x.candidates}


@register
class Load(Scorer):
    """Requests queued or prefilling on the pod: the router's own plus any it did not send."""

    name = "load"

    def costs(self, x: ScoreInput) -> dict[str, float]:
        return {c.pod_id: float(c.load) for c in x.candidates}


@register
class Random(Scorer):
    """A fresh random number per pod and request (seeded: ``seed`` in the settings)."""

    name = "random"
    stateful = True

    def costs(self, x: ScoreInput) -> dict[str, float]:
        return {c.pod_id: x.state.rng.random() for c in x.candidates}


@register
class RoundRobin(Scorer):
    """Each request starts one pod further along the pods in id order."""

    name = "round-robin"
    stateful = True

    def costs(self, x: ScoreInput) -> dict[str, float]:
        ordered = sorted(c.pod_id for c in x.candidates)
        if not ordered:
            return {}
        start = x.state.rr_next % len(ordered)
        x.state.rr_next = start + 1
        return {pid: float((i - start) % len(ordered)) for i, pid in enumerate(ordered)}


@dataclass(frozen=True, slots=True)
class ScorerSpec:
    """One entry of a policy: a scorer by name, its weight and its parameters."""

    type: str
    weight: float = 1.0
    params: Mapping[str, Any] = field(default_factory=dict)


def presets(work_weight: float = 3.0, affinity_bonus_ms: float = 0.0) -> dict[str, list[ScorerSpec]]:
    """The named policies as scorer lists (``work_weight`` and ``affinity_bonus_ms`` are the
    settings of the same names, kept for configs written before scorers were plugins)."""
    return {
        "random": [ScorerSpec("random")],
        "round-robin": [ScorerSpec("round-robin")],
        "least-load": [ScorerSpec("load")],
        "cache-only": [ScorerSpec("cache")],
        "predicted-ttft": [ScorerSpec("predicted-ttft"), ScorerSpec("prefill-work", work_weight),
                           ScorerSpec("cache-affinity", 1.0, {"bonus_ms": affinity_bonus_ms})],
    }


@dataclass(frozen=True)
class Scoring:
    """A built policy: scorers with their weights, and whether the objective splits the ranking."""

    scorers: tuple[tuple[Scorer, float], ...]
    objective_first: bool = False

    @property
    def stateful(self) -> bool:
        return any(s.stateful for s, _ in self.scorers)

    @property
    def names(self) -> list[str]:
        return [s.name for s, _ in self.scorers]


def build_scoring(specs: Iterable[ScorerSpec | Mapping[str, Any]], objective_first: bool | None = None) -> Scoring:
    """Instantiate ``specs``; a ``ValueError`` names an unknown scorer or a bad parameter."""
    built = []
    for raw in specs:
        spec = raw if isinstance(raw, ScorerSpec) else ScorerSpec(**raw)
        cls = SCORERS.get(spec.type)
        if cls is None:
            raise ValueError(f"unknown scorer {spec.type!r}; known: {', '.join(sorted(SCORERS))}")
        try:
            scorer = cls(**dict(spec.params))
        except TypeError as exc:
            raise ValueError(f"scorer {spec.type!r}: bad params {dict(spec.params)!r} ({exc})") from None
        if spec.weight != 0:
            built.append((scorer, float(spec.weight)))
    # a scorer whose every cost is 0 only costs time (per pod, per request): left out unless alone
    built = [(s, w) for s, w in built if not s.inert] or built
    if not built:
        raise ValueError("a policy needs at least one scorer with a non-zero weight")
    if objective_first is None:
        objective_first = any(s.name == PredictedTTFT.name for s, _ in built)
    return Scoring(tuple(built), objective_first)


def rank(candidates: Sequence[Candidate], request: RequestView, predictions: Mapping[str, Prediction],
         scoring: Scoring, state: PolicyState, slack: float = 1.0,
         miss_tolerance: float | None = None) -> list[Candidate]:
    """The candidates best first by the weighted sum of the scorers' costs (see the module docstring);
    ``slack`` and ``miss_tolerance`` are admission's, for the objective split."""
    if not candidates:
        return []
    x = ScoreInput(candidates, request, predictions, state)
    total = {c.pod_id: 0.0 for c in candidates}
    for scorer, weight in scoring.scorers:
        for pid, cost in scorer.costs(x).items():
            total[pid] += weight * cost
    limit = objective_limit(request, slack) if scoring.objective_first else None

    def key(c: Candidate) -> tuple[Any, ...]:
        # ties by load (Candidate.load written out), booked tokens, batch, then the stable number
        load = c.inflight_requests + (c.waiting - c.inflight_requests if c.waiting > c.inflight_requests else 0)
        if limit is not None:
            p = predictions[c.pod_id]
            if not likely_to_meet(p, limit, miss_tolerance):
                return (1, round(p.ttft_s, 6), load, c.queue_tokens, c.running, c.tiebreak)
        return (0, round(total[c.pod_id], 6), load, c.queue_tokens, c.running, c.tiebreak)

    if len(candidates) == 1:
        return list(candidates)
    return sorted(candidates, key=key)
