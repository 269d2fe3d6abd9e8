"""The fault scenarios, shared by the fault tests (short runs, asserted) and
``bench/reliability.py`` (longer runs, printed as a table).

Each scenario starts its own processes on loopback, injects one fault, and returns a ``Row``: what
was injected, what the clients saw, requests sent and answered, the recovery time, and the figures
the tests assert on. Nothing here asserts; the callers do.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.faults.harness import (
    Outcome,
    Served,
    Sims,
    Tally,
    completion_body,
    kill_hard,
    metric,
    open_loop,
    percentile,
    router,
    rss_mib,
    send,
    sim_faults,
)
from tests.helpers import ROOT

SEED = ["--timing", "seed"]


@dataclass
class Row:
    fault: str
    injected: str
    saw: str = ""
    sent: int = 0
    answered: int = 0
    recovery_s: float | None = None
    figures: dict[str, Any] = field(default_factory=dict)

    def table_row(self) -> list[str]:
        rec = "-" if self.recovery_s is None else f"{self.recovery_s:.2f} s"
        return [self.fault, self.injected, self.saw, f"{self.sent} / {self.answered}", rec]


def prompt(i: int, length: int = 400, tag: str = "p") -> str:
    head = f"{tag}{i}:"
    return (head + "lorem ipsum dolor sit amet " * (length // 27 + 1))[:length]


async def wait_until(check, timeout_s: float, step_s: float = 0.05) -> float | None:
    """Seconds until ``check()`` (sync or async) is true, or None after ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        ok = check()
        if asyncio.iscoroutine(ok):
            ok = await ok
        if ok:
            return time.monotonic() - t0
        await asyncio.sleep(step_s)
    return None


async def metrics_text(client: httpx.AsyncClient) -> str:
    return (await client.get("/metrics")).text


async def cached_tokens(client: httpx.AsyncClient, text: str, pod: str, model: str = "sim-model") -> int:
    body = {"model": model, "prompt": text, "max_tokens": 1}
    r = await client.post("/debug/route", json=body)
    for row in r.json()["pods"]:
        if row["pod"] == pod:
            return int(row["cached_tokens"])
    return 0


# ---------------------------------------------------------------------------------------------
# 1. a pod killed mid-stream; it leaves the candidate set and comes back
# ---------------------------------------------------------------------------------------------


async def pod_killed(tmp: Path, streams: int = 6, after_s: float = 3.0) -> Row:
    """Two one-pod processes; every stream is long (seed timing, 40 tokens x 50 ms). Kill one pod's
    process while streams run on both; then keep sending; then restart it on the same ports."""
    row = Row("pod killed mid-stream", f"SIGKILL one of 2 pods with {streams} streams open")
    slow = [*SEED, "--decode-s-per-token", "0.05"]
    with Sims(1, slow, prefix="victim") as victim, Sims(1, slow, prefix="live") as live:
        settings = dict(health_interval_s=0.5, unhealthy_after=1, policy="round-robin")
        with router(tmp, victim.pods() + live.pods(), **settings) as r:
            async with httpx.AsyncClient(base_url=r.base, timeout=None) as c:
                tally = Tally()
                body = lambda i: completion_body(prompt(i), max_tokens=40)  # noqa: E731
                running = [asyncio.create_task(send(c, body(i))) for i in range(streams)]
                await asyncio.sleep(0.6)  # streams are mid-way (about 12 of 40 tokens)
                t_kill = time.monotonic()
                victim.kill()
                t_watch = time.monotonic()
                # the dead pod leaves the candidate set (watched while the other streams finish)
                watch = asyncio.create_task(wait_until(lambda: _healthy(c, "victim-0", False), timeout_s=5.0))
                first = await asyncio.gather(*running)
                tally.outcomes += first
                row.figures["mid_stream"] = {o.pod: o.kind for o in first}
                left = await watch
                row.figures["left_candidates_s"] = None if left is None else left + (t_watch - t_kill)
                # requests meanwhile: all served by the live pod
                later = [await send(c, completion_body(prompt(100 + i), max_tokens=4)) for i in range(6)]
                tally.outcomes += later
                row.figures["while_dead"] = sorted({(o.kind, o.pod) for o in later})
                # it comes back
                t_back = time.monotonic()
                victim.start()
                back = await wait_until(lambda: _healthy(c, "victim-0", True), timeout_s=after_s + 5)
                row.figures["returned_s"] = None if back is None else time.monotonic() - t_back
                again = [await send(c, completion_body(prompt(200 + i), max_tokens=4)) for i in range(4)]
                tally.outcomes += again
                row.figures["after_return_pods"] = sorted({o.pod or "" for o in again})
                row.recovery_s = row.figures["left_candidates_s"]
    row.sent, row.answered, row.saw = tally.sent, tally.answered, tally.saw()
    row.figures["kinds"] = tally.kinds()
    return row


