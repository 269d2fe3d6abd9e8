"""``/debug/route``'s answer: one decision as JSON, per pod what it holds, what is pending, what is
predicted, and the verdict (plus the P/D planner's reasoning when decode pods are up)."""

from __future__ import annotations

from typing import Any

from router.disagg import explain_pd
from router.routing import Plan


def explain(plan: Plan, block_size: int, policy: str, level: float = 0.9) -> dict[str, Any]:
    """The decision as JSON: per pod what it holds, what is pending, what is predicted, the verdict."""
    d = plan.decision
    objective = plan.request.objective_s
    chosen = d.chosen.pod_id if d.chosen else None
    order = {c.pod_id: i for i, c in enumerate(d.ranked)}
    pods = []
    for c in sorted(d.ranked, key=lambda c: order[c.pod_id]):
        p = d.predictions[c.pod_id]
        pods.append({
            "pod": c.pod_id, "rank": order[c.pod_id] + 1,
            "verdict": "chosen" if c.pod_id == chosen else ("rejected" if not d.verdict.admitted else "candidate"),
            "cached_tokens": c.cached_tokens, "cached_tokens_by_tier": c.cached_by_tier,
            "effective_cached_tokens": c.effective_cached_tokens, "evicting_tokens": c.evicting_tokens,
            "uncached_tokens": p.uncached_tokens,
            "pending_requests": c.inflight_requests, "pending_prefill_tokens": round(c.queue_tokens, 1),
            "waiting": c.waiting, "running": c.running, "kv_usage": c.kv_usage,
            "prefill_tokens_per_s": round(c.prefill_tokens_per_s, 1),
            "predicted_ttft_ms": round(p.ttft_s * 1000, 3), "queue_ms": round(p.queue_s * 1000, 3),
            "prefill_ms": round(p.prefill_s * 1000, 3), "overhead_ms": round(p.overhead_s * 1000, 3),
            "batch_ms": round(p.batch_s * 1000, 3),
            "error_correction": round(p.ttft_s / p.model_ttft_s, 4) if p.model_ttft_s > 0 else 1.0,
            f"ttft_interval_{round(level * 100)}_ms": [round(t * 1000, 3) for t in p.interval(level)],
            "miss_probability": (round(p.miss_probability(objective), 4) if objective is not None else None),
        })
    best = d.best_prediction
    return {
        "policy": policy, "model": plan.model, "prompt_tokens": plan.request.prompt_tokens,
        "block_size": block_size, "blocks": len(plan.keys),
        "objective_ms": plan.request.objective_s * 1000 if plan.request.objective_s is not None else None,
        "admitted": d.verdict.admitted, "reason": d.verdict.reason, "chosen": chosen,
        "best_miss_probability": d.verdict.miss_probability,
        "best_predicted_ttft_ms": round(best.ttft_s * 1000, 3) if best else None,
        "pods": pods,
        **({"pd": explain_pd(d.pd)} if d.pd is not None else {}),
    }
