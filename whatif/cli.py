"""``kvroute simulate``: replay a trace or workload through the router's live decision code in simulated time.

    kvroute simulate multiturn --rate 70 --duration 60 --timing seed --block-size 64 --num-gpu-blocks 3000
    kvroute simulate mooncake:data/conversation_trace.jsonl --policy predicted-ttft+admission,oracle --json out.json

Each policy gets the same requests at the same arrival times against a fresh fleet of pod models
(empty caches); the table has one row per policy (hit rate, TTFT p50/p99, attainment of the TTFT
objective over all requests sent, a rejection counting as a miss) and ``--json`` writes every run's
replay summary (the same keys as ``kvroute replay``'s JSON).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from whatif.podmodel import PodSpec

ALL_POLICIES = ("random", "round-robin", "least-load", "cache-only", "predicted-ttft", "predicted-ttft+admission",
                "oracle+admission")
DESCRIPTION = ("Replay a trace (mooncake:PATH, azure:PATH) or a synthetic workload (multiturn, shared-prefix) "
               "through the router's own decision code (ledger, calibrator, scorers, admission, prefix index) "
               "against simulated pods in simulated time (seed or cost timing, the simulator's own models); "
               "print attainment, rejections, hit rate and TTFT per policy. Policies: random, round-robin, "
               "least-load, cache-only, predicted-ttft, oracle (perfect knowledge of every pod's queue and "
               "cache), true-state (predicted-ttft's decision code on every pod's true TTFT); append +admission "
               "for early rejection.")


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The replay client's workload and arrival flags (same names and defaults as ``kvroute replay``)."""
    from replay.settings import ReplaySettings

    fields = ReplaySettings.model_fields
    w = p.add_argument_group("workload (as kvroute replay)")
    w.add_argument("workload", nargs="?", default="multiturn", metavar="WORKLOAD",
                   help="mooncake:PATH, azure:PATH, multiturn or shared-prefix")
    for name, typ in (("seed", int), ("block_size", int), ("vocab_size", int), ("system_prompts", int),
                      ("system_prompt_len", int), ("sessions", int), ("turns", int), ("turn_tokens", int),
                      ("output_len", int), ("num_groups", int), ("prompts_per_group", int), ("question_len", int),
                      ("max_output_len", int), ("max_input_len", int)):
        f = fields[name]
        flag = "--trace-block-size" if name == "block_size" else "--" + name.replace("_", "-")
        w.add_argument(flag, dest="w_" + name, type=typ, default=f.default, metavar=name.upper(),
                       help=f.description)
    w.add_argument("--input-len-policy", dest="w_input_len_policy", choices=("truncate", "skip"), default="truncate")
    a = p.add_argument_group("arrivals (as kvroute replay)")
    a.add_argument("--arrival", dest="w_arrival", choices=("auto", "trace", "poisson", "gamma", "constant"),
                   default="auto", help="arrival process; auto = trace timestamps for traces, else poisson")
    a.add_argument("--rate", dest="w_rate", metavar="RATE", type=float, default=None,
                   help="requests per second (poisson, gamma, constant)")
    a.add_argument("--burstiness", dest="w_burstiness", metavar="BURSTINESS", type=float, default=1.0,
                   help="gamma shape")
    a.add_argument("--time-scale", dest="w_time_scale", metavar="TIME_SCALE", type=float, default=1.0,
                   help="trace arrivals: send time = trace time x this")
    a.add_argument("--duration", dest="w_duration", metavar="DURATION", type=float, default=None,
                   help="only requests arriving before this many seconds")
    a.add_argument("--max-requests", dest="w_max_requests", metavar="MAX_REQUESTS", type=int, default=None,
                   help="at most this many requests")


