"""The open-loop sender: requests leave on schedule, streams are timed, a summary comes back.

One scheduler coroutine walks the schedule and starts one task per request at its time; it never
waits for an answer, so a slow target cannot slow the offered load (open loop). Bodies are
encoded before the first send. Each task records how late it left against its schedule; the
summary reports that lateness so a run where the client itself fell behind says so.

HTTP goes through one ``aiohttp.ClientSession`` with no connection cap (a cap below the
concurrency would queue requests inside the client and pass the wait off as server latency) and
no total timeout (long streams are legitimate; ``request_timeout`` bounds silence between reads).
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from replay import arrivals as arrival_mod
from replay import podmetrics
from replay.metrics import RequestRecord, hit_rate_from_metrics, summarize
from replay.payload import PATHS, Endpoint, encode_body
from replay.workloads import RequestSpec

POD_HEADER = "x-kvroute-pod"
SLO_HEADER = "x-slo-ttft-ms"


@dataclass
class RunResult:
    """Per-request records, the summary dict and the configuration the run used."""

    records: list[RequestRecord]
    summary: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self, include_records: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"config": self.config, "summary": self.summary}
        if include_records:
            out["records"] = [r.to_dict() for r in self.records]
        return out


@dataclass(slots=True)
class Progress:
    """A snapshot for progress lines: counts so far and elapsed seconds."""

    elapsed: float
    total: int
    sent: int
    done: int
    in_flight: int
    ok: int
    rejected: int
    errors: int


class RunError(RuntimeError):
    """The run could not start (target unreachable, no model); the message says why."""


def base_url(target: str) -> str:
    """``http://h:p``, ``http://h:p/`` and ``http://h:p/v1`` all mean the same server."""
    url = target.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise RunError(f"target must be an http(s) URL, got {target!r}")
    return url


