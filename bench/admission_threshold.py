"""The early-rejection threshold across worlds, in simulated time: ``admission_miss_probability``
(reject when on every pod the probability of missing the objective is above it) at several values,
on the seven worlds of ``bench/routing_worlds.py`` and on nine held-out worlds the default was not
chosen on (other rates, objectives, speeds, priors, seeds and arrival patterns).

Every row is ``kvroute simulate`` (the router's own decision code, calibration and admission, on
simulated pods in simulated time), predicted-ttft with early rejection, 120 s of load; attainment
is over all requests sent (a rejection is a miss).

    python bench/admission_threshold.py [--values 0.5,0.25,0.1,0.05] [--set ttft_error_by_size=false]
                                        [--out bench/results/admission_threshold.json]

The last line printed is the headline: per value, the mean attainment over all worlds and the
number of worlds where it is at least as good as the first value's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import routing_worlds as rw  # noqa: E402
from bench.provenance import stamp  # noqa: E402
from bench.routing_quality import simulated_row  # noqa: E402
from fleet.trial import FleetSpec  # noqa: E402
from replay.arrivals import gamma  # noqa: E402

# (name, fleet, workload, rate, objective s, workload seed); the routing worlds' own come first
HELD_OUT = [
    ("seed timing, 50 req/s, other sessions", FleetSpec(), "multiturn", 50.0, 2.0, 1),
    ("seed timing, 90 req/s, other sessions", FleetSpec(), "multiturn", 90.0, 2.0, 1),
    ("seed timing, 70 req/s, objective 1 s", FleetSpec(), "multiturn", 70.0, 1.0, 1),
    ("cost timing at 12,500 tokens/s, 60 req/s", FleetSpec(timing="cost", compute_s_per_token=8e-5),
     "multiturn", 60.0, 2.0, 1),
    ("cost timing at 25,000 tokens/s, 90 req/s", FleetSpec(timing="cost", compute_s_per_token=4e-5),
     "multiturn", 90.0, 2.0, 1),
    ("2 pods at 25,000 and 6 at 15,000 tokens/s, prior 30,000",
     FleetSpec(prefill_tokens_per_s=25000.0, slowdowns=(1.0, 1.0) + (25 / 15,) * 6, prior=30000.0),
     "multiturn", 70.0, 2.0, 1),
    ("Mooncake trace at 8 req/s", FleetSpec(), "mooncake", 8.0, 2.0, 1),
    ("Mooncake trace at 16 req/s", FleetSpec(), "mooncake", 16.0, 2.0, 1),
    ("cost timing, bursts (gamma gaps, CV 3), 50 req/s", FleetSpec(timing="cost", compute_s_per_token=6e-5),
     "bursty", 50.0, 2.0, 1),
]


def worlds() -> list[tuple[str, bool, FleetSpec, str, float, float, int]]:
    """(name, held out, fleet, workload, rate, objective, seed) for every world."""
    out = [(w.name, False, w.fleet, w.workload, rw.MOONCAKE_RATE if w.workload == "mooncake" else rw.RATE,
            rw.OBJECTIVE_S, 0) for w in rw.WORLDS]
    return out + [(name, True, *rest) for name, *rest in HELD_OUT]  # type: ignore[misc]


def load(kind: str, rate: float, seed: int, duration: float) -> tuple[list, list[float]]:
    saved = rw.RATE, rw.MOONCAKE_RATE
    rw.RATE = rw.MOONCAKE_RATE = rate
    try:
        specs, arrivals, _ = rw.workload(kind, duration, seed)
    finally:
        rw.RATE, rw.MOONCAKE_RATE = saved
    if kind == "bursty" and seed != 0:  # held out: burstier than the routing worlds' CV 2
        arrivals = gamma(len(specs), rate, burstiness=1 / 9, seed=seed + 1)
    return specs, arrivals


def table(rows: list[dict]) -> str:
    """Met / admitted and late over all requests sent, a world a line and a value a column, then the mean."""
    values = list(dict.fromkeys(r["value"] for r in rows))
    names = list(dict.fromkeys(r["world"] for r in rows))
    at = {(r["world"], r["value"]): r for r in rows}
    held = {r["world"]: r["held_out"] for r in rows}
    lines = ["| world | " + " | ".join(f"{v:g}" for v in values) + " |", "|---|" + "---|" * len(values)]
    for w in names:
        cells = [f"{100 * at[(w, v)]['met']:.1f} % / {100 * (at[(w, v)]['admitted_late'] or 0):.1f} %" for v in values]
        lines.append(f"| {w}{' (held out)' if held[w] else ''} | " + " | ".join(cells) + " |")
    means = []
    for v in values:
        met = sum(at[(w, v)]["met"] for w in names) / len(names)
        late = sum(at[(w, v)]["admitted_late"] or 0 for w in names) / len(names)
        means.append(f"**{100 * met:.1f} %** / {100 * late:.2f} %")
    lines.append(f"| **mean of the {len(names)}** | " + " | ".join(means) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--values", default="0.5,0.25,0.1,0.05",
                    help="admission_miss_probability values (first: the reference)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a router setting for every row (a JSON value, else a string); repeatable")
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "admission_threshold.json"))
    ap.add_argument("--print", action="store_true", help="run nothing: print the table of --out (for the docs)")
    args = ap.parse_args(argv)
    if args.print:
        print(table(json.loads(Path(args.out).read_text())["rows"]))
        return 0
    values = [float(v) for v in args.values.split(",") if v.strip()]
    fixed: dict = {}
    for item in args.set:
        key, _, raw = item.partition("=")
        try:
            fixed[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            fixed[key.strip()] = raw
    rows = []
    started = time.monotonic()
    for name, held_out, fleet, kind, rate, objective, seed in worlds():
        specs, arrivals = load(kind, rate, seed, args.duration)
        for v in values:
            r = simulated_row(f"miss probability {v:g}", "predicted-ttft", True, specs, arrivals, fleet, objective,
                              args.duration, {**fixed, "admission_miss_probability": v})
            rows.append({"world": name, "held_out": held_out, "value": v, "rate": rate, "objective_s": objective,
                         "met": r["slo_attainment"], "rejected": r["rejected"], "admitted_late": r["admitted_late"],
                         "requests": r["requests"]})
            print(f"{name:<58} {v:<5g} met {100 * r['slo_attainment']:5.1f} %  rejected {100 * r['rejected']:4.1f} %"
                  f"  late {100 * (r['admitted_late'] or 0):4.1f} %", flush=True)
    Path(args.out).write_text(json.dumps({**stamp("admission_threshold.py", argv), "duration_s": args.duration,
                                          "settings": fixed,
                                          "rows": rows}, indent=2))
    names = list(dict.fromkeys(r["world"] for r in rows))
    met = {(r["world"], r["value"]): r["met"] for r in rows}
    heads = []
    for v in values:
        mean = sum(met[(w, v)] for w in names) / len(names)
        as_good = sum(met[(w, v)] >= met[(w, values[0])] - 1e-9 for w in names)
        worst = min(met[(w, v)] - met[(w, values[0])] for w in names)
        heads.append(f"{v:g}: mean met {100 * mean:.1f} %, at least as good as {values[0]:g} in {as_good}/{len(names)} "
                     f"worlds (worst {100 * worst:+.1f} points)")
    print(f"({time.monotonic() - started:.0f} s)")
    print("admission_miss_probability over " + f"{len(names)} worlds: " + "; ".join(heads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
