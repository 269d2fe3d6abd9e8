"""P/D benchmark: the deciders and vLLM's router in its NIXL P/D mode over the same simulated fleet.

Each trial starts a fresh fleet of 2 prefill + 2 decode simulated pods (one ``kvroute sim --count 4``
process, cost timing: steps, chunked prefill, decode slowed by batch and KV, NIXL reads over a
simulated 25 GB/s link), then the router under test:

* ``kvroute`` with ``--pd-decider always|prefix|predicted``, a ``kvroute sidecar`` beside each
  decode pod (the router sends to the sidecar, which runs the prefill leg on the named prefill
  pod and the decode leg on its pod);
* ``vllm-router --vllm-pd-disaggregation --kv-connector nixl`` (vLLM's Rust router, installed from
  PyPI into a separate venv, default ``/tmp/peers-venv``), which runs both legs itself.

Every target gets the same request sequence at the same arrival times (``replay.runner.run``),
multi-turn chat sessions and a slice of the Mooncake conversation trace, and is scored on TTFT
p50/p99 over all requests sent (a failed request never got a first token: at infinity), TPOT
p50/p99 over the answered ones and attainment of the TTFT objective over all requests sent. The
peer runs from its own venv, pinned and printed: ``python3 -m venv /tmp/peers-venv &&
/tmp/peers-venv/bin/pip install vllm-router==0.1.17``.

    .venv/bin/python bench/pd.py                    # both workloads, every target (< 3 minutes)
    .venv/bin/python bench/pd.py --workloads multiturn --targets predicted,always
    .venv/bin/python bench/pd.py --workloads multiturn --targets always --splits 0:4,1:3,2:2,3:1 --simulate

``--splits`` runs other prefill:decode splits of the fleet (0:N: an aggregated fleet of N pods) and
``--simulate`` adds, beside each kvroute row, the same trial simulated by ``kvroute plan``'s engine
(whatif/) on the same requests (docs/simulate.md).

The last line printed is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import check_peer, peer_version, stamp  # noqa: E402
from replay import arrivals, workloads  # noqa: E402
from replay.runner import run  # noqa: E402
from simulator.testing import (  # noqa: E402
    consecutive_free_ports,
    free_port,
    pd_pods,
    running_sims,
    sim_kv_events,
    spawn,
    stop_process,
    wait_ready,
)

MODEL = "sim-model"
RATE = float(os.environ.get("PD_RATE", 20))          # multi-turn arrivals per second
TIME_SCALE = float(os.environ.get("PD_SCALE", 0.6))  # Mooncake: trace time x this
BLOCK = 16
DECIDERS = ("always", "prefix", "predicted")


@dataclass(frozen=True)
class Workload:
    name: str
    specs: list
    offsets: list[float]
    objective_s: float
    duration_s: float
    compute_s_per_token: float  # the simulated pods' prefill speed (1 / tokens per s)


def sim_args(events: int, compute_s_per_token: float) -> list[str]:
    return ["--block-size", str(BLOCK), "--num-gpu-blocks", "8192", "--max-model-len", "32768",
            "--compute-s-per-token", str(compute_s_per_token), "--kv-events-port", str(events), "--log-level", "error"]


def start_kvroute(decider: str, urls: list[str], events: int, workdir: Path, wl: Workload,
                  prefill: int = 2) -> tuple[list, str]:
    """A sidecar beside each decode pod and the router; returns (processes, router URL). ``prefill`` 0:
    an aggregated fleet (every pod prefills and decodes, policy predicted-ttft, no sidecars)."""
    procs = []
    sidecars = []
    if prefill == 0:
        return start_aggregated(urls, events, workdir, wl)
    for i, url in enumerate(urls[prefill:]):
        port = free_port()
        log = workdir / f"sidecar-{decider}-{i}.log"
        p = spawn([sys.executable, "-m", "router.cli", "sidecar", "--host", "127.0.0.1", "--port", str(port),
                   "--vllm-url", url, "--prefill-allowlist",
                   json.dumps([u.removeprefix("http://") for u in urls[:prefill]]),
                   "--log-level", "warning"], log)
        procs.append(p)
        sidecars.append(f"http://127.0.0.1:{port}")
        wait_ready(sidecars[-1] + "/health", p, log=log)
    pods = pd_pods(urls, sidecars, events, prefill=prefill)
    port = free_port()
    log = workdir / f"router-{decider}.log"
    cfg = {"port": port, "pods": pods, "pd_decider": decider, "block_size": BLOCK, "admission": False,
           "prefill_tokens_per_s": 1.0 / wl.compute_s_per_token,
           "ttft_objective_ms": wl.objective_s * 1000, "log_level": "warning"}
    cfg_path = workdir / f"router-{decider}.yaml"
    cfg_path.write_text(json.dumps(cfg))
    p = spawn([sys.executable, "-m", "router.cli", "serve", "--config", str(cfg_path)], log)
    procs.append(p)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base + "/ready", p, log=log)
    return procs, base


def start_aggregated(urls: list[str], events: int, workdir: Path, wl: Workload) -> tuple[list, str]:
    pods = [{"id": f"pod-{i}", "url": u, "role": "both", "kv_events": sim_kv_events(events, i)}
            for i, u in enumerate(urls)]
    port = free_port()
    log = workdir / "router-aggregated.log"
    cfg = {"port": port, "pods": pods, "policy": "predicted-ttft", "block_size": BLOCK, "admission": False,
           "prefill_tokens_per_s": 1.0 / wl.compute_s_per_token, "ttft_objective_ms": wl.objective_s * 1000,
           "log_level": "warning"}
    cfg_path = workdir / "router-aggregated.yaml"
    cfg_path.write_text(json.dumps(cfg))
    p = spawn([sys.executable, "-m", "router.cli", "serve", "--config", str(cfg_path)], log)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base + "/ready", p, log=log)
    return [p], base


def start_peer(urls: list[str], workdir: Path, venv: Path) -> tuple[list, str]:
    exe = venv / "bin" / "vllm-router"
    if not exe.exists():
        raise FileNotFoundError(f"{exe} not found: pip install vllm-router==0.1.17 into {venv}")
    port = free_port()
    log = workdir / "vllm-router.log"
    cmd = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
           "--prefill", urls[0], "--prefill", urls[1], "--decode", urls[2], "--decode", urls[3],
           "--kv-connector", "nixl", "--log-level", "warning", "--disable-retries",
           "--max-concurrent-requests", "4096", "--queue-size", "4096",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    p = spawn(cmd, log)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base + "/v1/completions", p, log=log, body={"model": MODEL, "prompt": "probe", "max_tokens": 1})
    return [p], base


def trial(target: str, wl: Workload, workdir: Path, venv: Path, split: tuple[int, int] = (2, 2)) -> dict[str, Any]:
    prefill, decode = split
    events = consecutive_free_ports(2 * (prefill + decode))
    workdir = workdir / wl.name / f"{prefill}-{decode}"
    workdir.mkdir(parents=True, exist_ok=True)
    if prefill == 0:
        target = "aggregated"
    with running_sims(prefill + decode, sim_args(events, wl.compute_s_per_token)) as urls:
        procs: list = []
        try:
            if target == "vllm-router":
                procs, base = start_peer(urls, workdir, venv)
            else:
                procs, base = start_kvroute(target, urls, events, workdir, wl, prefill)
        except (FileNotFoundError, RuntimeError, TimeoutError, OSError) as exc:
            for p in procs:
                stop_process(p, grace=10.0)
            return {"target": target, "workload": wl.name, "split": f"{prefill}:{decode}",
                    "error": str(exc).splitlines()[0][:200]}
        try:
            warm_up(base)
            before = _decisions(base) if target != "vllm-router" else (0.0, 0.0)
            reads_before = sum(_metric(u, "kvsim_nixl_reads_total") for u in urls[:prefill])
            res = asyncio.run(run(base, wl.specs, wl.offsets, model=MODEL, slo_ttft=wl.objective_s,
                                  pod_metrics=urls, duration=wl.duration_s, drain_timeout=20.0,
                                  request_timeout=60.0))
            reads = sum(_metric(u, "kvsim_nixl_reads_total") for u in urls[:prefill]) - reads_before
            remote = local = None
            if target not in ("vllm-router", "aggregated"):
                after = _decisions(base)
                remote, local = after[0] - before[0], after[1] - before[1]
        finally:
            for p in procs:
                stop_process(p, grace=10.0)
    s = res.summary
    return {"target": target, "workload": wl.name, "split": f"{prefill}:{decode}", "requests": s["requests"],
            "completed": s["completed"],
            "errors": s["errors"], "ttft_p50": s.get("ttft_p50"), "ttft_p99": s.get("ttft_p99"),
            "ttft_p50_all": s.get("ttft_p50_all"), "ttft_p99_all": s.get("ttft_p99_all"),
            "tpot_p50_ms": s.get("median_tpot_ms"), "tpot_p99_ms": s.get("p99_tpot_ms"),
            "attainment": s.get("slo_attainment"), "nixl_reads": reads,
            "remote": remote, "local": local, "error": None}


def simulated(target: str, wl: Workload, split: tuple[int, int]) -> dict[str, Any]:
    """The same trial in ``kvroute plan``'s engine: the router's decision code against the simulator's
    cost model, in simulated time, on the same requests (whatif/)."""
    from whatif.podmodel import PodSpec
    from whatif.simulate import SimConfig, simulate

    prefill, decode = split
    spec = PodSpec(timing="cost", block_size=BLOCK, num_gpu_blocks=8192, compute_s_per_token=wl.compute_s_per_token)
    router: dict[str, Any] = {"ttft_objective_ms": wl.objective_s * 1000}
    if prefill:
        router["pd_decider"] = target
    n = arrivals.cut(wl.offsets, duration=wl.duration_s)
    res = simulate(wl.specs[:n], wl.offsets[:n], SimConfig(policy="predicted-ttft", objective_s=wl.objective_s,
                                                           pods=prefill + decode, prefill=prefill, spec=spec,
                                                           router=router, model=MODEL))
    s = res.summary
    routes = s.get("routes") or {}
    return {"target": target, "workload": wl.name, "split": f"{prefill}:{decode}", "simulated": True,
            "requests": s["requests"], "completed": s["completed"], "errors": s["errors"],
            "ttft_p50": s.get("ttft_p50"), "ttft_p99": s.get("ttft_p99"),
            "ttft_p50_all": s.get("ttft_p50_all"), "ttft_p99_all": s.get("ttft_p99_all"),
            "tpot_p50_ms": s.get("median_tpot_ms"),
            "tpot_p99_ms": s.get("p99_tpot_ms"), "attainment": s.get("slo_attainment"), "nixl_reads": None,
            "remote": routes.get("remote", 0) if prefill else None,
            "local": routes.get("local", 0) if prefill else None,
            "error": None}


def warm_up(base: str, n: int = 6) -> None:
    """A few requests with private prompts before the measured run, so first-use costs (connections
    from router to sidecars to pods, code paths) do not land on the workload's first requests."""
    import random

    rng = random.Random(12345)
    with httpx.Client(timeout=30, trust_env=False) as c:
        for _ in range(n):
            prompt = [rng.randrange(256) for _ in range(600)]
            c.post(base + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                                   "stream": True})


