"""Predicted time to first token: queue wait + this request's uncached prefill + a fixed overhead
+ the running batch's share of the steps (calibrated per pod: ``calibrator.py``).

The pod is modelled as one FIFO prefill server. Its queue is the uncached prefill work the router
has booked there and not yet seen start (``queue_tokens``), plus any requests its metrics say are
waiting that the router did not send (counted at ``unknown_request_tokens`` each). Everything is
divided by the pod's calibrated prefill rate. The prediction carries the pod's error model for a
prediction of its size (``Candidate.error_model``), which admission turns into a miss probability.
"""

from __future__ import annotations

from .snapshot import Candidate, Prediction, RequestView, size_bucket


def uncached_tokens(candidate: Candidate, request: RequestView) -> int:
    """Tokens this pod must prefill: the prompt less its (tier-weighted) cached prefix, at least one."""
    cached = min(candidate.effective_cached_tokens, float(request.prompt_tokens))
    return max(1, int(round(request.prompt_tokens - cached))) if request.prompt_tokens > 0 else 0


def foreign_waiting(candidate: Candidate) -> int:
    """Waiting requests on the pod that the router has no booking for (other routers, restarts)."""
    return max(0, candidate.waiting - candidate.inflight_requests)


def predict(candidate: Candidate, request: RequestView) -> Prediction:
    # ``uncached_tokens``, ``foreign_waiting`` and ``Candidate.error_model`` written out: this runs
    # for every pod on every request (bench/decision_cost.py)
    c = candidate
    rate = c.prefill_tokens_per_s if c.prefill_tokens_per_s > 1.0 else 1.0
    queued = c.queue_tokens
    if c.waiting > c.inflight_requests:
        queued += (c.waiting - c.inflight_requests) * request.unknown_request_tokens
    n = request.prompt_tokens
    if n > 0:
        cached = c.effective_cached_tokens
        own = int(round(n - cached)) if cached < n else 0
        if own < 1:
            own = 1
    else:
        own = 0
    queue_s, prefill_s = queued / rate, own / rate
    batch_s = c.running * c.per_running_s if c.running > 0 else 0.0
    if c.error_by_size:
        log_mean, log_sd = c.error_by_size[size_bucket(queue_s + prefill_s + c.overhead_s + batch_s)]
    else:
        log_mean, log_sd = c.log_error_mean, c.log_error_sd
    return Prediction(queue_s, prefill_s, c.overhead_s, own, log_mean, log_sd, batch_s)