async def discover_model(session: aiohttp.ClientSession, base: str) -> str:
    """The first model the target lists at ``/v1/models`` (what ``vllm bench serve`` does)."""
    try:
        async with session.get(base + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            data = await resp.read()
            if resp.status != 200:
                raise RunError(f"{base}/v1/models answered {resp.status}; pass --model")
            models = orjson.loads(data).get("data") or []
            if not models:
                raise RunError(f"{base}/v1/models lists no model; pass --model")
            return str(models[0]["id"])
    except (TimeoutError, aiohttp.ClientError, OSError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise RunError(f"cannot list models at {base}/v1/models ({type(exc).__name__}: {exc}); "
                       "is the target up? pass --model to skip this") from exc


async def _warm_up(session: aiohttp.ClientSession, base: str) -> None:
    """One cheap GET before the clock starts, so first-use costs (imports, the first connection)
    are not charged to the first scheduled sends. Failures are ignored: the run will report them."""
    try:
        async with session.get(base + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            await resp.read()
    except (TimeoutError, aiohttp.ClientError, OSError):
        pass


def _token_text(choice: dict[str, Any], chat: bool) -> bool:
    """Whether a streamed choice carries generated output."""
    if chat:
        delta = choice.get("delta") or {}
        return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"))
    return bool(choice.get("text"))


async def _read_stream(resp: aiohttp.ClientResponse, rec: RequestRecord, start: float, chat: bool) -> None:
    """Time the SSE stream: first token, gaps between token chunks, usage, the [DONE] marker."""
    last: float | None = None
    chunks = 0
    usage: dict[str, Any] | None = None
    done = False
    perf = time.perf_counter
    async for line in resp.content:
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            break
        now = perf()
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            rec.error = "bad_sse"
            return
        if not isinstance(data, dict):
            continue
        if "error" in data and not data.get("choices"):
            rec.error = "stream_error"
            return
        choices = data.get("choices") or []
        if choices and isinstance(choices[0], dict) and _token_text(choices[0], chat):
            if last is None:
                rec.ttft = now - start
            else:
                rec.itls.append(now - last)
            last = now
            chunks += 1
        if data.get("usage"):
            usage = data["usage"]
    end = perf()
    rec.e2e = end - start
    if usage:
        rec.output_tokens = int(usage.get("completion_tokens") or chunks)
        details = usage.get("prompt_tokens_details") or {}
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            rec.cached_tokens = int(details["cached_tokens"])
    else:
        rec.output_tokens = chunks
    if not done:
        rec.error = "incomplete"
    elif rec.ttft is None:
        rec.error = "no_tokens"


async def _sleep_until(due: float) -> None:
    """Sleep until ``time.perf_counter() >= due``, neither early nor late by more than the loop allows.

    Linux lets a timed wait overshoot by 0.1 % of its length (3 ms on a 3 s gap between trace
    bursts) and uvloop rounds timers to whole milliseconds (so it can wake early), so long waits
    stop short by 0.2 % + 2 ms and the rest is slept in ever shorter steps until the deadline has
    really passed.
    """
    perf = time.perf_counter
    while True:
        delay = due - perf()
        if delay <= 0:
            return
        await asyncio.sleep(delay * 0.998 - 0.002 if delay > 0.004 else delay)


async def run(target: str | Sequence[str], requests: Sequence[RequestSpec], arrivals: Sequence[float], *,
              endpoint: Endpoint = "completions", model: str | None = None,
              max_concurrency: int | None = None, duration: float | None = None,
              max_requests: int | None = None,
              slo_ttft: float | None = None, slo_tpot: float | None = None, send_slo_header: bool = False,
              pod_metrics: Sequence[str] = (), headers: dict[str, str] | None = None,
              request_timeout: float = 600.0, drain_timeout: float | None = None,
              ignore_eos: bool = True, extra_body: dict[str, Any] | None = None,
              progress: Callable[[Progress], None] | None = None, progress_interval: float = 1.0,
              lateness_warn_ms: float = 10.0, start_delay: float = 0.05,
              config: dict[str, Any] | None = None) -> RunResult:
    """Send ``requests[i]`` at ``arrivals[i]`` seconds after the start (open loop) and measure.

    ``duration`` stops sending at that offset (requests in flight finish, for at most
    ``drain_timeout`` seconds more, after which they are cancelled and counted as errors).
    ``slo_ttft``/``slo_tpot`` are seconds. ``pod_metrics`` are pod base or /metrics URLs whose
    prefix-cache counters give the run's hit rate. Several targets (router replicas behind no load
    balancer of their own) take the requests in turn: request ``i`` goes to target ``i % len``, so
    a conversation's turns land on different replicas, as behind a Service without session affinity.
    """
    n = min(len(requests), len(arrivals))
    specs = list(requests[:n])
    offsets = [float(a) for a in arrivals[:n]]
    if any(b < a for a, b in zip(offsets, offsets[1:])):  # sort before cutting: the cut needs time order
        order = sorted(range(n), key=lambda i: offsets[i])
        specs = [specs[i] for i in order]
        offsets = [offsets[i] for i in order]
    n = arrival_mod.cut(offsets, duration=duration, max_requests=max_requests)
    specs, offsets = specs[:n], offsets[:n]
    bases = [base_url(t) for t in ([target] if isinstance(target, str) else target)]
    if not bases:
        raise RunError("no target given")
    base = bases[0]
    urls = [b + PATHS[endpoint] for b in bases]
    chat = endpoint == "chat"

    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                     skip_auto_headers=("User-Agent",)) as session:
        if model is None:
            model = await discover_model(session, base)
        else:
            await _warm_up(session, base)
        for other in bases[1:]:
            await _warm_up(session, other)
        t_prep = time.perf_counter()
        bodies = [encode_body(s, endpoint=endpoint, model=model, ignore_eos=ignore_eos, extra_body=extra_body)
                  for s in specs]
        prepare_s = time.perf_counter() - t_prep
        hdrs = {"Content-Type": "application/json", "Accept": "text/event-stream", **(headers or {})}
        if send_slo_header and slo_ttft is not None:
            hdrs[SLO_HEADER] = str(int(round(slo_ttft * 1000)))
        records = [RequestRecord(index=s.index, scheduled=o, input_tokens=s.input_len) for s, o in zip(specs, offsets)]
        before = await podmetrics.scrape(session, pod_metrics) if pod_metrics else {}

        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        counts = {"sent": 0, "done": 0, "in_flight": 0, "ok": 0, "rejected": 0, "errors": 0}
        perf = time.perf_counter

        async def send(i: int, due: float) -> None:
            rec = records[i]
            waited = 0.0
            if sem is not None:
                t = perf()
                try:
                    await sem.acquire()
                except asyncio.CancelledError:  # still queued at the drain deadline: a miss
                    rec.error = "cancelled"
                    rec.queue_time = perf() - t
                    raise
                waited = perf() - t
            start = perf()
            rec.queue_time = waited
            rec.sent = start - t0
            rec.lateness = max(0.0, start - due - waited)
            counts["sent"] += 1
            counts["in_flight"] += 1
            try:
                async with session.post(urls[i % len(urls)], data=bodies[i], headers=hdrs) as resp:
                    rec.status = resp.status
                    rec.pod = resp.headers.get(POD_HEADER)
                    if resp.status != 200:
                        detail = await resp.read()
                        rec.error = detail[:200].decode("utf-8", "replace") or f"http_{resp.status}"
                    else:
                        await _read_stream(resp, rec, start, chat)
            except asyncio.CancelledError:
                rec.error = "cancelled"
                if rec.e2e is None:
                    rec.e2e = perf() - start
                raise
            except TimeoutError:
                rec.error = "timeout"
            except aiohttp.ClientPayloadError:
                rec.error = "incomplete"
            except (aiohttp.ClientError, OSError) as exc:
                rec.error = "connection" if rec.status == 0 else f"{type(exc).__name__}"
            except Exception as exc:  # an answer the client cannot read (bad usage, ...) is a miss, never a success
                rec.error = f"bad_response:{type(exc).__name__}"
            finally:
                if sem is not None:
                    sem.release()
                counts["in_flight"] -= 1
                counts["done"] += 1
                if rec.ok:
                    counts["ok"] += 1
                elif rec.status == 429:
                    counts["rejected"] += 1
                else:
                    counts["errors"] += 1

        async def report_progress(progress: Callable[[Progress], None]) -> None:
            while True:
                await asyncio.sleep(progress_interval)
                progress(Progress(perf() - t0, n, counts["sent"], counts["done"], counts["in_flight"],
                                  counts["ok"], counts["rejected"], counts["errors"]))

        tasks: set[asyncio.Task] = set()
        # The bodies and records are long-lived: move them out of the collector's way so that
        # a full collection during the run does not stall the scheduler.
        gc.collect()
        gc.freeze()
        t0 = perf() + start_delay
        reporter = asyncio.create_task(report_progress(progress)) if progress else None
        try:
            for i, offset in enumerate(offsets):
                due = t0 + offset
                await _sleep_until(due)
                task = asyncio.create_task(send(i, due))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                pending = set(tasks)
                _, pending = await asyncio.wait(pending, timeout=drain_timeout)
                for task in pending:
                    task.cancel()
                if pending:
                    await asyncio.gather(*pending, return_exceptions=True)
        finally:
            gc.unfreeze()
            if reporter:
                reporter.cancel()
                await asyncio.gather(reporter, return_exceptions=True)
        ends = [r.sent + r.e2e for r in records if r.sent is not None and r.e2e is not None]
        last_send = max((r.sent for r in records if r.sent is not None), default=0.0)
        run_duration = max(ends + [last_send, 1e-9])
        after = await podmetrics.scrape(session, pod_metrics) if pod_metrics else {}

    summary = summarize(records, duration=run_duration, slo_ttft=slo_ttft, slo_tpot=slo_tpot,
                        lateness_warn_ms=lateness_warn_ms)
    if pod_metrics:
        hits = hit_rate_from_metrics(before, after)
        summary.update(hits)
        summary["pod_metrics_unreachable"] = sorted(set(pod_metrics) - set(after))
    cfg = {"target": base if len(bases) == 1 else bases, "endpoint": endpoint, "model": model, "num_requests": n,
           "max_concurrency": max_concurrency, "duration_limit": duration, "slo_ttft": slo_ttft,
           "slo_tpot": slo_tpot, "send_slo_header": send_slo_header, "pod_metrics": list(pod_metrics),
           "encode_s": prepare_s, "body_bytes": sum(len(b) for b in bodies),
           **(config or {})}
    return RunResult(records, summary, cfg)


def lateness_warning(summary: dict[str, Any]) -> str | None:
    """A loud message when the client could not keep its own schedule."""
    if not summary.get("client_fell_behind"):
        return None
    return (f"WARNING: the client fell behind its schedule (send lateness p99 "
            f"{summary['lateness_p99_ms']:.1f} ms, max {summary['lateness_max_ms']:.1f} ms); the offered load "
            "was lower and burstier than asked, so latencies below are not trustworthy. "
            "Lower the rate or run the client on a less loaded machine.")


def print_warning(summary: dict[str, Any], stream=sys.stderr) -> None:
    msg = lateness_warning(summary)
    if msg:
        bar = "!" * 72
        print(f"{bar}\n{msg}\n{bar}", file=stream)
