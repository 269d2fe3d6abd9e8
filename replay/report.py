"""Console report in ``vllm bench serve``'s layout, JSON result files and side-by-side comparison."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

WIDTH = 50

DEFINITIONS = """\
Definitions:
  TTFT   time from sending the request to the first streamed token
  TPOT   per request (E2E - TTFT) / (output tokens - 1), first token excluded
  ITL    every gap between consecutive streamed token chunks, pooled over requests
  E2E    time from sending the request to the end of its stream
  TTFT, all sent  nearest-rank percentile over ALL requests sent; 'miss' when the rank falls on a
                  rejected or failed request (the plain TTFT rows cover successful requests only)
  SLO attainment  requests with TTFT <= SLO (and TPOT <= SLO when given) / ALL requests sent;
                  rejected (429) and failed requests count as misses
  Goodput         requests meeting the SLO per second of run duration
  Hit rate        prefix-cache hits / queries from the pods' vllm:prefix_cache_* counters
  Send lateness   actual send time - scheduled send time (client's own delay)"""


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.{digits}f}"
    return str(value)


def _row(name: str, value: Any, digits: int = 2) -> str:
    return f"{name:<40}{_fmt(value, digits):<10}"


def _ms_or_miss(seconds: float | None) -> str | None:
    """A TTFT over all requests sent, in ms; 'miss' where the rank falls on a rejected or failed request."""
    if seconds is None:
        return None
    return f"{seconds * 1000:.2f}" if math.isfinite(seconds) else "miss"


def _pct(value: float | None) -> str | None:
    return None if value is None else f"{100 * value:.1f}%"


def format_table(summary: dict[str, Any], config: dict[str, Any] | None = None, definitions: bool = True) -> str:
    """The run summary as text, section by section, in vLLM's 50-column style."""
    config = config or {}
    s = summary
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=WIDTH, c="=")]
    if config.get("label"):
        lines.append(_row("Label:", config["label"]))
    lines += [
        _row("Requests sent:", s["requests"]),
        _row("Successful requests:", s["completed"]),
        _row("Rejected requests (429):", s["rejected"]),
        _row("Failed requests (other):", s["errors"]),
    ]
    for cls, count in (s.get("errors_by_status") or {}).items():
        lines.append(_row(f"  by status {cls}:", count))
    arrival = config.get("arrival")
    if arrival == "trace":
        lines.append(_row("Arrivals:", f"trace x{config.get('time_scale', 1.0):g}"))
    elif arrival:
        extra = f" b={config['burstiness']:g}" if arrival == "gamma" and config.get("burstiness") else ""
        lines.append(_row("Arrivals:", f"{arrival} {config.get('rate')} req/s{extra}"))
    lines += [
        _row("Maximum request concurrency:", config.get("max_concurrency")),
        _row("Benchmark duration (s):", s["duration"]),
        _row("Total input tokens:", s["total_input_tokens"]),
        _row("Total generated tokens:", s["total_output_tokens"]),
        _row("Request throughput (req/s):", s["request_throughput"]),
        _row("Request goodput (req/s):", s.get("request_goodput")),
        _row("Output token throughput (tok/s):", s["output_throughput"]),
        _row("Total token throughput (tok/s):", s["total_token_throughput"]),
        _row("Peak concurrent requests:", s.get("max_concurrent_requests")),
    ]
    for title, key, label in (("Time to First Token", "ttft", "TTFT"),
                              ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
                              ("Inter-token Latency", "itl", "ITL"),
                              ("End-to-end Latency", "e2el", "E2EL")):
        lines.append("{s:{c}^{n}}".format(s=title, n=WIDTH, c="-"))
        lines.append(_row(f"Mean {label} (ms):", s.get(f"mean_{key}_ms")))
        lines.append(_row(f"Median {label} (ms):", s.get(f"median_{key}_ms")))
        lines.append(_row(f"P90 {label} (ms):", s.get(f"p90_{key}_ms")))
        lines.append(_row(f"P99 {label} (ms):", s.get(f"p99_{key}_ms")))
        if key == "ttft" and (s.get("failed") or 0):  # the rows above leave out rejected and failed requests
            for p in (50, 90, 99):
                lines.append(_row(f"P{p} TTFT, all sent (ms):", _ms_or_miss(s.get(f"ttft_p{p}_all"))))
    lines.append("{s:{c}^{n}}".format(s="Objective", n=WIDTH, c="-"))
    lines.append(_row("TTFT SLO (ms):", None if s.get("slo_ttft") is None else s["slo_ttft"] * 1000, 0))
    if s.get("slo_tpot") is not None:
        lines.append(_row("TPOT SLO (ms):", s["slo_tpot"] * 1000, 1))
    lines.append(_row("SLO attainment (all requests):", _pct(s.get("slo_attainment"))))
    lines.append("{s:{c}^{n}}".format(s="Routing and cache", n=WIDTH, c="-"))
    lines.append(_row("Prefix-cache hit rate (pods):", _pct(s.get("hit_rate"))))
    if s.get("usage_hit_rate") is not None:
        lines.append(_row("Cached prompt tokens (usage):", _pct(s["usage_hit_rate"])))
    per_pod = s.get("per_pod") or {}
    if per_pod:
        for pod, count in per_pod.items():
            lines.append(_row(f"Requests to {pod}:", count))
    else:
        lines.append(_row("Requests per pod:", "- (no x-kvroute-pod header)"))
    lines.append("{s:{c}^{n}}".format(s="Client", n=WIDTH, c="-"))
    lines.append(_row("Send lateness P50 (ms):", s.get("lateness_p50_ms")))
    lines.append(_row("Send lateness P99 (ms):", s.get("lateness_p99_ms")))
    lines.append(_row("Send lateness max (ms):", s.get("lateness_max_ms")))
    if config.get("max_concurrency"):
        lines.append(_row("Concurrency queue time P99 (ms):", s.get("queue_time_p99_ms")))
    lines.append(_row("Client fell behind:", s.get("client_fell_behind")))
    lines.append("=" * WIDTH)
    if definitions:
        lines.append(DEFINITIONS)
    return "\n".join(lines)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY,
                               default=_json_default))
    return p


