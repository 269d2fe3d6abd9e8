"""Data-parallel pods: routing to each engine (X-data-parallel-rank) against leaving it to vLLM.

Two simulated pods with four data-parallel engines each (``kvroute sim --data-parallel-size 4``:
one HTTP server per pod, an own cache, queue and event stream per engine, and without the header
vLLM's balancer, which ignores the cache), ``seed`` timing; eight engines in all, as the eight pods
of bench/routing_quality.py. The workload is that benchmark's multi-turn chat (400 sessions on 20
shared 2,048-token system prompts, 300 new tokens a turn, Poisson arrivals, token-id prompts,
streaming, open loop); every row replays the same requests at the same times against a fresh fleet.
Rows: kvroute with one candidate per engine (``data_parallel_steering``, the default), kvroute with
one candidate per pod (steering off: the pod's own balancer picks the engine), and round-robin over
the pods. The TTFT objective counts over all requests sent (a rejection is a miss); hit rate is the
engines' own prefix-cache counters.

    python bench/data_parallel.py [--rate 40] [--duration 60] [--json bench/results/data_parallel.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import stamp  # noqa: E402
from fleet.trial import FleetSpec, Target, format_rows, row, run_trial  # noqa: E402
from replay.arrivals import poisson  # noqa: E402
from replay.workloads import multiturn  # noqa: E402

TARGETS = [
    ("steer", Target("kvroute predicted-ttft, one candidate per engine (X-data-parallel-rank)")),
    ("pod", Target("kvroute predicted-ttft, one candidate per pod (vLLM balances the engines)",
                   extra={"data_parallel_steering": False})),
    ("rr", Target("kvroute round-robin over pods (vLLM balances the engines)", policy="round-robin",
                  extra={"data_parallel_steering": False})),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=40.0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--objective", type=float, default=2.0)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--pods", type=int, default=2)
    ap.add_argument("--targets", default="steer,pod,rr")
    ap.add_argument("--drain", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/data_parallel")
    ap.add_argument("--json", default="", help="also write the rows here (e.g. bench/results/data_parallel.json)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fleet = FleetSpec(pods=args.pods, data_parallel_size=args.ranks)
    n = int(args.rate * args.duration)
    turns = max(2, -(-n // 400))
    specs = multiturn(system_prompts=20, system_prompt_len=2048, sessions=400, turns=turns, turn_tokens=300,
                      output_len=4, seed=args.seed)
    arrivals = poisson(len(specs), args.rate, seed=args.seed + 1)
    wanted = [t.strip() for t in args.targets.split(",") if t.strip()]
    rows = []
    for key, target in TARGETS:
        if key not in wanted:
            continue
        started = time.monotonic()
        r = row(run_trial(target, specs, arrivals, fleet=fleet, objective_s=args.objective, duration=args.duration,
                          workdir=out / "logs", drain_timeout=args.drain))
        r["wall_s"] = round(time.monotonic() - started, 1)
        rows.append(r)
        if r.get("error"):
            print(f"  {target.name:<78} not run: {r['error']}", flush=True)
        else:
            print(f"  {target.name:<78} met {r['slo_attainment'] * 100:5.1f} %  hit {100 * (r['hit_rate'] or 0):5.1f} %"
                  f"  p50 {r['ttft_p50'] or 0:6.2f} s  p99 {r['ttft_p99'] or 0:6.2f} s  errors {r['errors']}"
                  f"  ({r['wall_s']:.0f} s)", flush=True)
        result = {**stamp("data_parallel.py", argv), "pods": args.pods, "ranks": args.ranks, "rate": args.rate,
                  "duration_s": args.duration,
                  "objective_s": args.objective, "requests": n, "rows": rows}
        (out / "data_parallel.json").write_text(json.dumps(result, indent=2, default=str))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print()
    print(format_rows(rows, args.objective))
    ok = [r for r in rows if not r.get("error")]
    if ok:
        best = max(ok, key=lambda r: r["slo_attainment"] or 0)
        print(f"\n{args.pods} pods x {args.ranks} data-parallel engines, {args.rate:g} req/s: best "
              f"{best['router']}: {best['slo_attainment'] * 100:.1f} % met, "
              f"hit rate {100 * (best['hit_rate'] or 0):.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
