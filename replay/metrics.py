"""Per-request records and the summary computed from them (pure functions, no I/O).

Definitions (printed under the console table too):

* TTFT: from the moment the client starts sending the request to the first streamed token.
* ITL: every gap between consecutive streamed token chunks, pooled over all requests.
* TPOT: per request, ``(e2e - ttft) / (output_tokens - 1)``; excludes the first token.
* E2E: from send to the end of the stream.
* SLO attainment: requests that completed with TTFT <= ``slo_ttft`` (and TPOT <= ``slo_tpot``
  when given) divided by ALL requests sent; a rejection (429) or an error is a miss.
* Goodput: requests meeting the SLO per second of benchmark duration.
* Send lateness: actual send time minus scheduled send time (time spent waiting for a
  ``--max-concurrency`` slot excluded, reported apart as queue time).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. Times are seconds; offsets are from the run's start."""

    index: int
    scheduled: float
    input_tokens: int
    sent: float | None = None
    lateness: float | None = None
    queue_time: float = 0.0
    status: int = 0  # HTTP status; 0 when no response arrived
    error: str | None = None  # None when the stream completed
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int | None = None
    pod: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


def error_class(rec: RequestRecord) -> str | None:
    """How a request failed, as a short key: '429', '503', 'connection', 'incomplete', ..."""
    if rec.ok:
        return None
    if rec.status and rec.status != 200:
        return str(rec.status)
    return rec.error or "unknown"


def meets_slo(rec: RequestRecord, slo_ttft: float | None, slo_tpot: float | None) -> bool:
    if not rec.ok or rec.ttft is None:
        return False
    if slo_ttft is not None and rec.ttft > slo_ttft:
        return False
    if slo_tpot is not None:
        tpot = rec.tpot
        if tpot is not None and tpot > slo_tpot:
            return False
    return True


def _stats_ms(values: Sequence[float], name: str) -> dict[str, float | None]:
    """vLLM-style keys mean_/median_/std_/p90_/p99_<name>_ms (None when there are no values)."""
    keys = ("mean", "median", "std", "p90", "p99")
    if len(values) == 0:
        return {f"{k}_{name}_ms": None for k in keys}
    arr = np.asarray(values, dtype=float) * 1000.0
    return {
        f"mean_{name}_ms": float(arr.mean()),
        f"median_{name}_ms": float(np.percentile(arr, 50)),
        f"std_{name}_ms": float(arr.std()),
        f"p90_{name}_ms": float(np.percentile(arr, 90)),
        f"p99_{name}_ms": float(np.percentile(arr, 99)),
    }


