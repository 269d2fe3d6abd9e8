"""Throughput and CPU per request, one router setting against another, in alternating rounds.

``bench/overhead.py`` measures each target once per size, and one 3 s round of the same tree moves
by up to 10 % on the 2-core build machine. To tell whether a change or a setting pays, this runs
the same measurement as its rows (``--connections`` connections of multi-turn requests of about
``--size`` tokens with the real-vLLM tier's tokenizer, against its static backend) in rounds, each
condition with a fresh ``kvroute serve`` per round, the conditions alternating, and reports each
round's requests per second and the CPU time the router's processes (workers and tokenize
processes included) spent per request, with their medians.

    python bench/throughput_rounds.py --condition bus: --condition no-bus:KVROUTE_BOOKING_BUS=false \\
        --workers 2 --rounds 3 --json bench/results/throughput_rounds_bus.json

A condition is ``NAME[@TREE]:ENV=VALUE,ENV=VALUE`` as in ``bench/cold_beside_small.py``; ``--workers``
and ``--size`` hold for all of them. A round that sends more requests than the list holds (long
``--seconds`` at large sizes) repeats prompts whose caches are warm: it is warned of and marked
``repeated`` in the JSON. The last line is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import overhead as ov  # noqa: E402
from bench.cold_beside_small import parse_condition, start_router, tokenizer  # noqa: E402
from bench.provenance import commit, stamp  # noqa: E402
from simulator.testing import stop_process  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--condition", action="append", required=True, help="NAME[@TREE]:ENV=VALUE,... (twice or more)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=1, help="kvroute serve --workers for every condition")
    ap.add_argument("--seconds", type=float, default=5.0, help="the timed part of each round")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--size", type=int, default=20, help="prompt tokens (as bench/overhead.py --sizes)")
    ap.add_argument("--kind", default="chat", choices=["chat", "completion"])
    ap.add_argument("--tokenizer", default=None, help="default: the real-vLLM tier's model")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    conditions = [parse_condition(c) for c in args.condition]
    folder, tok = tokenizer(args.tokenizer)
    gap = ov.follow_up_gap(args.connections)
    requests, mean = ov.chat_requests(tok, args.size, count=ov.distinct_count(args.size), kind=args.kind, sample=100,
                                      gap=gap, conversations=gap + 36)
    print(f"{len(requests)} distinct {args.kind} requests of {mean:.0f} tokens on average; {args.workers} worker(s), "
          f"{args.connections} connections, {args.rounds} rounds of {args.seconds:.0f} s", flush=True)
    procs: list = []
    results: dict[str, dict] = {name: {"tree": tree, "commit": commit(tree), "env": env, "rounds": []}
                                for name, tree, env in conditions}
    asyncio.set_event_loop_policy(__import__("uvloop").EventLoopPolicy())
    try:
        _, upstream = ov.start_backend(procs)
        pods = json.dumps([{"id": "pod-0", "url": upstream, "model": "sim-model"}])
        for r in range(args.rounds):
            for name, tree, env in conditions:
                port, proc = start_router(tree, {**os.environ, "PYTHONUNBUFFERED": "1", **env}, pods, args.workers,
                                          folder)
                try:
                    cursor = itertools.count()
                    asyncio.run(ov.load(port, args.connections, 1.0, requests=requests, cursor=cursor))  # warm
                    m = asyncio.run(ov.load(port, args.connections, args.seconds, requests=requests, cursor=cursor,
                                            pids=[proc.pid]))
                finally:
                    stop_process(proc)
                row = {"rps": m["rps"], "cpu_us_per_request": m["cpu_us_per_request"], "p99_ms": m["p99_ms"],
                       "errors": m["errors"], "sent": next(cursor)}
                row["repeated"] = ov.warn_if_repeated(f"round {r} {name}", row["sent"], len(requests))
                results[name]["rounds"].append(row)
                print(f"round {r} {name:<12} {m['rps']:.0f} req/s, {m['cpu_us_per_request']:.0f} us CPU a request, "
                      f"p99 {m['p99_ms']:.1f} ms, errors {m['errors']}", flush=True)
    finally:
        for p in procs:
            stop_process(p)
    for name, got in results.items():
        got["median_rps"] = statistics.median(x["rps"] for x in got["rounds"])
        got["median_cpu_us_per_request"] = statistics.median(x["cpu_us_per_request"] for x in got["rounds"])
        rates = ", ".join(f"{x['rps']:.0f}" for x in got["rounds"])
        cpus = ", ".join(f"{x['cpu_us_per_request']:.0f}" for x in got["rounds"])
        print(f"{name:<12} req/s by round {rates}; CPU a request {cpus} us")
    if args.json:
        out = {**stamp("throughput_rounds.py"), "size": args.size, "kind": args.kind, "mean_prompt_tokens": mean,
               "workers": args.workers, "connections": args.connections, "seconds": args.seconds,
               "rounds": args.rounds, "cpus": os.cpu_count(), "conditions": results}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"{args.kind} {mean:.0f} tokens, {args.workers} worker(s), medians: " +
          "; ".join(f"{name} {got['median_rps']:.0f} req/s at {got['median_cpu_us_per_request']:.0f} us CPU a request"
                    for name, got in results.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
