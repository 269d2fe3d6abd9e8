"""Routing quality with several router processes: one process against ``--workers 2`` and against
two replicas (two ``kvroute serve`` processes, the load sent to them in turn), each with and without
the booking bus (router/bookbus.py), on the seed workload of bench/routing_quality.py.

Same fleet (8 simulated pods, ``seed`` timing, real KV events), same workload (400 chat sessions on
20 shared 2,048-token system prompts, 300 new tokens a turn, Poisson arrivals, token-id prompts,
streaming, open loop) and the same request sequence at the same times for every row; each row gets
a fresh fleet. The TTFT objective (2 s) counts over all requests sent (a rejection is a miss).

    python bench/workers_quality.py [--rate 70] [--duration 60] [--policies admission,plain] [--no-events]

``--no-events``: the router is given the pods without their KV event endpoints, so it knows their
caches only from the credits of the prompts routed there (shared over the booking bus unless
``booking_bus_credits`` is off: the rows "without credits").
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

# (label, kvroute settings, replicas). Workers share one port (the kernel spreads connections over
# them); replicas each have their own, bind a booking-bus port and subscribe to the other's, and the
# load generator sends request i to replica i % 2, so a conversation's turns land on both.
SETUPS = [("1 process", {}, 1), ("2 workers, booking bus", {"workers": 2}, 1),
          ("2 workers, no bus", {"workers": 2, "booking_bus": False}, 1),
          ("2 workers, booking bus without credits", {"workers": 2, "booking_bus_credits": False}, 1),
          ("2 replicas, booking bus", {}, 2), ("2 replicas, no bus", {"booking_bus": False}, 2),
          ("2 replicas, booking bus without credits", {"booking_bus_credits": False}, 2)]
POLICIES = {"admission": ("predicted-ttft + early rejection", True), "plain": ("predicted-ttft", False)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=70.0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--objective", type=float, default=2.0)
    ap.add_argument("--policies", default="admission,plain", help="admission (predicted-ttft + early rejection), "
                    "plain (predicted-ttft)")
    ap.add_argument("--setups", default="", help="comma-separated substrings of the setups to run (default: all)")
    ap.add_argument("--drain", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/workers_quality")
    ap.add_argument("--json", default="", help="also write the rows here (e.g. bench/results/...json)")
    ap.add_argument("--no-events", action="store_true", help="the pods without their KV event endpoints")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fleet = FleetSpec()
    n = int(args.rate * args.duration)
    turns = max(2, -(-n // 400))
    specs = multiturn(system_prompts=20, system_prompt_len=2048, sessions=400, turns=turns, turn_tokens=300,
                      output_len=4, seed=args.seed)
    arrivals = poisson(len(specs), args.rate, seed=args.seed + 1)
    picked = [s.strip() for s in args.setups.split(",") if s.strip()]
    rows = []
    for key in [p.strip() for p in args.policies.split(",") if p.strip()]:
        label, admission = POLICIES[key]
        for setup, extra, replicas in SETUPS:
            if picked and not any(p in setup for p in picked):
                continue
            t = Target(f"kvroute {label}, {setup}" + (", pods without KV events" if args.no_events else ""),
                       policy="predicted-ttft", admission=admission, extra=extra, replicas=replicas,
                       kv_events=not args.no_events)
            started = time.monotonic()
            r = row(run_trial(t, specs, arrivals, fleet=fleet, objective_s=args.objective, duration=args.duration,
                              workdir=out / "logs", drain_timeout=args.drain))
            r["wall_s"] = round(time.monotonic() - started, 1)
            rows.append(r)
            if r.get("error"):
                print(f"  {t.name:<62} not run: {r['error']}", flush=True)
            else:
                print(f"  {t.name:<62} met {r['slo_attainment'] * 100:5.1f} %  rejected {r['rejected'] * 100:4.1f} %  "
                      f"hit {100 * (r['hit_rate'] or 0):5.1f} %  p50 {r['ttft_p50'] or 0:6.2f} s  "
                      f"p99 {r['ttft_p99'] or 0:6.2f} s  errors {r['errors']}  ({r['wall_s']:.0f} s)", flush=True)
            result = {**stamp("workers_quality.py", argv), "rate": args.rate, "duration_s": args.duration,
                      "objective_s": args.objective, "requests": n, "rows": rows}
            (out / "workers_quality.json").write_text(json.dumps(result, indent=2, default=str))
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print()
    print(format_rows(rows, args.objective))
    return 0


if __name__ == "__main__":
    sys.exit(main())