async def _healthy(c: httpx.AsyncClient, pod: str, want: bool) -> bool:
    text = await metrics_text(c)
    return metric(text, "kvroute_pod_healthy", pod=pod) == (1.0 if want else 0.0) and \
        f'kvroute_pod_healthy{{pod="{pod}"}}' in text


# ---------------------------------------------------------------------------------------------
# 2. a pod failing before the first byte: retried elsewhere, the client none the wiser
# ---------------------------------------------------------------------------------------------


async def fails_before_first_byte(tmp: Path, requests: int = 20) -> Row:
    row = Row("pod fails before first byte", "1 of 2 pods answers 503, then drops connections before a byte")
    with Sims(2, [*SEED, "--decode-s-per-token", "0.002"], events=False) as sims:
        with router(tmp, sims.pods(), policy="round-robin", unhealthy_after=100) as r:
            async with httpx.AsyncClient(base_url=r.base, timeout=None) as c:
                tally = Tally()
                sim_faults(sims.urls[0], status=503)
                for i in range(requests // 2):
                    tally.outcomes.append(await send(c, completion_body(prompt(i), max_tokens=4, stream=i % 2 == 0)))
                sim_faults(sims.urls[0], status=None, drop_after_chunks=0)
                for i in range(requests // 2, requests):
                    tally.outcomes.append(await send(c, completion_body(prompt(i), max_tokens=4, stream=i % 2 == 0)))
                text = await metrics_text(c)
                row.figures["retries"] = metric(text, "kvroute_retries_total")
                row.figures["pods"] = sorted({o.pod or "" for o in tally.outcomes})
    row.sent, row.answered, row.saw = tally.sent, tally.answered, tally.saw()
    row.figures["kinds"] = tally.kinds()
    row.recovery_s = 0.0
    return row


# ---------------------------------------------------------------------------------------------
# 3. a slow pod (10x step time): predictions and routing move away
# ---------------------------------------------------------------------------------------------


async def slow_pod(tmp: Path, requests: int = 40, factor: float = 10.0) -> Row:
    row = Row("slow pod", f"1 of 2 pods slowed {factor:g}x (step and prefill time)")
    with Sims(2, ["--timing", "cost"], events=True) as sims:
        with router(tmp, sims.pods(), calibration_halflife=20) as r:
            async with httpx.AsyncClient(base_url=r.base, timeout=None) as c:
                tally = Tally()

                async def burst(start: int, n: int) -> list[Outcome]:
                    out = []
                    for k in range(0, n, 2):  # two at a time so both pods get work
                        pair = [send(c, completion_body(prompt(start + k + j, 1500), max_tokens=2)) for j in range(2)]
                        out += await asyncio.gather(*pair)
                    return out

                before = await burst(0, 10)
                sim_faults(sims.urls[0], slowdown=factor)
                t0 = time.monotonic()
                after = await burst(1000, requests)
                tally.outcomes += before + after
                slow = "sim-0"
                share_before = sum(o.pod == slow for o in before) / len(before)
                tail = after[len(after) // 2:]
                share_after = sum(o.pod == slow for o in tail) / len(tail)
                explained = (await c.post("/debug/route",
                                          json=completion_body(prompt(9999, 1500), stream=False))).json()
                pred = {p["pod"]: p["predicted_ttft_ms"] for p in explained["pods"]}
                rates = {p["pod"]: p["prefill_tokens_per_s"] for p in explained["pods"]}
                overheads = {p["pod"]: p["overhead_ms"] for p in explained["pods"]}
                # when did routing move: index of the last request sent to the slow pod
                last_slow = max((i for i, o in enumerate(after) if o.pod == slow), default=-1)
                row.recovery_s = None if last_slow < 0 else after[last_slow].sent_at + after[last_slow].took_s - t0
                row.figures.update(share_before=share_before, share_after=share_after, predicted_ttft_ms=pred,
                                   prefill_tokens_per_s=rates, overhead_ms=overheads, chosen=explained["chosen"])
    row.sent, row.answered = tally.sent, tally.answered
    row.saw = (f"all {tally.saw()}; slow pod's share {share_before:.0%} -> {share_after:.0%}; "
               f"predicted {pred.get('sim-0', 0):.0f} vs {pred.get('sim-1', 0):.0f} ms")
    return row


# ---------------------------------------------------------------------------------------------
# 4. KV event stream: stopped (gap repaired by replay), engine restart, silent publisher
# ---------------------------------------------------------------------------------------------


async def event_faults(tmp: Path, silence_s: float = 2.0) -> Row:
    row = Row("KV events: gap, restart, silence",
              "events stopped then resumed; engine seq restart; publisher silent under traffic")
    with Sims(1, [*SEED, "--decode-s-per-token", "0.001"]) as sims:
        with router(tmp, sims.pods(), event_silence_s=silence_s, speculative_ttl_s=0.2) as r:
            async with httpx.AsyncClient(base_url=r.base, timeout=None) as c:
                tally = Tally()
                pod, url = "sim-0", sims.urls[0]
                go = lambda text: send(c, completion_body(text, max_tokens=2, stream=False))  # noqa: E731
                a, b, d = prompt(1, 640, "A"), prompt(2, 640, "B"), prompt(3, 640, "D")
                tally.outcomes.append(await go(a))
                row.figures["a_indexed_s"] = await wait_until(lambda: _cached(c, a, pod, 600), 5)
                # (1) events stop: B's blocks are stored on the pod but never announced
                sim_faults(url, events_stop=True)
                tally.outcomes.append(await go(b))
                await asyncio.sleep(0.4)  # the speculative credit (0.2 s) is gone
                row.figures["b_cached_while_stopped"] = await cached_tokens(c, b, pod)
                sim_faults(url, events_stop=False)
                t0 = time.monotonic()
                tally.outcomes.append(await go(prompt(4, 64, "C")))  # the next batch shows the gap
                repaired = await wait_until(lambda: _cached(c, b, pod, 600), 5)
                row.figures["gap_repaired_s"] = None if repaired is None else time.monotonic() - t0
                # (2) engine restart: sequence back to 0, cache forgotten -> old entries cleared
                sim_faults(url, events_restart=True)
                t1 = time.monotonic()
                tally.outcomes.append(await go(d))
                cleared = await wait_until(lambda: _not_cached(c, a, pod), 5)
                row.figures["restart_cleared_s"] = None if cleared is None else time.monotonic() - t1
                row.figures["d_indexed_after_restart"] = await wait_until(lambda: _cached(c, d, pod, 600), 5)
                # (3) a silent publisher under traffic: its entries age out, with a metric and a log
                sim_faults(url, events_stop=True)
                t2 = time.monotonic()
                n = 0
                aged = None
                while time.monotonic() - t2 < silence_s + 6:
                    tally.outcomes.append(await go(prompt(50 + n, 128, "S")))
                    n += 1
                    text = await metrics_text(c)
                    if metric(text, "kvroute_event_silence_clears_total", pod=pod) >= 1:
                        aged = time.monotonic() - t2
                        break
                    await asyncio.sleep(0.2)
                row.figures["silence_cleared_s"] = aged
                row.figures["d_cached_after_silence"] = await cached_tokens(c, d, pod)
                sim_faults(url, events_stop=False)
                row.recovery_s = row.figures["gap_repaired_s"]
        row.figures["log_says_silent"] = "silent" in r.log_text()
    row.sent, row.answered = tally.sent, tally.answered
    f = row.figures
    row.saw = (f"all {tally.saw()}; gap repaired in {_s(f['gap_repaired_s'])}, restart cleared in "
               f"{_s(f['restart_cleared_s'])}, silence aged out after {_s(f['silence_cleared_s'])}")
    return row


def _s(v: float | None) -> str:
    return "never" if v is None else f"{v:.2f} s"


async def _cached(c, text, pod, at_least) -> bool:
    return await cached_tokens(c, text, pod) >= at_least


async def _not_cached(c, text, pod) -> bool:
    return await cached_tokens(c, text, pod) == 0


# ---------------------------------------------------------------------------------------------
# 5. the router restarted under load
# ---------------------------------------------------------------------------------------------


async def router_restart(tmp: Path, duration_s: float = 6.0, rate: float = 20.0, hard: bool = False) -> Row:
    how = "SIGKILL" if hard else "SIGTERM"
    row = Row(f"router restart ({how})", f"{how} the router under {rate:g} req/s of streams, start it again")
    # room for every prompt of the run, so that the marker is never evicted on the pod itself
    with Sims(2, [*SEED, "--decode-s-per-token", "0.01", "--num-gpu-blocks", "65536"]) as sims:
        r = router(tmp, sims.pods(), speculative_ttl_s=0.1)
        r.start()
        try:
            tally = Tally()
            marker = prompt(7, 800, "M")
            async with httpx.AsyncClient(base_url=r.base, timeout=None) as c:
                first = await send(c, completion_body(marker, max_tokens=2))
                tally.outcomes.append(first)
                # the first process must have indexed the marker, or the rebuild below measures nothing
                row.figures["indexed_before_restart_s"] = await wait_until(
                    lambda: _cached(c, marker, first.pod, 768), 5)

            async def restart() -> None:
                await asyncio.sleep(duration_s / 3)
                row.figures["t_stop"] = time.monotonic()
                if hard:
                    kill_hard(r.proc)
                else:
                    r.proc.send_signal(signal.SIGTERM)
                    await asyncio.to_thread(r.proc.wait, 30)
                r.proc = None
                row.figures["t_start"] = time.monotonic()
                await asyncio.to_thread(r.start)
                row.figures["t_ready"] = time.monotonic()
                # the new process knows nothing: it rebuilds the index from the pods' replay buffers
                async with httpx.AsyncClient(base_url=r.base, timeout=None) as c:
                    row.figures["index_rebuilt_after_ready_s"] = await wait_until(
                        lambda: _cached(c, marker, first.pod, 768), 10)

            body = lambda i: completion_body(prompt(i, 300, "L"), max_tokens=16)  # noqa: E731
            await asyncio.gather(open_loop(r.base, rate, duration_s, body, tally, timeout_s=20), restart())
            rebuilt = row.figures["index_rebuilt_after_ready_s"]
        finally:
            r.stop()
    t_stop, t_ready = row.figures["t_stop"], row.figures["t_ready"]
    oks = [o for o in tally.outcomes if o.kind == "ok" and o.sent_at > t_stop]
    row.figures["down_s"] = t_ready - t_stop
    row.figures["first_ok_after_signal_s"] = (min(o.sent_at for o in oks) - t_stop) if oks else None
    row.recovery_s = t_ready - t_stop  # the listener is back and ready
    row.figures["kinds"] = tally.kinds()
    row.sent, row.answered = tally.sent, tally.answered
    row.saw = f"{tally.saw()}; index rebuilt from replay {_s(rebuilt)} after ready"
    return row


# ---------------------------------------------------------------------------------------------
# 6. the sidecar's prefill pod dying between the legs
# ---------------------------------------------------------------------------------------------


async def sidecar_prefill_dies(tmp: Path) -> Row:
    row = Row("prefill pod dies between legs", "prefill pod SIGKILLed after its leg, before the decoder reads KV; "
              "and a prefill pod already dead")
    with Sims(1, [*SEED, "--enable-prompt-tokens-details"], events=False, prefix="decode") as decode, \
            Sims(1, SEED, events=False, prefix="prefill") as pre:
        side = Served("sidecar", tmp, {"host": "127.0.0.1", "vllm_url": decode.urls[0], "log_level": "warning",
                                       "prefill_allowlist": ["127.0.0.1"]}, ready_path="/health")
        with side:
            tally = Tally()
            hp = pre.urls[0].removeprefix("http://")
            headers = {"x-prefiller-host-port": hp}
            async with httpx.AsyncClient(base_url=side.base, timeout=None) as c:
                ok = await c.post("/v1/completions", json=completion_body(prompt(1, 600), 4, False), headers=headers)
                row.figures["healthy_path"] = ok.headers.get("x-kvroute-prefill")
                # between the legs: the decoder waits 1 s before handling its leg; the prefill dies meanwhile
                sim_faults(decode.urls[0], delay_s=1.0)
                leg = asyncio.create_task(c.post("/v1/completions", json=completion_body(prompt(2, 600), 4, False),
                                                 headers=headers))
                await asyncio.sleep(0.5)
                pre.kill()
                r = await leg
                tally.outcomes.append(Outcome("ok" if r.status_code == 200 else f"http-{r.status_code}", r.status_code))
                row.figures["between_legs"] = (r.status_code, r.headers.get("x-kvroute-prefill"),
                                               r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                                               if r.status_code == 200 else None)
                sim_faults(decode.urls[0], delay_s=0.0)
                text = httpx.get(decode.urls[0] + "/metrics").text
                row.figures["nixl_failed"] = metric(text, "kvsim_nixl_transfers_total", outcome="failed")
                # the prefill pod already dead: the sidecar falls back to a local prefill
                t0 = time.monotonic()
                r2 = await c.post("/v1/completions", json=completion_body(prompt(3, 600), 4, False), headers=headers)
                tally.outcomes.append(Outcome("ok" if r2.status_code == 200 else f"http-{r2.status_code}",
                                              r2.status_code))
                row.figures["already_dead"] = (r2.status_code, r2.headers.get("x-kvroute-prefill"))
                row.recovery_s = time.monotonic() - t0
    row.sent, row.answered = tally.sent, tally.answered
    row.saw = (f"{tally.saw()}; decoder recomputed (NIXL read failed x{row.figures['nixl_failed']:g}); "
               f"dead prefill -> x-kvroute-prefill: {row.figures['already_dead'][1]}")
    return row


# ---------------------------------------------------------------------------------------------
# 7. overload at 5x capacity
# ---------------------------------------------------------------------------------------------


async def overload(tmp: Path, duration_s: float = 12.0, factor: float = 5.0, pods: int = 2) -> Row:
    """Pods slowed 4x so that the fleet's capacity is small (two cores run everything here); the
    load generator is a separate process so that the /health probe measures the router alone."""
    prompt_tokens, slowdown = 2000, 4.0
    capacity = pods * (20000.0 / slowdown) / prompt_tokens  # prefill-bound requests per second
    rate = factor * capacity
    row = Row("overload", f"{factor:g}x capacity ({rate:.0f} req/s vs {capacity:.0f}) for {duration_s:g} s")
    with Sims(pods, ["--timing", "cost", "--fault-slowdown", str(slowdown)]) as sims:
        with router(tmp, sims.pods(), ttft_objective_ms=1000, prefill_tokens_per_s=20000 / slowdown) as r:
            pid = r.proc.pid
            async with httpx.AsyncClient(base_url=r.base, timeout=None) as c:
                for i in range(3):  # warm up
                    await send(c, completion_body(prompt(i, prompt_tokens, "W"), max_tokens=4))
            rss_before = rss_mib(pid)
            out = tmp / "load.json"
            load = subprocess.Popen([sys.executable, "-m", "tests.faults.load", r.base, str(rate), str(duration_s),
                                     str(prompt_tokens), str(out)], cwd=ROOT, env={**os.environ})
            lat: list[float] = []
            rss_peak = rss_before
            with httpx.Client(base_url=r.base, timeout=5) as hc:
                while load.poll() is None:
                    t0 = time.perf_counter()
                    try:
                        ok = hc.get("/health").status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    lat.append((time.perf_counter() - t0) * 1000 if ok else float("inf"))
                    rss_peak = max(rss_peak, rss_mib(pid))
                    time.sleep(0.05)
            load.wait(timeout=60)
            results = orjson.loads(out.read_bytes())
            # recovery: after the load stops, how soon is a request admitted and served
            async with httpx.AsyncClient(base_url=r.base, timeout=None) as c:
                t_end = time.monotonic()
                rec = None
                while time.monotonic() - t_end < 30:
                    o = await send(c, completion_body(prompt(77777, prompt_tokens, "R"), max_tokens=4))
                    if o.kind == "ok":
                        rec = time.monotonic() - t_end
                        break
                    await asyncio.sleep(0.1)
                text = await metrics_text(c)
            rss_after = rss_mib(pid)
    kinds = results["kinds"]
    row.sent, row.answered = results["sent"], results["answered"]
    row.recovery_s = rec
    finite = [v for v in lat if v != float("inf")]
    row.figures.update(kinds=kinds, health_p50_ms=percentile(finite, 50), health_p99_ms=percentile(finite, 99),
                       health_max_ms=max(finite) if finite else None, health_failures=len(lat) - len(finite),
                       health_probes=len(lat), rss_before_mib=rss_before, rss_peak_mib=rss_peak,
                       rss_after_mib=rss_after, rate=rate, capacity=capacity,
                       rejected_slo=metric(text, "kvroute_rejections_total", reason="slo"),
                       ok_ttft_p99_s=results.get("ok_took_p99_s"))
    row.saw = (f"{', '.join(f'{k} {v}' for k, v in kinds.items())}; /health p99 "
               f"{row.figures['health_p99_ms']:.1f} ms; RSS {rss_before:.0f} -> {rss_peak:.0f} MiB peak")
    return row
