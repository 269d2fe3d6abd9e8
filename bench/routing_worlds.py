"""Routing quality across worlds kvroute was not tuned on: other timing models, other pod speeds,
wrong priors, other workloads. kvroute and the peers in the same run, on the same requests, with
the perfect-knowledge row simulated on those requests in the same world.

Every world is 8 simulated pods (real HTTP, real KV events over ZeroMQ) and a TTFT objective of
2 s counted over ALL requests sent (a rejection is a miss at infinity). The worlds:

* ``seed``: the seed's pods (one FIFO prefill server at 20,000 tokens/s), kvroute's prior right;
* ``cost``: batched engines (the simulator's ``cost`` timing: steps with a token budget, chunked
  prefill sharing steps with running decodes, a 4 ms step overhead) at 16,700 tokens/s of compute,
  kvroute's prior left at its default (20,000);
* ``heterogeneous``: 4 pods at 30,000 and 4 at 10,000 tokens/s (seed timing), prior 20,000;
* ``prior-x0.5`` / ``prior-x2``: the seed's pods, kvroute told 10,000 / 40,000 tokens/s;
* ``bursty``: the seed's pods, the same sessions arriving in bursts (gamma gaps, shape 0.25: a
  coefficient of variation of 2 where Poisson has 1);
* ``mooncake``: the seed's pods, the first requests of the Mooncake conversation trace
  (``data/conversation_trace.jsonl``, 12k-token prompts on average) at 12 requests/s, Poisson.

Rows: kvroute (predicted-ttft + early rejection) and the peers live; then, on the same requests in
simulated time (``kvroute simulate``, the router's own decision code), kvroute without and with
admission, kvroute without and with admission under the experimental relative calibration fit
(``calibration_fit: relative``, not the default), the perfect-knowledge oracle without and with
rejection, and kvroute's decision code on the pods' true state (``true-state``). The oracle knows
every pod's true queue and cache; its TTFT is exact in seed timing, and in cost timing exact for the
state at the decision (``whatif.podmodel.PodModel.true_ttft`` steps a copy of the pod forward) but
blind to later arrivals, which lengthen the step that gives the first token. It is greedy, so not
an upper bound. The true-state row is kvroute's scorers, error model and admission with each pod's
point prediction replaced by that true TTFT: what a perfect model of the present would give
kvroute, its error model learning only what later arrivals add. The headline's reference is the
best of the three.

The multi-turn worlds replay the seed workload (400 chat sessions on 20 shared 2,048-token system
prompts, 300 new tokens a turn) at 70 requests/s. Tunables are fixed here, before any run, and the
same in every world: kvroute's defaults (policy predicted-ttft, calibration on, admission by miss
probability 0.1), rates and durations as above, 120 s of load per row (with 60 s, kvroute's
simulated twin met every multi-turn world in full: the caches had not yet filled). Peers run from their own venv,
pinned and printed:

    python3 -m venv /tmp/peers-venv && /tmp/peers-venv/bin/pip install vllm-router==0.1.17 sglang-router==0.3.2
    python bench/routing_worlds.py [--worlds seed,cost,...] [--duration 60] [--out bench/results/routing_worlds.json]

vllm-router's ``kv_aware`` is not a row: see docs/router.md (Measured) for why. The last line is the
headline: per world, kvroute's best row against the simulated oracle and the best peer.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRUE_STATE = "kvroute's decision code on the pods' true state + early rejection (simulated)"
sys.path.insert(0, str(ROOT))

from bench.provenance import check_peer, commit  # noqa: E402
from bench.routing_quality import ORACLE, simulated_row  # noqa: E402
from fleet.trial import FleetSpec, Target, format_rows, row, run_trial  # noqa: E402
from replay.arrivals import cut, gamma, poisson  # noqa: E402
from replay.workloads import limit_input_len, mooncake, multiturn  # noqa: E402

OBJECTIVE_S = 2.0
RATE = 70.0
MOONCAKE_RATE = 12.0
TARGETS = [
    Target("kvroute predicted-ttft + early rejection", policy="predicted-ttft", admission=True),
    Target("vllm-router cache_aware (token ids)", kind="vllm-router", policy="cache_aware"),
    Target("sglang-router cache_aware (text prompts)", kind="sglang-router", policy="cache_aware", endpoint="chat"),
]
PEER_PACKAGES = ("vllm-router", "sglang-router")


@dataclass(frozen=True)
class World:
    name: str
    what: str
    fleet: FleetSpec
    workload: str = "multiturn"   # multiturn, bursty or mooncake


WORLDS = [
    World("seed", "seed timing, 20,000 tokens/s, prior right", FleetSpec()),
    World("cost", "cost timing (batched steps), 16,700 tokens/s of compute, prior left at 20,000",
          FleetSpec(timing="cost", compute_s_per_token=6e-5)),
    World("heterogeneous", "4 pods at 30,000 and 4 at 10,000 tokens/s, prior 20,000",
          FleetSpec(prefill_tokens_per_s=30000.0, slowdowns=(1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0), prior=20000.0)),
    World("prior-x0.5", "seed timing, prior 10,000 (half the true rate)", FleetSpec(prior=10000.0)),
    World("prior-x2", "seed timing, prior 40,000 (twice the true rate)", FleetSpec(prior=40000.0)),
    World("bursty", "seed timing, the sessions in bursts (gamma gaps, CV 2)", FleetSpec(), "bursty"),
    World("mooncake", "seed timing, Mooncake conversation trace at 12 req/s", FleetSpec(), "mooncake"),
]


def workload(kind: str, duration: float, seed: int) -> tuple[list, list[float], float]:
    """(requests, arrival times, rate) for a world's workload."""
    if kind == "mooncake":
        n = int(MOONCAKE_RATE * duration) + 50
        specs = limit_input_len(mooncake(ROOT / "data" / "conversation_trace.jsonl", seed=seed)[:n], 120_000)
        return specs, poisson(len(specs), MOONCAKE_RATE, seed=seed + 1), MOONCAKE_RATE
    n = int(RATE * duration)
    turns = max(2, -(-n // 400))
    specs = multiturn(system_prompts=20, system_prompt_len=2048, sessions=400, turns=turns, turn_tokens=300,
                      output_len=4, seed=seed)
    if kind == "bursty":
        return specs, gamma(len(specs), RATE, burstiness=0.25, seed=seed + 1), RATE
    return specs, poisson(len(specs), RATE, seed=seed + 1), RATE


def peer_versions(venv: Path) -> dict[str, str]:
    out = {}
    for pkg in PEER_PACKAGES:
        code = f"import importlib.metadata as m; print(m.version('{pkg}'))"
        r = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True)
        out[pkg] = r.stdout.strip() or "not installed"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default=",".join(w.name for w in WORLDS))
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of load per row (default 120)")
    ap.add_argument("--drain", type=float, default=30.0, help="seconds to wait for stragglers after the load")
    ap.add_argument("--peers-venv", default="/tmp/peers-venv")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "routing_worlds.json"))
    ap.add_argument("--logs", default="results/routing_worlds", help="folder for the routers' logs")
    ap.add_argument("--merge", action="store_true",
                    help="keep what --out already holds except what this run measures again")
    ap.add_argument("--only", default="", help="comma-separated substrings: run only the matching live rows")
    ap.add_argument("--simulated-only", action="store_true", help="run no live rows (with --merge: keep them)")
    ap.add_argument("--live-only", action="store_true",
                    help="run no simulated rows (with --merge: keep them), e.g. to repeat a live row")
    ap.add_argument("--print", action="store_true", help="run nothing: print the tables of --out (for the docs)")
    args = ap.parse_args(argv)
    if args.print:
        saved = json.loads(Path(args.out).read_text())
        for name, w in saved["worlds"].items():
            print(f"\n**{name}**: {w['what']}; {w['rate']:g} req/s, {w['requests']} requests\n")
            print(format_rows(w["rows"], saved["config"]["objective_s"]))
        return 0
    chosen = [w for w in WORLDS if w.name in args.worlds.split(",")]
    keys = [k for k in args.only.split(",") if k]
    targets = [t for t in TARGETS if not (args.no_peers and t.kind != "kvroute") and not args.simulated_only
               and (not keys or any(k in t.name for k in keys))]
    versions = peer_versions(Path(args.peers_venv))
    print("peers: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + f" (from {args.peers_venv})", flush=True)
    for pkg, version in versions.items():
        check_peer(pkg, version)
    out: dict[str, Any] = {"config": {"command": "python bench/routing_worlds.py " + " ".join(argv or sys.argv[1:]),
                                      "commit": commit(),
                                      "objective_s": OBJECTIVE_S, "duration_s": args.duration, "rate": RATE,
                                      "mooncake_rate": MOONCAKE_RATE, "seed": args.seed, "peers": versions,
                                      "kvroute": "defaults (policy predicted-ttft, calibration on)"},
                           "worlds": {}}
    earlier: dict[str, Any] = {}
    if args.merge and Path(args.out).exists():
        before = json.loads(Path(args.out).read_text())
        earlier = before.get("worlds", {})
        out["worlds"] = dict(earlier)
        out["config"]["earlier_commands"] = [*before["config"].get("earlier_commands", []), before["config"]["command"]]
        out["config"]["earlier_commits"] = [*before["config"].get("earlier_commits", []),
                                            before["config"].get("commit")]
    headline = []
    for world in chosen:
        specs, arrivals, rate = workload(world.workload, args.duration, args.seed)
        n = cut(arrivals, duration=args.duration)
        print(f"\n## {world.name}: {world.what}; {rate:g} req/s for {args.duration:g} s ({n} requests)", flush=True)
        rows = []
        kept = {r["router"]: r for r in earlier.get(world.name, {}).get("rows", []) if not r.get("simulated")}
        for t in TARGETS:   # live rows in one order: measured now, or kept from --out
            if t not in targets:
                if t.name in kept:
                    rows.append(kept[t.name])
                continue
            started = time.monotonic()
            res = run_trial(t, specs, arrivals, fleet=world.fleet, objective_s=OBJECTIVE_S, duration=args.duration,
                            peers_venv=args.peers_venv, workdir=Path(args.logs) / world.name, drain_timeout=args.drain)
            r = {**row(res), "command": out["config"]["command"], "commit": out["config"]["commit"]}
            rows.append(r)
            shown = r.get("error") or (
                f"met {r['slo_attainment'] * 100:5.1f} %  rejected {r['rejected'] * 100:4.1f} %  "
                f"late {100 * (r.get('admitted_late') or 0):4.1f} %  hit {100 * (r['hit_rate'] or 0):5.1f} %")
            print(f"  {t.name:<46} {shown}  ({time.monotonic() - started:.0f} s)", flush=True)
        if any(t not in targets for t in TARGETS if t.name in kept) and any(t in targets for t in TARGETS):
            print("  WARNING: live rows kept from an earlier run beside rows measured now: the peers and kvroute "
                  "are not all from the same run", flush=True)
        # kvroute's decision code in simulated time on the same requests (its twin, without the machine's
        # noise), without and with admission, then the perfect-knowledge row
        relative = {"calibration_fit": "relative"}
        twins = [("kvroute predicted-ttft (simulated)", "predicted-ttft", False, None),
                 ("kvroute predicted-ttft + early rejection (simulated)", "predicted-ttft", True, None),
                 ("kvroute, relative calibration fit (simulated)", "predicted-ttft", False, relative),
                 ("kvroute, relative calibration fit, + early rejection (simulated)", "predicted-ttft", True, relative),
                 ("perfect knowledge (simulated: min true TTFT), no rejection", "oracle", False, None),
                 (ORACLE, "oracle", True, None),
                 (TRUE_STATE, "true-state", True, None)]
        if args.live_only:
            twins = []
            rows += [r for r in earlier.get(world.name, {}).get("rows", []) if r.get("simulated")]
        for name, policy, admission, router in twins:
            sim = simulated_row(name, policy, admission, specs, arrivals, world.fleet, OBJECTIVE_S, args.duration,
                                router)
            rows.append(sim)
            print(f"  {name:<46} met {sim['slo_attainment'] * 100:5.1f} %  "
                  f"rejected {sim['rejected'] * 100:4.1f} %  late {100 * (sim.get('admitted_late') or 0):4.1f} %  "
                  f"({sim['wall_s']:.0f} s, simulated)", flush=True)
        oracles = [r for r in rows if r["router"].startswith("perfect knowledge") or r["router"] == TRUE_STATE]
        oracle = max(oracles, key=lambda r: r["slo_attainment"]) if oracles else None  # the best perfect-knowledge row
        print()
        print(format_rows(rows, OBJECTIVE_S))
        out["worlds"][world.name] = {"what": world.what, "fleet": asdict(world.fleet), "rate": rate, "requests": n,
                                     "rows": rows}
        Path(args.out).write_text(json.dumps(out, indent=2, default=str))
        ours = [r for r in rows if r["router"].startswith("kvroute") and not r.get("simulated") and not r.get("error")]
        peers = [r for r in rows if not r["router"].startswith("kvroute") and not r.get("simulated")
                 and not r.get("error")]
        best = max(ours, key=lambda r: r["slo_attainment"]) if ours else None
        best_peer = max(peers, key=lambda r: r["slo_attainment"]) if peers else None
        peer = "—" if best_peer is None else f"{best_peer['slo_attainment'] * 100:.1f} %"
        if best:
            bound = "—" if oracle is None else f"{oracle['slo_attainment'] * 100:.1f} %"
            headline.append(f"{world.name} {best['slo_attainment'] * 100:.1f} % (oracle {bound}, best peer {peer})")
    print("\nkvroute's best row, met the 2 s objective over all requests sent: " + "; ".join(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
