"""``kvroute plan``: aggregated or prefill/decode, and which split, for a workload and a pod budget.

    kvroute plan multiturn --rate 20 --sessions 80 --turns 4 --output-len 64 --pods 4 --slo-ttft 0.5 \\
        --slo-tpot 0.02 --compute-s-per-token 1e-4

Every candidate fleet of ``--pods`` pods is simulated with ``kvroute simulate``'s engine (the
router's own decision code against the simulator's timing model, in simulated time) on the same
requests: the aggregated fleet (every pod prefills and decodes, ``--policy``) and each P/D split
``p:d`` (``p`` prefill pods, ``d`` decode pods, the router's P/D planner with ``--decider``). A
request meets the objective when its TTFT is within ``--slo-ttft`` and its TPOT within
``--slo-tpot``; attainment counts ALL requests sent (a rejection is a miss). The recommendation is
the candidate with the highest attainment (ties: the lower TTFT p99 over all sent). ``cost`` timing by default,
since only batched steps slow decoding down as prefills join the batch.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

from whatif.cli import (
    add_pod_arguments,
    add_workload_arguments,
    build_requests,
    check_arguments,
    parse_router_overrides,
    pod_spec,
)
from whatif.podmodel import PodSpec

DECIDERS = ("predicted", "prefix", "always")
# the aggregated candidate's policy: the router's own (oracle and true-state bypass or replace the
# router's predictor and run on aggregated fleets only, so they could not be compared with P/D)
AGGREGATED_POLICIES = ("random", "round-robin", "least-load", "cache-only", "predicted-ttft")


@dataclass(frozen=True)
class Candidate:
    prefill: int  # 0: aggregated
    decode: int
    decider: str | None = None

    @property
    def name(self) -> str:
        if not self.prefill:
            return f"aggregated {self.decode}"
        return f"P/D {self.prefill}:{self.decode} ({self.decider})"


def candidates(pods: int, deciders: list[str], splits: list[tuple[int, int]] | None = None) -> list[Candidate]:
    out = [Candidate(0, pods)]
    wanted = splits or [(p, pods - p) for p in range(1, pods)]
    for p, d in wanted:
        for dec in deciders:
            out.append(Candidate(p, d, dec))
    return out


def evaluate(specs: list[Any], offsets: list[float], cand: Candidate, args: argparse.Namespace,
             overrides: dict[str, Any], spec: PodSpec) -> dict[str, Any]:
    from whatif.simulate import SimConfig, simulate

    router = {"ttft_objective_ms": args.slo_ttft * 1000.0, **overrides}
    if cand.prefill:
        router["pd_decider"] = cand.decider
    cfg = SimConfig(policy=args.policy, admission=args.admission, objective_s=args.slo_ttft, slo_tpot=args.slo_tpot,
                    pods=cand.prefill + cand.decode, prefill=cand.prefill, spec=spec, router=router,
                    event_delay_s=args.event_delay_ms / 1000.0, label=cand.name)
    started = time.perf_counter()
    s = simulate(specs, offsets, cfg).summary
    n = max(int(s["requests"]), 1)
    return {"candidate": cand.name, "prefill": cand.prefill, "decode": cand.decode, "decider": cand.decider,
            "requests": s["requests"], "attainment": s["slo_attainment"],
            "rejected": (s["errors_by_status"] or {}).get("429", 0) / n, "hit_rate": s["hit_rate"],
            # over all requests sent (a rejection or failure at infinity), as attainment is
            "ttft_p50": s["ttft_p50_all"], "ttft_p99": s["ttft_p99_all"], "tpot_p50_ms": s["median_tpot_ms"],
            "tpot_p99_ms": s["p99_tpot_ms"], "routes": s.get("routes"),
            "wall_s": round(time.perf_counter() - started, 2)}


def choose(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return min(rows, key=lambda r: (-(r["attainment"] or 0.0), r["ttft_p99"] if r["ttft_p99"] is not None else 1e9))


def format_table(rows: list[dict[str, Any]], best: dict[str, Any], ttft: float, tpot: float | None) -> str:
    objective = f"TTFT <= {ttft * 1000:g} ms" + (f", TPOT <= {tpot * 1000:g} ms" if tpot is not None else "")
    lines = [f"| candidate | TTFT p50 (all sent) | TTFT p99 (all sent) | TPOT p50 | TPOT p99 | remote / local | "
             f"met {objective} |",
             "|---|---|---|---|---|---|---|"]

    def ms(v: float | None, scale: float = 1000.0) -> str:
        if v is not None and math.isinf(v):
            return "inf"
        return "-" if v is None else f"{v * scale:.0f} ms" if scale > 1 else f"{v:.1f} ms"

    for r in rows:
        routes = r.get("routes") or {}
        split = f"{routes.get('remote', 0)} / {routes.get('local', 0)}" if r["prefill"] else "-"
        mark = " **(chosen)**" if r is best else ""
        rej = f" ({100 * r['rejected']:.1f} % rejected)" if r["rejected"] else ""
        lines.append(f"| {r['candidate']}{mark} | {ms(r['ttft_p50'])} | {ms(r['ttft_p99'])} | "
                     f"{ms(r['tpot_p50_ms'], 1.0)} | {ms(r['tpot_p99_ms'], 1.0)} | {split} | "
                     f"{100 * (r['attainment'] or 0):.1f} %{rej} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvroute plan", description=__doc__.split("\n\n")[0] + " Simulates every "
                                "candidate (aggregated, each prefill:decode split) on the workload and recommends one.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_workload_arguments(p)
    add_pod_arguments(p)
    for action in p._actions:  # P/D is about batched decoding: cost timing, the P/D bench's pods
        if action.dest == "timing":
            action.default = "cost"
        elif action.dest == "block_size":
            action.default = 16
        elif action.dest == "num_gpu_blocks":
            action.default = 8192
        elif action.dest == "pods":
            action.default = 4
            action.help = "the pod budget: every candidate has this many pods"
    g = p.add_argument_group("candidates and objectives")
    g.add_argument("--slo-ttft", type=float, default=0.5, help="TTFT objective in seconds")
    g.add_argument("--slo-tpot", type=float, default=None, help="TPOT objective in seconds (none: TTFT only)")
    g.add_argument("--policy", default="predicted-ttft", help="routing policy of the aggregated candidate")
    g.add_argument("--admission", action="store_true", help="early rejection (429) in every candidate")
    g.add_argument("--decider", default="predicted",
                   help=f"P/D deciders to try, comma-separated ({', '.join(DECIDERS)})")
    g.add_argument("--splits", default="", help="P/D splits to try as p:d,p:d (empty: every split of --pods)")
    g.add_argument("--kv-bytes-per-token", type=int, default=131072, help="KV bytes per token moved prefill -> decode")
    g.add_argument("--link-bandwidth", type=float, default=25e9, help="prefill -> decode link, bytes per second")
    g.add_argument("--link-latency-ms", type=float, default=1.0, help="fixed latency of one KV transfer")
    g.add_argument("--event-delay-ms", type=float, default=0.0, help="KV events reach the router after this long")
    g.add_argument("--router", action="append", default=[], metavar="KEY=VALUE", help="a router setting; repeatable")
    g.add_argument("--json", action="store_true", help="print the candidates and the choice as JSON")
    return p


def parse_splits(text: str, pods: int) -> list[tuple[int, int]] | None:
    if not text.strip():
        return None
    out = []
    for item in text.split(","):
        p, sep, d = item.strip().partition(":")
        if not sep or not p.isdigit() or not d.isdigit() or int(p) < 1 or int(d) < 1:
            raise ValueError(f"--splits takes p:d pairs of positive counts, got {item!r}")
        if int(p) + int(d) != pods:
            raise ValueError(f"split {item} does not use the budget of {pods} pods")
        out.append((int(p), int(d)))
    return out


def main(argv: list[str] | None = None) -> int:
    import json
    from dataclasses import replace

    from replay.workloads import TraceError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        deciders = [d.strip() for d in args.decider.split(",") if d.strip()]
        bad = [d for d in deciders if d not in DECIDERS]
        if bad:
            raise ValueError(f"unknown P/D decider {bad[0]!r}; choose from {', '.join(DECIDERS)}")
        if not deciders:
            raise ValueError(f"--decider names no P/D decider (got {args.decider!r}); "
                             f"choose from {', '.join(DECIDERS)}")
        if args.pods < 2:
            raise ValueError("--pods must be at least 2 to compare aggregated with P/D")
        check_arguments(args)
        if args.policy not in AGGREGATED_POLICIES:
            raise ValueError(f"--policy {args.policy!r}: choose from {', '.join(AGGREGATED_POLICIES)} (oracle and "
                             "true-state run on aggregated fleets only; --admission adds early rejection)")
        splits = parse_splits(args.splits, args.pods)
        overrides = parse_router_overrides(args.router)
        specs, offsets, kind = build_requests(args)
    except (TraceError, ValueError) as exc:
        print(f"kvroute plan: error: {exc}", file=sys.stderr)
        return 2
    if not specs:
        print("kvroute plan: error: no request fits the limits (--duration/--max-requests)", file=sys.stderr)
        return 2
    spec = pod_spec(args)
    spec = replace(spec, kv_bytes_per_token=args.kv_bytes_per_token, link_bandwidth_bytes_per_s=args.link_bandwidth,
                   link_latency_s=args.link_latency_ms / 1000.0)
    print(f"planning {args.pods} {spec.timing} pods for {len(specs)} requests of {args.workload} over "
          f"{offsets[-1]:.1f} s ({kind} arrivals)", file=sys.stderr)
    rows = []
    for cand in candidates(args.pods, deciders, splits):
        try:
            rows.append(evaluate(specs, offsets, cand, args, overrides, spec))
        except ValueError as exc:
            print(f"kvroute plan: error: {exc}", file=sys.stderr)
            return 2
        r = rows[-1]
        print(f"  {r['candidate']:<28} met {100 * (r['attainment'] or 0):5.1f} %  ({r['wall_s']:.1f} s)",
              file=sys.stderr, flush=True)
    best = choose(rows)
    if args.json:
        print(json.dumps({"workload": args.workload, "requests": len(specs), "pods": args.pods,
                          "slo_ttft": args.slo_ttft, "slo_tpot": args.slo_tpot, "candidates": rows,
                          "choice": best["candidate"]}, indent=2))
    else:
        print(format_table(rows, best, args.slo_ttft, args.slo_tpot))
        print(f"\nrecommended: {best['candidate']} ({100 * (best['attainment'] or 0):.1f} % of requests met the "
              "objective)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
