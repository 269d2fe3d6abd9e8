"""``kvroute replay``: replay a trace or synthetic workload against a target and report.

``kvroute replay [--target URL] [WORKLOAD] [flags]`` runs; ``kvroute replay compare A.json B.json``
prints saved runs side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from kvcommon.settings import ConfigError, add_settings_arguments, settings_error, settings_from_args
from replay.settings import ReplaySettings

DESCRIPTION = ("Replay a trace (mooncake:PATH, azure:PATH) or a synthetic workload (multiturn, shared-prefix) "
               "open-loop against an OpenAI-compatible target; print TTFT/TPOT/ITL/E2E, SLO attainment, "
               "prefix-cache hit rate and requests per pod; write JSON and PNG plots. "
               "'kvroute replay compare A.json B.json ...' prints saved runs side by side.")


WORKLOAD_KINDS = ("mooncake", "azure", "multiturn", "shared-prefix", "shared_prefix")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute replay", description=DESCRIPTION)
    parser.add_argument("workload_arg", nargs="?", metavar="WORKLOAD", default=None,
                        help="mooncake:PATH, azure:PATH, multiturn or shared-prefix (same as --workload)")
    add_settings_arguments(parser, ReplaySettings)
    for action in parser._actions:
        if action.dest == "pod_metrics":  # `--pod-metrics URL [URL ...]` reads better than JSON
            action.nargs = "+"
            action.type = str
            action.metavar = "URL"
    return parser


def _normalise_pod_metrics(values: Any) -> list[str]:
    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for v in values or []:
        v = str(v).strip()
        if v.startswith("["):
            out.extend(str(x) for x in json.loads(v))
        else:
            out.extend(x for x in v.split(",") if x)
    return out


def _result_stem(settings: ReplaySettings) -> Path:
    if settings.result_file:
        p = Path(settings.result_file)
        if not p.is_absolute() and p.parent == Path("."):
            p = Path(settings.result_dir) / p
        return p.with_suffix("")
    workload = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(settings.workload.split(":", 1)[-1]).stem
                      if ":" in settings.workload else settings.workload)
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", settings.label or "replay")
    return Path(settings.result_dir) / f"{label}-{workload}-{time.strftime('%Y%m%d-%H%M%S')}"


def _progress_printer(total_hint: int):
    tty = sys.stderr.isatty()
    last_line = [0.0]

    def show(p) -> None:
        if not tty and p.elapsed - last_line[0] < 10.0:
            return
        last_line[0] = p.elapsed
        pct = 100.0 * p.sent / max(1, p.total)
        line = (f"[{p.elapsed:7.1f}s] sent {p.sent}/{p.total} ({pct:5.1f}%)  done {p.done}  "
                f"in flight {p.in_flight}  ok {p.ok}  429 {p.rejected}  errors {p.errors}")
        print(("\r" + line) if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)

    return show


def compare_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvroute replay compare",
                                     description="Print saved replay results side by side.")
    parser.add_argument("results", nargs="+", metavar="RESULT.json")
    args = parser.parse_args(argv)
    from replay.report import format_compare, load_result

    try:
        results = [load_result(p) for p in args.results]
    except ValueError as exc:
        print(f"kvroute replay compare: error: {exc}", file=sys.stderr)
        return 2
    names = [(r.get("config") or {}).get("label") or Path(p).stem for r, p in zip(results, args.results)]
    print(format_compare(results, names))
    return 0


async def _run(settings: ReplaySettings) -> int:
    from replay import runner
    from replay.plan import build_plan
    from replay.report import format_table, write_json

    specs, offsets, kind = build_plan(settings)
    if not specs:
        print("kvroute replay: error: no request fits the limits (--duration/--max-requests)", file=sys.stderr)
        return 2
    span = offsets[-1] if offsets else 0.0
    print(f"replaying {len(specs)} requests of {settings.workload} over {span:.1f} s "
          f"({kind} arrivals) to {settings.target}", file=sys.stderr)
    config = {"label": settings.label, "workload": settings.workload, "arrival": kind, "rate": settings.rate,
              "burstiness": settings.burstiness, "time_scale": settings.time_scale, "seed": settings.seed,
              "block_size": settings.block_size, "vocab_size": settings.vocab_size,
              "max_input_len": settings.max_input_len, "max_requests": settings.max_requests,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "settings": settings.model_dump(mode="json")}
    progress = _progress_printer(len(specs)) if settings.progress else None
    targets = [t.strip() for t in settings.target.split(",") if t.strip()]
    result = await runner.run(
        targets if len(targets) > 1 else settings.target, specs, offsets, endpoint=settings.endpoint,
        model=settings.model,
        max_concurrency=settings.max_concurrency, duration=settings.duration,
        slo_ttft=settings.slo_ttft, slo_tpot=settings.slo_tpot, send_slo_header=settings.send_slo_header,
        pod_metrics=settings.pod_metrics, headers=settings.headers, request_timeout=settings.request_timeout,
        drain_timeout=settings.drain_timeout, ignore_eos=settings.ignore_eos, extra_body=settings.extra_body,
        progress=progress, lateness_warn_ms=settings.lateness_warn_ms, config=config)
    if progress and sys.stderr.isatty():
        print(file=sys.stderr)
    print(format_table(result.summary, result.config))
    runner.print_warning(result.summary)
    stem = _result_stem(settings)
    path = write_json(stem.with_suffix(".json"), result.to_dict(include_records=settings.save_detailed))
    print(f"result: {path}")
    if settings.plots:
        from replay.plots import write_plots

        for p in write_plots(result.records, result.summary, stem, settings.label):
            print(f"plot: {p}")
    return 0


def _raise_open_file_limit() -> None:
    """Every stream in flight holds a socket; lift the soft descriptor limit to the hard one."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


def _loop_factory():
    """uvloop when installed: measured lower send lateness than the default loop (docs/replay.md)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "compare":
        return compare_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(args, "pod_metrics"):
        urls = _normalise_pod_metrics(args.pod_metrics)
        # `--pod-metrics URL ... WORKLOAD`: argparse hands the workload to the list; take it back.
        stray = [u for u in urls if not u.startswith(("http://", "https://"))]
        if len(stray) == 1 and args.workload_arg is None and stray[0].split(":", 1)[0] in WORKLOAD_KINDS:
            args.workload_arg = stray[0]
            urls.remove(stray[0])
            stray = []
        if stray:
            parser.error(f"--pod-metrics takes http(s) URLs, got {', '.join(map(repr, stray))}")
        args.pod_metrics = urls
    if args.workload_arg is not None:
        args.workload = args.workload_arg
    try:
        settings = settings_from_args(ReplaySettings, args)
    except (ConfigError, ValueError) as exc:
        parser.error(settings_error(exc))
        return 2
    from replay.runner import RunError
    from replay.workloads import TraceError

    _raise_open_file_limit()
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as loop_runner:
            return loop_runner.run(_run(settings))
    except (TraceError, RunError, ValueError) as exc:
        print(f"kvroute replay: error: {exc}", file=sys.stderr)
        return 2
