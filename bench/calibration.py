"""How honest the predicted TTFT interval is, across worlds: the error model pooled per pod against
the same learnt per size of prediction (``ttft_error_by_size``), in simulated time.

Every row is ``kvroute simulate`` (the router's own decision code, calibration and admission, on
simulated pods; predicted-ttft with early rejection at the default ``admission_miss_probability``),
120 s of load, with the router's prediction log on (``prediction_log_path``). From the log, for
every request whose first token came: the share whose observed TTFT fell inside the predicted
``ttft_interval_level`` interval (0.9), below it and above it; the same for the requests predicted
near the objective (between half of it and all of it, the ones admission decides on); and the
median |ln(observed / predicted)|. Worlds: the seven of ``bench/routing_worlds.py`` and three of
``bench/admission_threshold.py``'s held-out ones.

    python bench/calibration.py [--duration 120] [--out bench/results/calibration.json]

The last line is the headline: per error model, the worlds whose coverage is within 5 points of
the nominal level, overall and near the objective.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import admission_threshold as at  # noqa: E402
from bench.provenance import stamp  # noqa: E402
from bench.routing_quality import simulated_row  # noqa: E402

HELD_OUT = ("cost timing at 12,500 tokens/s, 60 req/s", "2 pods at 25,000 and 6 at 15,000 tokens/s, prior 30,000",
            "Mooncake trace at 8 req/s")
MODELS = (("by size", True), ("pooled", False))
LEVEL = 0.9


def coverage(lines: list[dict], objective_s: float) -> dict:
    """Inside / below / above shares of the interval, overall and near the objective."""
    def shares(rows: list[dict]) -> dict:
        n = len(rows)
        if not n:
            return {"n": 0, "inside": None, "below": None, "above": None}
        below = sum(r["observed_s"] < r["low_s"] for r in rows)
        above = sum(r["high_s"] is not None and r["observed_s"] > r["high_s"] for r in rows)
        return {"n": n, "inside": (n - below - above) / n, "below": below / n, "above": above / n}

    errors = sorted(abs(math.log(r["observed_s"] / r["predicted_s"])) for r in lines
                    if r["observed_s"] > 0 and r["predicted_s"] > 0)
    near = [r for r in lines if objective_s / 2 <= r["predicted_s"] <= objective_s]
    return {"all": shares(lines), "near_objective": shares(near),
            "median_abs_log_error": errors[len(errors) // 2] if errors else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "calibration.json"))
    args = ap.parse_args(argv)
    rows = []
    started = time.monotonic()
    picked = [w for w in at.worlds() if not w[1] or w[0] in HELD_OUT]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, held_out, fleet, kind, rate, objective, seed) in enumerate(picked):
            specs, arrivals = at.load(kind, rate, seed, args.duration)
            for label, by_size in MODELS:
                path = Path(tmp) / f"{i}-{label.replace(' ', '-')}.jsonl"
                r = simulated_row(label, "predicted-ttft", True, specs, arrivals, fleet, objective, args.duration,
                                  {"ttft_error_by_size": by_size, "ttft_interval_level": LEVEL,
                                   "prediction_log_path": str(path)})
                lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
                cov = coverage(lines, objective)
                rows.append({"world": name, "held_out": held_out, "error_model": label, "met": r["slo_attainment"],
                             "admitted_late": r["admitted_late"], "rejected": r["rejected"], **cov})
                a, near = cov["all"], cov["near_objective"]
                near_txt = f"{100 * near['inside']:5.1f} % of {near['n']}" if near["n"] else "  none"
                all_txt = (f"{100 * a['inside']:5.1f} % (below {100 * a['below']:4.1f}, above {100 * a['above']:4.1f})"
                           if a["n"] else "  none (no first token)")
                err = cov["median_abs_log_error"]
                print(f"{name:<58} {label:<8} inside {all_txt}  near the objective {near_txt}  median |ln err| "
                      f"{'—' if err is None else f'{err:.3f}'}  met {100 * r['slo_attainment']:5.1f} %  late "
                      f"{100 * (r['admitted_late'] or 0):4.1f} %", flush=True)
    Path(args.out).write_text(json.dumps({**stamp("calibration.py", argv), "duration_s": args.duration, "level": LEVEL,
                                          "rows": rows}, indent=2))
    print(f"({time.monotonic() - started:.0f} s)")
    heads = []
    for label, _ in MODELS:
        mine = [r for r in rows if r["error_model"] == label]
        ok = sum(r["all"]["n"] > 0 and abs(r["all"]["inside"] - LEVEL) <= 0.05 for r in mine)
        near = [r for r in mine if r["near_objective"]["n"]]
        ok_near = sum(abs(r["near_objective"]["inside"] - LEVEL) <= 0.05 for r in near)
        heads.append(f"{label}: within 5 points of {LEVEL:.0%} in {ok}/{len(mine)} worlds, near the objective "
                     f"{ok_near}/{len(near)}")
    print("interval coverage: " + "; ".join(heads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