def add_pod_arguments(p: argparse.ArgumentParser) -> None:
    d = PodSpec()
    g = p.add_argument_group("simulated pods (as kvroute sim)")
    g.add_argument("--pods", type=int, default=8, help="pods in the fleet")
    g.add_argument("--timing", choices=("seed", "cost"), default="seed",
                   help="seed: one FIFO prefill server per pod; cost: batched steps, chunked prefill")
    g.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
    g.add_argument("--num-gpu-blocks", type=int, default=3000, help="KV blocks per pod")
    g.add_argument("--prefill-tokens-per-s", type=float, default=d.prefill_tokens_per_s,
                   help="seed: prefill speed")
    g.add_argument("--decode-s-per-token", type=float, default=d.decode_s_per_token,
                   help="seed: seconds between output tokens")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="cost")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="cost: token budget of a step")
    g.add_argument("--step-overhead-s", type=float, default=d.step_overhead_s,
                   help="cost")
    g.add_argument("--compute-s-per-token", type=float, default=d.compute_s_per_token,
                   help="cost")
    g.add_argument("--kv-read-s-per-token", type=float, default=d.kv_read_s_per_token,
                   help="cost")


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse, with the flag's name, what would end in a traceback, a loop that never ends, or a table
    of nonsense: a fleet of no pods, a pod of no blocks or no batch, a negative or not-a-number time
    or rate, an objective no request can meet (or every one meets, NaN)."""
    def finite(flag: str, value: float | None, *, positive: bool) -> None:
        if value is None:
            return
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise ValueError(f"{flag} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")

    for flag, dest in (("--pods", "pods"), ("--block-size", "block_size"), ("--num-gpu-blocks", "num_gpu_blocks"),
                       ("--max-num-seqs", "max_num_seqs"), ("--max-num-batched-tokens", "max_num_batched_tokens")):
        if getattr(args, dest) < 1:
            raise ValueError(f"{flag} must be at least 1, got {getattr(args, dest)}")
    finite("--prefill-tokens-per-s", args.prefill_tokens_per_s, positive=True)
    for flag, dest in (("--decode-s-per-token", "decode_s_per_token"), ("--step-overhead-s", "step_overhead_s"),
                       ("--compute-s-per-token", "compute_s_per_token"),
                       ("--kv-read-s-per-token", "kv_read_s_per_token"), ("--event-delay-ms", "event_delay_ms"),
                       ("--request-latency-ms", "request_latency_ms")):
        finite(flag, getattr(args, dest, None), positive=False)
    finite("--slo-ttft", args.slo_ttft, positive=True)
    finite("--slo-tpot", args.slo_tpot, positive=True)
    finite("--scrape-interval-s", getattr(args, "scrape_interval_s", None), positive=True)


def pod_spec(args: argparse.Namespace) -> PodSpec:
    return PodSpec(timing=args.timing, block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
                   prefill_tokens_per_s=args.prefill_tokens_per_s, decode_s_per_token=args.decode_s_per_token,
                   max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   step_overhead_s=args.step_overhead_s, compute_s_per_token=args.compute_s_per_token,
                   kv_read_s_per_token=args.kv_read_s_per_token)


def build_requests(args: argparse.Namespace) -> tuple[list[Any], list[float], str]:
    """The replay client's own plan (``replay.plan.build_plan``) from the workload flags."""
    from replay.plan import build_plan
    from replay.settings import ReplaySettings

    values = {k[2:]: v for k, v in vars(args).items() if k.startswith("w_")}
    values["workload"] = args.workload
    settings = ReplaySettings(**values)
    return build_plan(settings)


def parse_router_overrides(items: list[str]) -> dict[str, Any]:
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--router takes KEY=VALUE (a router setting), got {item!r}")
        out[key.strip().replace("-", "_")] = yaml.safe_load(value)
    return out


def format_rows(runs: list[tuple[str, dict[str, Any]]], objective_s: float | None) -> str:
    """One row per policy, the columns of ``bench/routing_quality.py``'s table: "met" counts every
    request sent (a rejection is a miss); TTFT p99 over the admitted requests and over all sent (a
    rejection at infinity); "admitted, late": let through but still over the objective; "[N errors]":
    admitted but never answered, or refused by the pod (a prompt and output its KV cache cannot hold)."""
    obj = f"{objective_s:g} s" if objective_s is not None else "(no)"
    lines = [f"| policy | hit rate | TTFT p50 (admitted) | TTFT p99 (admitted) | TTFT p99 (all sent) | "
             f"met the {obj} objective (all sent) | rejected | admitted, late |",
             "|---|---|---|---|---|---|---|---|"]

    def sec(v: float | None) -> str:
        return "-" if v is None else "inf (rejected)" if v == float("inf") else f"{v:.2f} s"

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f} %"

    for name, s in runs:
        n = max(int(s.get("requests") or 0), 1)
        rejected = (s.get("errors_by_status") or {}).get("429", 0) / n
        met = pct(s.get("slo_attainment")) + (f" [{s['errors']} errors]" if s.get("errors") else "")
        lines.append(f"| {name} | {pct(s.get('hit_rate'))} | {sec(s.get('ttft_p50'))} | {sec(s.get('ttft_p99'))} | "
                     f"{sec(s.get('ttft_p99_all'))} | {met} | {pct(rejected)} | "
                     f"{pct(s.get('admitted_late'))} |")
    return "\n".join(lines)


