"""Online calibration of each pod's prefill rate and fixed overhead from observed TTFTs.

Model: ``ttft = overhead + work_tokens / rate``, where ``work_tokens`` is the prefill work ahead of
and including the request when it was routed. Recursive least squares with exponential forgetting
fits ``(overhead, 1/rate)`` per pod, so a pod that slows down (or was configured wrong) is
re-learned within a few hundred requests. The prior is the configured rate and overhead; estimates
are clamped to sane bounds so one outlier cannot send the rate negative.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_KT = 1000.0  # work is fitted in kilotokens to keep the two parameters on similar scales


@dataclass
class PodCalibration:
    overhead_s: float
    rate: float
    min_rate: float
    max_rate: float
    forget: float
    samples: int = 0
    abs_error_sum: float = 0.0
    # RLS state: theta = [overhead_s, s_per_kilotoken], P = covariance (row-major 2x2)
    _theta: list[float] = field(default_factory=list)
    _p: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._theta = [self.overhead_s, _KT / self.rate]
        self._p = [1.0, 0.0, 0.0, 1.0]  # a weak prior: a few observations outweigh it

    def observe(self, work_tokens: float, ttft_s: float) -> float:
        """Fold one observation in; returns the prediction error (observed - predicted) in seconds."""
        x0, x1 = 1.0, max(work_tokens, 0.0) / _KT
        predicted = self.overhead_s + max(work_tokens, 0.0) / self.rate
        error = ttft_s - predicted
        if not math.isfinite(ttft_s) or ttft_s < 0:
            return 0.0
        p00, p01, p10, p11 = self._p
        px0 = p00 * x0 + p01 * x1
        px1 = p10 * x0 + p11 * x1
        denom = self.forget + x0 * px0 + x1 * px1
        k0, k1 = px0 / denom, px1 / denom
        resid = ttft_s - (self._theta[0] * x0 + self._theta[1] * x1)
        self._theta[0] += k0 * resid
        self._theta[1] += k1 * resid
        # P = (P - k x^T P) / forget
        xp0 = x0 * p00 + x1 * p10
        xp1 = x0 * p01 + x1 * p11
        self._p = [(p00 - k0 * xp0) / self.forget, (p01 - k0 * xp1) / self.forget,
                   (p10 - k1 * xp0) / self.forget, (p11 - k1 * xp1) / self.forget]
        self.overhead_s = min(max(self._theta[0], 0.0), 2.0)
        s_per_kt = self._theta[1]
        rate = _KT / s_per_kt if s_per_kt > 0 else self.max_rate
        self.rate = min(max(rate, self.min_rate), self.max_rate)
        self.samples += 1
        self.abs_error_sum += abs(error)
        return error


class Calibrator:
    """Per-pod calibrations, created on first use from the prior."""

    def __init__(self, prior_rate: float, prior_overhead_s: float, halflife: float = 200.0,
                 enabled: bool = True, min_rate: float | None = None, max_rate: float | None = None):
        self.prior_rate = prior_rate
        self.prior_overhead_s = prior_overhead_s
        self.enabled = enabled
        self.forget = 0.5 ** (1.0 / max(halflife, 1.0))
        self.min_rate = min_rate if min_rate is not None else prior_rate / 20
        self.max_rate = max_rate if max_rate is not None else prior_rate * 20
        self.pods: dict[str, PodCalibration] = {}

    def pod(self, pod_id: str, prior_rate: float | None = None) -> PodCalibration:
        cal = self.pods.get(pod_id)
        if cal is None:
            rate = prior_rate or self.prior_rate
            cal = PodCalibration(overhead_s=self.prior_overhead_s, rate=rate, min_rate=min(self.min_rate, rate),
                                 max_rate=max(self.max_rate, rate), forget=self.forget)
            self.pods[pod_id] = cal
        return cal

    def observe(self, pod_id: str, work_tokens: float, ttft_s: float) -> float:
        cal = self.pod(pod_id)
        if not self.enabled:
            return ttft_s - (cal.overhead_s + work_tokens / cal.rate)
        return cal.observe(work_tokens, ttft_s)
