"""One routing trial: a fresh simulated fleet, one router in front of it, one replayed workload.

Shared by ``kvroute demo`` and ``bench/routing_quality.py`` so both measure the same way: every
trial starts new simulated pods (empty caches), starts the router under test (kvroute with a
policy, or a peer router), replays the same request sequence at the same arrival times through it
with the replay client, and returns the replay summary (SLO attainment over all requests sent,
rejections, TTFT percentiles, cluster hit rate from the pods' own prefix-cache counters).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import yaml

from simulator.testing import (
    consecutive_free_ports,
    free_port,
    running_sims,
    sim_kv_events,
    spawn,
    stop_process,
    wait_ready,
)


@dataclass(frozen=True)
class FleetSpec:
    """The simulated fleet (defaults: the seed's model, see docs/router.md)."""

    pods: int = 8
    block_size: int = 64
    num_gpu_blocks: int = 3000
    prefill_tokens_per_s: float = 20000.0
    decode_s_per_token: float = 0.01
    model: str = "sim-model"
    data_parallel_size: int = 1   # engines behind each pod's HTTP server (vLLM's --data-parallel-size)
    timing: str = "seed"          # the pods' timing model: seed (one FIFO prefill server) or cost (batched steps)
    compute_s_per_token: float = 5e-5  # cost timing: seconds per token computed in a step (the simulator's default)
    # per pod, in order: how much slower than the rest it computes (the simulator's slowdown fault), for
    # a heterogeneous fleet; pods past the end run at full speed
    slowdowns: tuple[float, ...] = ()
    # kvroute's prior prefill rate (its prefill_tokens_per_s); None: prefill_tokens_per_s, the true seed rate
    prior: float | None = None

    def sim_args(self, events_port: int) -> list[str]:
        return ["--timing", self.timing, "--block-size", str(self.block_size),
                "--num-gpu-blocks", str(self.num_gpu_blocks), "--compute-s-per-token", str(self.compute_s_per_token),
                "--prefill-tokens-per-s", str(self.prefill_tokens_per_s), "--decode-s-per-token",
                str(self.decode_s_per_token), "--kv-events-port", str(events_port), "--model", self.model,
                "--max-model-len", "131072", "--log-level", "error",
                "--data-parallel-size", str(self.data_parallel_size), "--enable-prompt-tokens-details"]


@dataclass(frozen=True)
class Target:
    """A router to put in front of the fleet: ``kind`` is kvroute, vllm-router or sglang-router."""

    name: str
    kind: str = "kvroute"
    policy: str = "predicted-ttft"
    admission: bool = False
    endpoint: Literal["completions", "chat"] = "completions"  # completions (token-id prompts) or chat (text)
    extra: dict[str, Any] = field(default_factory=dict)
    # kvroute only: this many separate router processes (replicas), each bound to a booking-bus port
    # and subscribed to the others' unless ``extra`` turns the bus off; the load goes to them in turn
    replicas: int = 1
    # kvroute only: False configures the pods without their KV event endpoints, so the router knows
    # their caches only from the credits of the prompts it routed (a fleet whose vLLM publishes none)
    kv_events: bool = True


def _file_stem(target: Target, replica: int = 0) -> str:
    """The router's log, config and metrics files are named after the target (and the replica)."""
    stem = target.name.replace(" ", "_").replace("/", "_")
    return f"{stem}.{replica}" if target.replicas > 1 else stem


def start_router(target: Target, urls: list[str], events_port: int, fleet: FleetSpec, objective_ms: float,
                 workdir: Path, peers_venv: Path) -> tuple[list[subprocess.Popen], list[str]]:
    """Start the router under test (``target.replicas`` kvroute processes); return (processes, base URLs)."""
    port = free_port()
    log_path = workdir / f"{_file_stem(target)}.log"
    ranks = fleet.data_parallel_size
    events = [(ev["endpoint"], ev["replay"])
              for ev in (sim_kv_events(events_port, i, ranks)[0] for i in range(len(urls)))]
    if target.kind == "kvroute":
        pods = [{"id": f"pod-{i}", "url": u, "model": fleet.model,
                 **({"kv_events": sim_kv_events(events_port, i, ranks)} if target.kv_events else {})}
                for i, u in enumerate(urls)]
        cfg = {"port": port, "pods": pods, "policy": target.policy, "admission": target.admission,
               "ttft_objective_ms": objective_ms if target.admission else None,
               "block_size": fleet.block_size,
               "prefill_tokens_per_s": fleet.prior if fleet.prior is not None else fleet.prefill_tokens_per_s,
               "log_level": "warning", **target.extra}
        ports = [port] + [free_port() for _ in range(target.replicas - 1)]
        buses = [f"tcp://127.0.0.1:{free_port()}" for _ in ports] if target.replicas > 1 else []
        procs, bases = [], []
        try:
            for i, p in enumerate(ports):
                name = _file_stem(target, i)
                replica = dict(cfg, port=p)
                if buses and cfg.get("booking_bus", True):
                    replica.update(booking_bus_bind=buses[i], booking_bus_peers=buses[:i] + buses[i + 1:])
                cfg_path = workdir / f"{name}.yaml"
                cfg_path.write_text(yaml.safe_dump(replica))
                log = workdir / f"{name}.log"
                procs.append(spawn([sys.executable, "-m", "router.cli", "serve", "--config", str(cfg_path)], log))
                bases.append(f"http://127.0.0.1:{p}")
                wait_ready(bases[-1] + "/ready", procs[-1], 60.0, log=log)
        except BaseException:
            for proc in procs:
                stop_process(proc)
            raise
        return procs, bases
    exe = peers_venv / "bin" / target.kind
    if not exe.exists():
        raise FileNotFoundError(f"{exe} not found (install the peer into {peers_venv})")
    if target.kind == "vllm-router":
        cmd = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", target.policy,
               "--log-level", "warning", "--disable-retries"]
        if target.policy == "kv_aware":
            if ranks > 1:
                raise RuntimeError("vllm-router's kv_aware policy takes one event source per worker, not one per "
                                   "data-parallel rank")
            for u, (e, r) in zip(urls, events):
                cmd += ["--kv-event-source", f"{u}={e}", "--kv-event-replay-source", f"{u}={r}"]
            cmd += ["--kv-event-block-size", str(fleet.block_size), "--kv-event-model", fleet.model]
    elif target.kind == "sglang-router":
        cmd = [str(exe), "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
               "--policy", target.policy, "--log-level", "warn"]
    else:
        raise ValueError(f"unknown router kind {target.kind}")
    # both peers open a Prometheus listener, on 29000 unless told: a port of its own, so a peer still
    # closing (or another trial's) cannot make the next one fail to start
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    cmd += [str(a) for a in target.extra.get("args", [])]
    proc = spawn(cmd, log_path)
    base = f"http://127.0.0.1:{port}"
    probe = {"model": fleet.model, "prompt": "probe", "max_tokens": 1}
    try:
        if target.endpoint == "chat":
            wait_ready(base + "/v1/chat/completions", proc, 60.0, log=log_path,
                       body={"model": fleet.model, "messages": [{"role": "user", "content": "probe"}], "max_tokens": 1})
        else:
            wait_ready(base + "/v1/completions", proc, 60.0, log=log_path, body=probe)
    except BaseException:  # not ready in time, or Ctrl-C: the peer is not left running
        stop_process(proc)
        raise
    return [proc], [base]