def parse_policy(text: str) -> tuple[str, bool]:
    from whatif.simulate import POLICIES

    name = text.strip()
    admission = False
    for suffix in ("+admission", "+rejection", "+early-rejection"):
        if name.endswith(suffix):
            name, admission = name[: -len(suffix)], True
    if name not in POLICIES:
        raise ValueError(f"unknown policy {text!r}; choose from {', '.join(POLICIES)} (append +admission for "
                         "early rejection)")
    return name, admission


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvroute simulate", description=DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_workload_arguments(p)
    add_pod_arguments(p)
    r = p.add_argument_group("routing")
    r.add_argument("--policy", default=",".join(ALL_POLICIES),
                   help="comma-separated policies to run, each on a fresh fleet")
    r.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT objective in seconds (attainment; admission)")
    r.add_argument("--slo-tpot", type=float, default=None, help="TPOT objective in seconds (attainment only)")
    r.add_argument("--event-delay-ms", type=float, default=0.0,
                   help="KV events reach the router's index this long after the pod caches or evicts")
    r.add_argument("--request-latency-ms", type=float, default=0.0,
                   help="a routed request reaches its pod this long after the decision (HTTP, event loops)")
    r.add_argument("--scrape-interval-s", type=float, default=0.25,
                   help="the router sees each pod's waiting/running/KV usage this often")
    r.add_argument("--router", action="append", default=[], metavar="KEY=VALUE",
                   help="a router setting (kvroute serve's, e.g. work_weight=3, speculative_ttl_s=5); repeatable")
    o = p.add_argument_group("output")
    o.add_argument("--json", default=None, metavar="PATH", help="write every run's summary as JSON here")
    o.add_argument("--report", action="store_true", help="also print the replay report of every run")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from replay.workloads import TraceError
    from whatif.simulate import SimConfig, simulate

    try:
        check_arguments(args)
        policies = [parse_policy(x) for x in args.policy.split(",") if x.strip()]
        if not policies:
            raise ValueError(f"--policy names no policy (got {args.policy!r}); choose from {', '.join(ALL_POLICIES)}")
        overrides = parse_router_overrides(args.router)
        specs, offsets, kind = build_requests(args)
    except (TraceError, ValueError) as exc:
        print(f"kvroute simulate: error: {exc}", file=sys.stderr)
        return 2
    if not specs:
        print("kvroute simulate: error: no request fits the limits (--duration/--max-requests)", file=sys.stderr)
        return 2
    spec = pod_spec(args)
    span = offsets[-1] if offsets else 0.0
    print(f"simulating {len(specs)} requests of {args.workload} over {span:.1f} s ({kind} arrivals) on "
          f"{args.pods} {spec.timing} pods", file=sys.stderr)
    runs: list[tuple[str, dict[str, Any]]] = []
    out: list[dict[str, Any]] = []
    for name, admission in policies:
        cfg = SimConfig(policy=name, admission=admission, objective_s=args.slo_ttft, pods=args.pods, spec=spec,
                        event_delay_s=args.event_delay_ms / 1000.0, scrape_interval_s=args.scrape_interval_s,
                        request_latency_s=args.request_latency_ms / 1000.0,
                        router=overrides, slo_tpot=args.slo_tpot)
        started = time.perf_counter()
        try:
            result = simulate(specs, offsets, cfg)
        except ValueError as exc:
            print(f"kvroute simulate: error: {exc}", file=sys.stderr)
            return 2
        wall = time.perf_counter() - started
        s = result.summary
        hit = "    -  " if s.get("hit_rate") is None else f"{100 * s['hit_rate']:5.1f} %"
        errors = f"  {s['errors']} errors" if s.get("errors") else ""
        print(f"  {cfg.name():<28} met {100 * (s.get('slo_attainment') or 0):5.1f} %  hit {hit}{errors}  "
              f"({wall:.1f} s for {span:.0f} s of arrivals)", file=sys.stderr, flush=True)
        runs.append((cfg.name(), s))
        out.append({"label": cfg.name(), "config": result.config, "summary": s})
        if args.report:
            from replay.report import format_table

            print(format_table(s, {**result.config, "arrival": kind, "rate": args.w_rate}, definitions=False))
    print(format_rows(runs, args.slo_ttft))
    if args.json:
        from replay.report import write_json

        path = write_json(args.json, {"workload": args.workload, "arrival": kind, "requests": len(specs),
                                      "span_s": span, "runs": out})
        print(f"result: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
