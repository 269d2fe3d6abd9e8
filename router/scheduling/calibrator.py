"""Online calibration of each pod's prefill rate and fixed overhead from observed TTFTs.

Model: ``ttft = overhead + work_tokens / rate + running x per_running``, where ``work_tokens`` is
the prefill work ahead of and including the request when it was routed and ``running`` the
requests the pod was running beside it (its ``vllm:num_requests_running``). The last term is the
batched engine: vLLM admits requests into the running batch and shares every step between their
prefills and the running decodes, so a prefill takes longer the more runs beside it, even with
nothing waiting. Recursive least squares with exponential forgetting fits ``(overhead, 1/rate,
per_running)`` per pod, so a pod that slows down (or was configured wrong) is re-learned within a
few hundred requests; a pod whose TTFT does not grow with its batch keeps ``per_running`` near 0.
The prior is the configured rate and overhead (and no batch cost); estimates are clamped to sane
bounds so one outlier cannot send the rate negative.

**Relative fit** (``relative``, the setting ``calibration_fit: relative``; off by default): least
squares on ``(predicted - observed) / observed`` instead of seconds, each observation's row and
target divided by its TTFT and multiplied by the pod's typical (exponentially averaged) TTFT, so the
prior weighs the same on slow and fast pods. It is robust to a slow tail: replayed on the
prediction logs of ``bench/real_vllm.py`` it took the MAPE from 68 % to 46 % on two real engines.
It also reacts more slowly to a pod that suddenly slows (an observation far above its prediction
counts at most 100 % off), and in simulated time it routed worse without admission; measured in
docs/router.md.

**Error model.** Each pod also learns how its predictions err: ``ln(observed / predicted)``, as an
exponentially weighted mean and variance with the same memory. It is shrunk towards no bias and
``prior_sd`` as if the prior were ``prior_weight`` observations, averaging standard deviations
(``_blend_sd``), not variances: with variances ten prior observations at 0.25 outweighed a
thousand at 0.02. Admission uses it to ask how likely a
miss is rather than whether the point estimate crosses the objective, and ``/debug/route`` shows
the interval it gives. With ``by_size`` (the setting ``ttft_error_by_size``, on by default) it is
also learnt per size of prediction (``snapshot.size_bucket``: one bucket per doubling), a bucket
with few observations leaning on the pod's pooled mean and on the fleet's spread at that size
(``error_table``): predictions err differently at
different sizes (a 50 ms one by a whole engine step, a 1.5 s one mostly by the queue), and admission
asks about the ones near the objective; pooled, the interval there was too wide
(``bench/calibration.py``; docs/router.md, "How far to trust a prediction").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .snapshot import SIZE_BUCKETS, size_bucket

_KT = 1000.0  # work is fitted in kilotokens to keep the two parameters on similar scales
# an observation counts as at most this many times off its prediction (either way), in the fit and
# in the error model: one stalled request (a LoRA load, a grammar compile, a pod's hiccup) of 60 s
# where 0.1 s was predicted otherwise moved the overhead from 5 ms to 1.2 s and the error's spread
# from 0.02 to 0.4, and the pod refused nearly everything for hundreds of requests. A pod that
# really is slower is still learnt, a bounded step at a time. Predictions under
# ``_OUTLIER_FLOOR_S`` are taken as that much for the upper bound (an overhead clamped to 0 by
# impossibly fast answers can grow again).
OUTLIER_FACTOR = 10.0
_MAX_LOG_ERROR = math.log(OUTLIER_FACTOR)
_OUTLIER_FLOOR_S = 0.01
_P_PRIOR = (1.0, 1.0, 0.01)  # the prior's variances of (overhead_s, s_per_kilotoken, s_per_running)


def _blend_sd(prior_sd: float, prior_n: float, var: float, n: float) -> float:
    """A spread learnt from ``n`` observations of variance ``var``, shrunk towards ``prior_sd`` as if
    it had been seen ``prior_n`` times: the standard deviations are averaged, not the variances. An
    average of variances keeps a wide prior's share for thousands of observations (ten at sd 0.25
    outweigh 1,000 at sd 0.02), so a fleet whose predictions err by 1 % kept an interval of ±10 %."""
    return (prior_n * prior_sd + n * math.sqrt(max(var, 0.0))) / (prior_n + n)


class SizeErrors:
    """Exponentially weighted mean and variance of the log error per size bucket; ``version`` counts
    the observations, so a table built on it knows when it is stale."""

    def __init__(self) -> None:
        self.buckets = [[0.0, 0.0, 0.0] for _ in range(SIZE_BUCKETS)]  # [mean, var, n]
        self.version = 0
        self.stamps = [0] * SIZE_BUCKETS  # per bucket: the version of its last change

    def add(self, predicted_s: float, r: float, forget: float) -> None:
        i = size_bucket(predicted_s)
        b = self.buckets[i]
        w = max(1.0 - forget, 1.0 / (b[2] + 1))
        d = r - b[0]
        b[0] += w * d
        b[1] = (1.0 - w) * (b[1] + w * d * d)
        b[2] += 1
        self.version += 1
        self.stamps[i] = self.version


@dataclass
class PodCalibration:
    overhead_s: float
    rate: float
    min_rate: float
    max_rate: float
    forget: float
    samples: int = 0
    abs_error_sum: float = 0.0
    prior_sd: float = 0.25
    prior_weight: float = 10.0
    log_mean: float = 0.0
    log_var: float = 0.0
    log_n: int = 0
    per_running_s: float = 0.0
    relative: bool = False  # least squares on the error relative to the observed TTFT (see above)
    by_size: bool = True  # the error model per size of prediction too (see above)
    # RLS state: theta = [overhead_s, s_per_kilotoken, s_per_running], P = its covariance (3x3)
    _theta: list[float] = field(default_factory=list)
    _p: list[list[float]] = field(default_factory=list)
    _typical: float | None = None  # exponentially weighted mean observed TTFT (scales the relative fit)
    fleet: SizeErrors | None = None  # every pod's errors per size (the Calibrator's), for the spread
    _sizes: SizeErrors = field(default_factory=SizeErrors)  # this pod's errors per size
    _error: tuple[float, float] | None = None  # error_model() until the next observe_error
    _table: tuple[tuple[float, float], ...] | None = None  # error_table(), kept up to date row by row
    _table_own: int = -1  # this pod's version it was built at (any change of its own: every row)
    _table_fleet: list[int] = field(default_factory=list)  # the fleet's bucket stamps each row was built at
    _table_fleet_version: int = -1  # the fleet's version when the rows were last brought up to date
    _table_base: tuple[float, float] = (0.0, 0.0)  # this pod's pooled (mean, sd) the rows lean on

    def __post_init__(self) -> None:
        self._theta = [self.overhead_s, _KT / self.rate, self.per_running_s]
        # a weak prior: a few observations outweigh it (the batch term starts at 0, a little firmer)
        self._p = [[_P_PRIOR[i] if i == j else 0.0 for j in range(3)] for i in range(3)]

    def predict(self, work_tokens: float, running: float = 0.0) -> float:
        return self.overhead_s + max(work_tokens, 0.0) / self.rate + max(running, 0.0) * self.per_running_s

    def error_model(self) -> tuple[float, float]:
        """(mean, sd) of ln(observed / predicted), shrunk towards (0, prior_sd) while data is scarce
        (kept until ``observe_error`` learns: every decision reads it for every pod)."""
        if self._error is None:
            n, n0 = float(self.log_n), self.prior_weight
            mean = self.log_mean * n / (n + n0)
            self._error = (mean, _blend_sd(self.prior_sd, n0, self.log_var, n))
        return self._error

    def error_table(self) -> tuple[tuple[float, float], ...]:
        """(mean, sd) per size bucket (``snapshot.size_bucket``), empty without ``by_size``. While a
        bucket's own data is scarce its mean is shrunk towards this pod's pooled mean (a pod's bias is
        its own) and its spread towards the fleet's spread at that size (how far a prediction of that
        size errs is much the same on every pod, and the fleet sees many more long ones than one pod
        does), which is itself shrunk towards this pod's pooled spread."""
        if not self.by_size:
            return ()
        fleet = self.fleet
        if self._table is None or self._table_own != self._sizes.version or \
                len(self._table_fleet) != (SIZE_BUCKETS if fleet is not None else 0):  # this pod learnt: all rows
            self._table_base = self.error_model()
            self._table_fleet = list(fleet.stamps) if fleet is not None else []
            self._table = tuple(self._error_row(i) for i in range(SIZE_BUCKETS))
            self._table_own = self._sizes.version
            self._table_fleet_version = fleet.version if fleet is not None else 0
        elif fleet is not None and self._table_fleet_version != fleet.version:  # another pod learnt: its rows
            rows = list(self._table)
            for i, stamp in enumerate(fleet.stamps):
                if self._table_fleet[i] != stamp:
                    rows[i] = self._error_row(i)
                    self._table_fleet[i] = stamp
            self._table = tuple(rows)
            self._table_fleet_version = fleet.version
        return self._table

    def _error_row(self, i: int) -> tuple[float, float]:
        mean0, sd0 = self._table_base
        n0 = self.prior_weight
        m, v, n = self._sizes.buckets[i]
        if self.fleet is not None:
            _, fv, fn = self.fleet.buckets[i]
            sd0 = _blend_sd(sd0, n0, fv, fn)
        return (n0 * mean0 + n * m) / (n + n0), _blend_sd(sd0, n0, v, n)

    def observe_error(self, predicted_s: float, ttft_s: float) -> None:
        """Fold one (predicted, observed) pair into the error model."""
        if not (predicted_s > 0 and ttft_s > 0 and math.isfinite(ttft_s) and math.isfinite(predicted_s)):
            return
        r = math.log(ttft_s / predicted_s)
        r = _MAX_LOG_ERROR if r > _MAX_LOG_ERROR else (-_MAX_LOG_ERROR if r < -_MAX_LOG_ERROR else r)
        w = max(1.0 - self.forget, 1.0 / (self.log_n + 1))
        d = r - self.log_mean
        self.log_mean += w * d
        self.log_var = (1.0 - w) * (self.log_var + w * d * d)
        self.log_n += 1
        self._error = None
        if self.by_size:
            self._sizes.add(predicted_s, r, self.forget)
            if self.fleet is not None:
                self.fleet.add(predicted_s, r, self.forget)

    def observe(self, work_tokens: float, ttft_s: float, predicted_s: float | None = None,
                running: float = 0.0) -> float:
        """Fold one observation in; returns the prediction error (observed - predicted) in seconds.
        ``predicted_s``: what the router predicted for it (else this model's own prediction);
        ``running``: the requests the pod was running when it was routed."""
        predicted = self.predict(work_tokens, running)
        error = ttft_s - predicted
        if not math.isfinite(ttft_s) or ttft_s < 0:
            return 0.0
        self.observe_error(predicted if predicted_s is None else predicted_s, ttft_s)
        # the fit learns from the observation bounded to OUTLIER_FACTOR times its own prediction
        ttft_s = min(max(ttft_s, predicted / OUTLIER_FACTOR), max(predicted, _OUTLIER_FLOOR_S) * OUTLIER_FACTOR)
        scale = 1.0
        if self.relative:  # the row and target over the TTFT (1 ms at least), times the pod's typical TTFT
            typical = self._typical
            self._typical = ttft_s if typical is None else self.forget * typical + (1.0 - self.forget) * ttft_s
            scale = max(self._typical, 1e-3) / max(ttft_s, 1e-3)
        x = [scale, max(work_tokens, 0.0) / _KT * scale, max(running, 0.0) * scale]
        p = self._p
        px = [sum(p[i][j] * x[j] for j in range(3)) for i in range(3)]
        denom = self.forget + sum(x[i] * px[i] for i in range(3))
        k = [v / denom for v in px]
        resid = ttft_s * scale - sum(t * xi for t, xi in zip(self._theta, x, strict=True))
        self._theta = [t + ki * resid for t, ki in zip(self._theta, k, strict=True)]
        # P = (P - k x^T P) / forget; x^T P is px^T since P is symmetric, and it is kept exactly so:
        # computed as it was, rounding left an antisymmetric part that the division by forget grew by
        # 1/forget an observation, and after ~10,000 of one pod (halflife 200) the fit diverged
        f = self.forget
        p = [[(p[i][j] - k[i] * px[j]) / f for j in range(3)] for i in range(3)]
        p[1][0], p[2][0], p[2][1] = p[0][1], p[0][2], p[1][2]
        # no parameter is ever less known than the prior says: a direction the data does not move (the
        # batch term of a pod that runs one request at a time) would otherwise grow by 1/forget an
        # observation, past 1e13 after 10,000 (a busy observation then took a gain that lost P's
        # precision), and overflow past 200,000
        for i in range(3):
            if p[i][i] > _P_PRIOR[i]:
                s = math.sqrt(_P_PRIOR[i] / p[i][i])
                for j in range(3):
                    p[i][j] *= s
                    p[j][i] *= s
        self._p = p
        self.overhead_s = min(max(self._theta[0], 0.0), 2.0)
        s_per_kt = self._theta[1]
        rate = _KT / s_per_kt if s_per_kt > 0 else self.max_rate
        self.rate = min(max(rate, self.min_rate), self.max_rate)
        self.per_running_s = min(max(self._theta[2], 0.0), 1.0)
        self.samples += 1
        self.abs_error_sum += abs(error)
        return error