def run_trial(target: Target, specs: Sequence[Any], arrivals: Sequence[float], *, fleet: FleetSpec = FleetSpec(),
              objective_s: float = 2.0, duration: float | None = None, peers_venv: str | Path = "/tmp/peers-venv",
              workdir: str | Path | None = None, drain_timeout: float = 30.0) -> dict[str, Any]:
    """Run one trial and return ``{"target", "summary", "records", "error"}``."""
    from replay.runner import run

    workdir = Path(workdir or tempfile.mkdtemp(prefix="kvroute-trial-"))
    workdir.mkdir(parents=True, exist_ok=True)
    events = consecutive_free_ports(2 * fleet.pods * fleet.data_parallel_size)
    with running_sims(fleet.pods, fleet.sim_args(events)) as urls:
        for url, slowdown in zip(urls, fleet.slowdowns):
            if slowdown != 1.0:
                httpx.post(url + "/sim/faults", json={"slowdown": slowdown}, timeout=10.0,
                           trust_env=False).raise_for_status()
        try:
            procs, bases = start_router(target, urls, events, fleet, objective_s * 1000, workdir, Path(peers_venv))
        except (FileNotFoundError, RuntimeError, TimeoutError) as exc:
            return {"target": target, "summary": None, "records": [], "error": str(exc)[:300]}
        try:
            result = asyncio.run(run(bases, specs, arrivals, endpoint=target.endpoint, model=fleet.model,
                                     duration=duration, slo_ttft=objective_s, pod_metrics=urls,
                                     drain_timeout=drain_timeout, request_timeout=120.0))
        finally:
            if target.kind == "kvroute":  # keep the routers' own view of the run for analysis
                for i, base in enumerate(bases):
                    try:
                        text = httpx.get(base + "/metrics", timeout=5.0, trust_env=False).text
                        (workdir / f"{_file_stem(target, i)}.metrics").write_text(text)
                    except httpx.HTTPError:
                        pass
            for proc in procs:
                stop_process(proc, grace=10.0)
    return {"target": target, "summary": result.summary, "records": result.records, "error": None}