def _decisions(base: str) -> tuple[float, float]:
    """(remote, local) P/D decisions the router has made so far."""
    remote = local = 0.0
    for line in httpx.get(base + "/metrics", timeout=5, trust_env=False).text.splitlines():
        if line.startswith("kvroute_pd_decisions_total{"):
            value = float(line.rsplit(" ", 1)[1])
            if 'outcome="remote"' in line:
                remote += value
            elif 'outcome="local"' in line:
                local += value
    return remote, local


def _metric(url: str, name: str) -> float:
    try:
        text = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def build_workloads(names: list[str], seed: int, duration_s: float | None = None) -> list[Workload]:
    """``duration_s``: seconds of load per workload (default 16 multi-turn, 20 Mooncake); the
    multi-turn sessions grow with it (80 per 16 s), so the rate stays the same."""
    out = []
    if "multiturn" in names:
        d = duration_s or 16.0
        specs = workloads.multiturn(system_prompts=8, system_prompt_len=2048, sessions=max(1, round(80 * d / 16.0)),
                                    turns=4, turn_tokens=300, output_len=64, seed=seed)
        offsets = arrivals.poisson(len(specs), rate=RATE, seed=seed)
        n = arrivals.cut(offsets, duration=d)
        out.append(Workload("multiturn", specs[:n], offsets[:n], objective_s=0.5, duration_s=d,
                            compute_s_per_token=1e-4))
    if "mooncake" in names:
        specs = workloads.mooncake(ROOT / "data" / "conversation_trace.jsonl", block_size=512, seed=seed)
        specs = workloads.limit_input_len(specs, 8192, "truncate")
        for s in specs:
            s.output_len = min(s.output_len, 128)
        offsets = arrivals.from_trace([s.timestamp for s in specs], time_scale=TIME_SCALE)
        d = duration_s or 20.0
        n = sum(1 for o in offsets if o < d)
        out.append(Workload("mooncake", specs[:n], offsets[:n], objective_s=1.0, duration_s=d,
                            compute_s_per_token=5e-5))
    for wl in out:  # build every prompt's bytes now, so the first trial does not pay for it while sending
        for spec in wl.specs:
            spec.prompt_json()
    return out


