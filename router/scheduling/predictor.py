"""Predicted time to first token: queue wait + this request's uncached prefill + a fixed overhead
+ the running batch's share of the steps (calibrated per pod: ``calibrator.py``).

The pod is modelled as one FIFO prefill server. Its queue is the uncached prefill work the router
has booked there and not yet seen start (``queue_tokens``), plus any requests its metrics say are
waiting that the router did not send (counted at ``unknown_request_tokens`` each). Everything is
divided by the pod's calibrated prefill rate. The prediction carries the pod's error model for a
prediction of its size (``Candidate.error_model``), which admission turns into a miss probability.
"""

from __future__ import annotations

from .snapshot import Candidate, Prediction, RequestView


def uncached_tokens(candidate: Candidate, request: RequestView) -> int:
    """Tokens this pod must prefill: the prompt less its (tier-weighted) cached prefix, at least one."""
    cached = min(candidate.effective_cached_tokens, float(request.prompt_tokens))
    return max(1, int(round(request.prompt_tokens - cached))) if request.prompt_tokens > 0 else 0


def foreign_waiting(candidate: Candidate) -> int:
    """Waiting requests on the pod that the router has no booking for (other routers, restarts)."""
    return max(0, candidate.waiting - candidate.inflight_requests)


def predict(candidate: Candidate, request: RequestView) -> Prediction:
    rate = max(candidate.prefill_tokens_per_s, 1.0)
    queued = candidate.queue_tokens + foreign_waiting(candidate) * request.unknown_request_tokens
    own = uncached_tokens(candidate, request)
    queue_s, prefill_s = queued / rate, own / rate
    batch_s = max(candidate.running, 0) * candidate.per_running_s
    log_mean, log_sd = candidate.error_model(queue_s + prefill_s + candidate.overhead_s + batch_s)
    return Prediction(queue_s=queue_s, prefill_s=prefill_s, overhead_s=candidate.overhead_s,
                      uncached_tokens=own, log_mean=log_mean, log_sd=log_sd, batch_s=batch_s)