def row(result: dict[str, Any]) -> dict[str, Any]:
    """The table row of a trial: policy, hit rate, TTFT p50/p99, met objective, rejected."""
    s = result["summary"]
    t: Target = result["target"]
    if not s:
        return {"router": t.name, "error": result["error"]}
    n = max(s["requests"], 1)
    hit = s.get("hit_rate")
    if isinstance(hit, dict):
        hit = hit.get("hit_rate")
    return {"router": t.name, "requests": s["requests"], "hit_rate": hit, "ttft_p50": s.get("ttft_p50"),
            "ttft_p99": s.get("ttft_p99"), "ttft_p99_all": s.get("ttft_p99_all"),
            "slo_attainment": s.get("slo_attainment"), "admitted_late": s.get("admitted_late"),
            "rejected": s["rejected"] / n, "errors": s["errors"], "lateness_p99_ms": s.get("lateness_p99_ms")}


def _seconds(v: Any) -> str:
    if v is None:
        return "—"
    return "∞ (rejected)" if v == float("inf") else f"{v:.2f} s"


def format_rows(rows: Sequence[dict[str, Any]], objective_s: float) -> str:
    """The routing table. "met" counts every request sent (a rejection or error is a miss); the
    TTFT p99 is given over the admitted requests and over all sent (a rejection at infinity), and
    "admitted, late" are the requests let through that still missed the objective."""
    head = (f"| router / policy | hit rate | TTFT p50 (admitted) | TTFT p99 (admitted) | TTFT p99 (all sent) | "
            f"met the {objective_s:g} s objective (all sent) | rejected | admitted, late |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            why = " ".join(str(r["error"]).split())[:160]   # one line, whatever the process printed
            lines.append(f"| {r['router']} | — | — | — | — | not run: {why} | — | — |")
            continue
        hit = f"{r['hit_rate'] * 100:.1f} %" if r.get("hit_rate") is not None else "—"
        met = f"{r['slo_attainment'] * 100:.1f} %" if r.get("slo_attainment") is not None else "—"
        if r.get("errors"):
            met += f" [{r['errors']} errors]"
        late = f"{r['admitted_late'] * 100:.1f} %" if r.get("admitted_late") is not None else "—"
        lines.append(f"| {r['router']} | {hit} | {_seconds(r.get('ttft_p50'))} | {_seconds(r.get('ttft_p99'))} | "
                     f"{_seconds(r.get('ttft_p99_all'))} | {met} | {r.get('rejected', 0) * 100:.1f} % | {late} |")
    return "\n".join(lines)


def save_plot(results: Sequence[dict[str, Any]], path: str | Path, objective_s: float, title: str) -> Path:
    """One TTFT CDF per trial (over all requests sent; rejected ones never reach the objective)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 5))
    for res in results:
        if not res["summary"]:
            continue
        recs = res["records"]
        sent = [r for r in recs if r.sent is not None or r.status]
        ttfts = np.sort([r.ttft for r in sent if r.ok and r.ttft is not None])
        if len(ttfts) == 0:
            continue
        ax.step(ttfts, np.arange(1, len(ttfts) + 1) / max(len(sent), 1), where="post", label=res["target"].name)
    ax.axvline(objective_s, color="red", linestyle="--", label=f"objective {objective_s:g} s")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("fraction of all requests sent")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def dump(results: Sequence[dict[str, Any]], path: str | Path) -> None:
    rows = [row(r) for r in results]
    Path(path).write_text(json.dumps(rows, indent=2, default=str))
