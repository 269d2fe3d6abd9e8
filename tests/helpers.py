"""Test helpers shared by every test module: free ports, real processes on loopback, waiting.

Tests start real kvroute processes (``python -m router.cli <subcommand> ...``) on ports they pick,
wait until they answer, and stop them at the end; nothing leaves loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from simulator.testing import free_port, stop_process, wait_ready

__all__ = ["ROOT", "free_port", "free_ports", "http", "kvroute_process", "metric", "serve_routes", "stop_process",
           "until", "wait_http"]

ROOT = Path(__file__).resolve().parent.parent


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (``free_port``: none handed out twice in this process)."""
    return [free_port() for _ in range(n)]


@asynccontextmanager
async def serve_routes(*routes):
    """An aiohttp app of ``routes`` (``web.post(path, handler)``, ...) on a free loopback port, in this
    event loop, for the test's duration; yields the port."""
    from aiohttp import web

    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield port
    finally:
        await runner.cleanup()


_HTTP: httpx.Client | None = None


def http() -> httpx.Client:
    """One client for the test process's plain requests (scrapes, debug calls): ``httpx.get`` makes a
    client per call, and each loads the CA bundle (tens of ms of CPU, on a machine already short of it).
    No keep-alive: a connection is never reused after a server's idle timeout closed it."""
    global _HTTP
    if _HTTP is None:
        _HTTP = httpx.Client(timeout=30, trust_env=False, limits=httpx.Limits(max_keepalive_connections=0))
    return _HTTP


def metric(base: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``, read from ``base``/metrics."""
    try:
        text = http().get(base + "/metrics").text
    except httpx.RemoteProtocolError as exc:
        # once in a CI run on a heavily loaded machine a scrape's connection was closed unanswered (the
        # process then went on serving); a scrape is not what these tests test, so it gets one more try,
        # said out loud (the process's log says why, if the listener's bounds closed it)
        print(f"scrape of {base}/metrics failed ({exc}); trying once more")
        text = http().get(base + "/metrics").text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def until(predicate, timeout: float = 5.0, what: str = "condition") -> float:
    """Wait, without blocking the event loop, until ``predicate()`` holds; returns the seconds it took."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def wait_http(url: str, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers 2xx; fail early if ``proc`` exits."""
    wait_ready(url, proc, timeout)


@contextmanager
def kvroute_process(args: list[str], ready_url: str | None = None, timeout: float = 20.0,
                    env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Run ``kvroute ARGS`` as a child process; wait for ``ready_url``; terminate it afterwards."""
    cmd = [sys.executable, "-m", "router.cli", *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        if ready_url:
            wait_http(ready_url, timeout=timeout, proc=proc)
        yield proc
    finally:
        stop_process(proc)


def sse_events(raw: str) -> list[tuple[str, dict]]:
    """``(event name, data)`` of each event of a stream whose every event is an ``event:`` line and a
    ``data:`` line (the Responses API's, the Messages API's)."""
    out = []
    for block in raw.split("\n\n"):
        if not block:
            continue
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), block
        out.append((name_line[len("event: "):], json.loads(data_line[len("data: "):])))
    return out