class Calibrator:
    """Per-pod calibrations, created on first use from the prior."""

    def __init__(self, prior_rate: float, prior_overhead_s: float, halflife: float = 200.0,
                 enabled: bool = True, min_rate: float | None = None, max_rate: float | None = None,
                 prior_sd: float = 0.25, relative: bool = False, by_size: bool = True):
        self.prior_rate = prior_rate
        self.prior_overhead_s = prior_overhead_s
        self.enabled = enabled
        self.forget = 0.5 ** (1.0 / max(halflife, 1.0))
        self.min_rate = min_rate if min_rate is not None else prior_rate / 20
        self.max_rate = max_rate if max_rate is not None else prior_rate * 20
        self.prior_sd = prior_sd
        self.relative = relative
        self.by_size = by_size
        self.fleet = SizeErrors()  # every pod's errors per size: the spread a pod's scarce buckets lean on
        self.pods: dict[str, PodCalibration] = {}

    def pod(self, pod_id: str, prior_rate: float | None = None) -> PodCalibration:
        cal = self.pods.get(pod_id)
        if cal is None:
            rate = prior_rate or self.prior_rate
            cal = PodCalibration(overhead_s=self.prior_overhead_s, rate=rate, min_rate=min(self.min_rate, rate),
                                 max_rate=max(self.max_rate, rate), forget=self.forget, prior_sd=self.prior_sd,
                                 relative=self.relative, by_size=self.by_size, fleet=self.fleet)
            self.pods[pod_id] = cal
        return cal

    def observe(self, pod_id: str, work_tokens: float, ttft_s: float, predicted_s: float | None = None,
                running: float = 0.0) -> float:
        """Learn from one TTFT; with calibration off only the error model learns."""
        cal = self.pod(pod_id)
        if not self.enabled:
            own = cal.predict(work_tokens, running)
            cal.observe_error(own if predicted_s is None else predicted_s, ttft_s)
            return ttft_s - own
        return cal.observe(work_tokens, ttft_s, predicted_s, running)