def peak_concurrency(intervals: Iterable[tuple[float, float]]) -> int:
    """Most intervals open at once (ends before starts at equal times)."""
    events = []
    for start, end in intervals:
        events.append((start, 1))
        events.append((end, -1))
    events.sort(key=lambda e: (e[0], e[1]))
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def hit_rate_from_metrics(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Prefix-cache hit rate over the run from pods' counters scraped before and after.

    ``before``/``after`` map a pod URL to {"queries": x, "hits": y} (vLLM's
    ``vllm:prefix_cache_queries_total`` / ``_hits_total``, summed over label sets).
    """
    per_pod: dict[str, float | None] = {}
    dq_total = dh_total = 0.0
    for url, end in after.items():
        start = before.get(url, {"queries": 0.0, "hits": 0.0})
        dq = end.get("queries", 0.0) - start.get("queries", 0.0)
        dh = end.get("hits", 0.0) - start.get("hits", 0.0)
        if dq < 0 or dh < 0:  # the pod restarted during the run: counters went back to zero
            dq, dh = end.get("queries", 0.0), end.get("hits", 0.0)
        per_pod[url] = dh / dq if dq > 0 else None
        dq_total += dq
        dh_total += dh
    return {
        "hit_rate": dh_total / dq_total if dq_total > 0 else None,
        "hit_rate_per_pod": per_pod,
        "prefix_cache_queries": dq_total,
        "prefix_cache_hits": dh_total,
    }


def summarize(records: Sequence[RequestRecord], *, duration: float, slo_ttft: float | None = None,
              slo_tpot: float | None = None, lateness_warn_ms: float = 10.0) -> dict[str, Any]:
    """The run's summary dict (see the module docstring for the definitions)."""
    sent = [r for r in records if r.sent is not None or r.status or r.error]
    ok = [r for r in sent if r.ok]
    errors_by_status: dict[str, int] = {}
    for r in sent:
        cls = error_class(r)
        if cls is not None:
            errors_by_status[cls] = errors_by_status.get(cls, 0) + 1
    rejected = errors_by_status.get("429", 0)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    itls = [g for r in ok for g in r.itls]
    e2es = [r.e2e for r in ok if r.e2e is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_tokens for r in ok)
    dur = max(duration, 1e-9)
    has_slo = slo_ttft is not None or slo_tpot is not None
    good = sum(1 for r in sent if meets_slo(r, slo_ttft, slo_tpot))
    per_pod: dict[str, int] = {}
    for r in sent:
        if r.pod:
            per_pod[r.pod] = per_pod.get(r.pod, 0) + 1
    late = [r.lateness for r in sent if r.lateness is not None]
    late_ms = np.asarray(late, dtype=float) * 1000.0 if late else np.asarray([0.0])
    queue = [r.queue_time for r in sent]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    usage_hit = (sum(cached) / sum(r.input_tokens for r in ok if r.cached_tokens is not None)
                 if cached and sum(r.input_tokens for r in ok if r.cached_tokens is not None) else None)
    intervals = [(r.sent, r.sent + r.e2e) for r in ok if r.sent is not None and r.e2e is not None]

    def q(values: Sequence[float], p: float) -> float | None:
        return float(np.percentile(values, p)) if len(values) else None

    # over ALL requests sent: a rejected or failed request never got a first token (infinity)
    all_ttfts = sorted([r.ttft if r.ok and r.ttft is not None else math.inf for r in sent])

    def q_all(p: float) -> float | None:
        if not all_ttfts:
            return None
        v = all_ttfts[min(len(all_ttfts) - 1, int(math.ceil(p / 100.0 * len(all_ttfts))) - 1)]
        return v if math.isfinite(v) else math.inf

    late_admitted = sum(1 for r in ok if slo_ttft is not None and (r.ttft is None or r.ttft > slo_ttft))

    summary: dict[str, Any] = {
        "requests": len(sent),
        "completed": len(ok),
        "rejected": rejected,
        "errors": len(sent) - len(ok) - rejected,
        "failed": len(sent) - len(ok),
        "errors_by_status": dict(sorted(errors_by_status.items())),
        "duration": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "max_concurrent_requests": peak_concurrency(intervals),
        **_stats_ms(ttfts, "ttft"),
        **_stats_ms(tpots, "tpot"),
        **_stats_ms(itls, "itl"),
        **_stats_ms(e2es, "e2el"),
        # Short aliases in seconds, the unit of --slo-ttft.
        "ttft_mean": float(np.mean(ttfts)) if ttfts else None,
        "ttft_p50": q(ttfts, 50),
        "ttft_p90": q(ttfts, 90),
        "ttft_p99": q(ttfts, 99),
        # the same over all requests sent (nearest rank; inf when the rank falls on a rejection)
        "ttft_p50_all": q_all(50),
        "ttft_p90_all": q_all(90),
        "ttft_p99_all": q_all(99),
        "admitted_late": (late_admitted / len(sent) if sent else None) if slo_ttft is not None else None,
        "slo_ttft": slo_ttft,
        "slo_tpot": slo_tpot,
        "slo_met": good if has_slo else None,
        "slo_attainment": (good / len(sent) if sent else None) if has_slo else None,
        "request_goodput": good / dur if has_slo else None,
        "per_pod": dict(sorted(per_pod.items())),
        "usage_cached_tokens": sum(cached) if cached else None,
        "usage_hit_rate": usage_hit,
        "lateness_p50_ms": float(np.percentile(late_ms, 50)),
        "lateness_p99_ms": float(np.percentile(late_ms, 99)),
        "lateness_max_ms": float(late_ms.max()),
        "queue_time_p50_ms": (q(queue, 50) or 0.0) * 1000.0 if queue else None,
        "queue_time_p99_ms": (q(queue, 99) or 0.0) * 1000.0 if queue else None,
    }
    summary["client_fell_behind"] = bool(summary["lateness_p99_ms"] > lateness_warn_ms)
    summary["hit_rate"] = None
    return summary


def finite_or_none(x: Any) -> Any:
    """JSON-safe number (NaN/inf become None)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