def fmt(v: Any, kind: str) -> str:
    if v is None:
        return "—"
    if v == float("inf"):
        return "∞ (failed)"
    if kind == "s":
        return f"{v * 1000:.0f} ms"
    if kind == "ms":
        return f"{v:.1f} ms"
    if kind == "%":
        return f"{v * 100:.1f} %"
    return str(v)


def _all(r: dict[str, Any], key: str) -> Any:
    """``ttft_p50`` / ``ttft_p99`` over all requests sent (rows of JSON before 2026-12-06 have only
    the percentile over the answered ones, the same when ``errors`` is 0)."""
    v = r.get(key + "_all")
    return r.get(key) if v is None and not r.get("errors") else v


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| workload | router / decider | TTFT p50 (all sent) | TTFT p99 (all sent) | TPOT p50 | TPOT p99 | "
             "met objective | "
             "remote / local | errors |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = r["target"] if r["target"] == "vllm-router" else f"kvroute {r['target']}"
        if r.get("split", "2:2") != "2:2" or r.get("simulated"):
            name += f" {r.get('split')}" + (" (simulated)" if r.get("simulated") else "")
        if r.get("error"):
            lines.append(f"| {r['workload']} | {name} | — | — | — | — | — | — | not run: {r['error']} |")
            continue
        split = f"{r['remote'] or 0:.0f} / {r['local'] or 0:.0f}" if r.get("remote") is not None else \
            f"{r['nixl_reads']:.0f} NIXL reads" if r.get("nixl_reads") is not None else "—"
        lines.append(f"| {r['workload']} | {name} | {fmt(_all(r, 'ttft_p50'), 's')} | "
                     f"{fmt(_all(r, 'ttft_p99'), 's')} | "
                     f"{fmt(r['tpot_p50_ms'], 'ms')} | {fmt(r['tpot_p99_ms'], 'ms')} | {fmt(r['attainment'], '%')} | "
                     f"{split} | {r['errors']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="multiturn,mooncake")
    ap.add_argument("--targets", default="always,prefix,predicted,vllm-router")
    ap.add_argument("--peers-venv", default="/tmp/peers-venv")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--splits", default="2:2", help="prefill:decode splits to run, comma-separated; 0:N is an "
                    "aggregated fleet of N pods (policy predicted-ttft, no sidecars) (default: 2:2)")
    ap.add_argument("--simulate", action="store_true", help="also simulate each kvroute row (kvroute plan's engine, "
                    "whatif/) on the same requests, for docs/simulate.md")
    ap.add_argument("--duration", type=float, default=None, help="seconds of load per workload (default: 16 "
                    "multi-turn, 320 requests; 20 Mooncake, 100 requests)")
    args = ap.parse_args(argv)
    splits = [(int(a), int(b)) for a, b in (x.split(":") for x in args.splits.split(",") if x.strip())]
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-pd-bench-"))
    started = time.monotonic()
    peer = "not run"
    if "vllm-router" in args.targets.split(","):
        peer = peer_version(args.peers_venv, "vllm-router")
        print(f"vllm-router {peer} from {args.peers_venv}", flush=True)
        check_peer("vllm-router", peer)
    rows = []
    for wl in build_workloads(args.workloads.split(","), args.seed, args.duration):
        print(f"# {wl.name}: {len(wl.specs)} requests over {wl.duration_s:g} s, objective {wl.objective_s:g} s",
              flush=True)
        for split in splits:
            for target in (args.targets.split(",") if split[0] else ["aggregated"]):
                if target == "vllm-router" and split != (2, 2):
                    continue
                t0 = time.monotonic()
                rows.append(trial(target, wl, workdir, Path(args.peers_venv), split))
                r = rows[-1]
                if target == "vllm-router":
                    r["version"] = peer
                print(f"  {target:12s} {split[0]}:{split[1]} {time.monotonic() - t0:5.1f} s  "
                      + (f"p99 {fmt(_all(r, 'ttft_p99'), 's')} met {fmt(r['attainment'], '%')}" if not r.get("error")
                         else f"not run: {r['error']}"), flush=True)
                if args.simulate and target != "vllm-router":
                    rows.append(simulated(target, wl, split))
                    r = rows[-1]
                    print(f"  {target:12s} {split[0]}:{split[1]} simulated  p99 {fmt(_all(r, 'ttft_p99'), 's')} "
                          f"met {fmt(r['attainment'], '%')}", flush=True)
    print()
    print(table(rows))
    if args.json:  # the rows, each with the command and commit that made it
        made = {**stamp("pd.py", argv), "vllm_router_version": peer}
        Path(args.json).write_text(json.dumps([{**r, **made} for r in rows], indent=2))
    print(f"\n(logs in {workdir}; {time.monotonic() - started:.0f} s in all)")
    heads = []
    for wl in {r["workload"] for r in rows}:
        got = {r["target"]: r for r in rows if r["workload"] == wl and not r.get("error") and not r.get("simulated")
               and r.get("split") == "2:2"}
        if "predicted" in got:  # TTFT p99 over all requests sent
            others = [f"{t} {fmt(_all(got[t], 'ttft_p99'), 's')}/{fmt(got[t]['attainment'], '%')}" for t in got
                      if t != "predicted"]
            p = got["predicted"]
            heads.append(f"{wl}: predicted TTFT p99 {fmt(_all(p, 'ttft_p99'), 's')}, met {fmt(p['attainment'], '%')} "
                         f"(vs {', '.join(others)})")
    print("; ".join(sorted(heads)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