def load_result(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {p}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p} is not a JSON result file: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("summary"), dict):
        raise ValueError(f"{p} is not a replay result (no 'summary' object)")
    return data


COMPARE_ROWS: list[tuple[str, str, str]] = [
    ("requests", "Requests sent", "int"),
    ("completed", "Successful", "int"),
    ("rejected", "Rejected (429)", "int"),
    ("errors", "Failed (other)", "int"),
    ("request_throughput", "Throughput (req/s)", "f2"),
    ("request_goodput", "Goodput (req/s)", "f2"),
    ("slo_attainment", "SLO attainment", "pct"),
    ("mean_ttft_ms", "Mean TTFT (ms)", "f1"),
    ("median_ttft_ms", "Median TTFT (ms)", "f1"),
    ("p90_ttft_ms", "P90 TTFT (ms)", "f1"),
    ("p99_ttft_ms", "P99 TTFT (ms)", "f1"),
    ("ttft_p99_all", "P99 TTFT all sent (ms)", "s_ms"),
    ("median_tpot_ms", "Median TPOT (ms)", "f2"),
    ("p99_tpot_ms", "P99 TPOT (ms)", "f2"),
    ("median_e2el_ms", "Median E2E (ms)", "f1"),
    ("hit_rate", "Prefix-cache hit rate", "pct"),
    ("lateness_p99_ms", "Send lateness P99 (ms)", "f2"),
]


def _cell(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "int":
        return str(int(value))
    if kind == "s_ms":  # seconds shown in ms; infinite when the rank falls on a rejected or failed request
        return _ms_or_miss(value) or "-"
    return f"{value:.{int(kind[1])}f}"


def _value(summary: dict[str, Any], key: str, kind: str) -> Any:
    value = summary.get(key)
    if kind == "s_ms" and key in summary and value is None and summary.get("requests"):
        return math.inf  # JSON has no infinity: a saved miss reads back as null
    return value


def format_compare(results: Sequence[dict[str, Any]], names: Sequence[str]) -> str:
    """Runs side by side: one column per result file, one row per key metric."""
    width = max(12, *(len(n) + 2 for n in names))
    head = f"{'':<26}" + "".join(f"{n:>{width}}" for n in names)
    lines = [head, "-" * len(head)]
    for key, title, kind in COMPARE_ROWS:
        lines.append(f"{title:<26}" + "".join(f"{_cell(_value(r['summary'], key, kind), kind):>{width}}"
                                              for r in results))
    pods = sorted({p for r in results for p in (r["summary"].get("per_pod") or {})})
    for pod in pods:
        lines.append(f"{'  to ' + pod:<26}" + "".join(
            f"{_cell((r['summary'].get('per_pod') or {}).get(pod, 0), 'int'):>{width}}" for r in results))
    return "\n".join(lines)
