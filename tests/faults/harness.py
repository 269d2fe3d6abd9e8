"""Real processes on loopback for the fault scenarios: a simulated fleet (``kvroute sim --count N``,
one process that can be killed and restarted on the same ports), a served router (``kvroute serve``
from a YAML file), a sidecar, and clients that classify every answer they get.

Every wait is bounded; every process is stopped at the end.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from simulator.testing import consecutive_free_ports
from tests.helpers import ROOT, free_port, stop_process, wait_http


def _spawn(args: Sequence[str], log_path: Path | None = None) -> subprocess.Popen:
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "router.cli", *args], cwd=ROOT, env=env, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
    if log_path:
        out.close()
    return proc


def kill_hard(proc: subprocess.Popen) -> None:
    """SIGKILL the whole process group (a crash: no goodbye, sockets reset)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


class Sims:
    """``kvroute sim --count N`` on consecutive ports, with KV events (pod i: E+2i, replay E+2i+1)."""

    def __init__(self, count: int, args: Sequence[str] = (), events: bool = True, prefix: str = "sim",
                 model: str = "sim-model") -> None:
        self.count, self.args, self.events, self.prefix, self.model = count, list(args), events, prefix, model
        self.port = consecutive_free_ports(count)
        self.events_base = consecutive_free_ports(2 * count) if events else None
        self.proc: subprocess.Popen | None = None

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.port + i}" for i in range(self.count)]

    def pods(self, **extra: Any) -> list[dict[str, Any]]:
        out = []
        for i, url in enumerate(self.urls):
            pod: dict[str, Any] = {"id": f"{self.prefix}-{i}", "url": url, "model": self.model, **extra}
            if self.events_base is not None:
                e = self.events_base + 2 * i
                pod["kv_events"] = [{"endpoint": f"tcp://127.0.0.1:{e}", "replay": f"tcp://127.0.0.1:{e + 1}"}]
            out.append(pod)
        return out

    def start(self, timeout: float = 30.0) -> Sims:
        args = ["sim", "--port", str(self.port), "--count", str(self.count), "--model", self.model, *self.args]
        if self.events_base is not None:
            args += ["--kv-events-port", str(self.events_base)]
        self.proc = _spawn(args)
        for url in self.urls:
            wait_http(url + "/health", timeout=timeout, proc=self.proc)
        return self

    def kill(self) -> None:
        if self.proc is not None:
            kill_hard(self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def __enter__(self) -> Sims:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class Served:
    """A child process serving HTTP (router or sidecar) from settings written to a YAML file."""

    def __init__(self, command: str, tmp: Path, settings: dict[str, Any], ready_path: str = "/ready") -> None:
        self.command, self.tmp, self.ready_path = command, tmp, ready_path
        self.port = settings.get("port") or free_port()
        self.settings = {**settings, "port": self.port}
        self.config = tmp / f"{command}-{self.port}.yaml"
        self.log = tmp / f"{command}-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> Served:
        self.config.write_text(yaml.safe_dump(self.settings))
        self.proc = _spawn([self.command, "--config", str(self.config)], self.log)
        wait_http(self.base + self.ready_path, timeout=timeout, proc=self.proc)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def __enter__(self) -> Served:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def router(tmp: Path, pods: list[dict[str, Any]], **settings: Any) -> Served:
    base = {"pods": pods, "health_interval_s": 0.5, "health_timeout_s": 0.5, "scrape_interval_s": 0.1,
            "log_level": "warning", "speculative_ttl_s": 0.3}
    return Served("serve", tmp, {**base, **settings})


def rss_mib(pid: int) -> float:
    """Resident memory of a process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def sim_faults(url: str, **faults: Any) -> dict[str, Any]:
    r = httpx.post(url + "/sim/faults", json=faults, timeout=5)
    r.raise_for_status()
    return r.json()


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric_name = head.split("{", 1)[0]
        if metric_name != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


# ---------------------------------------------------------------------------------------------
# clients that say exactly what they saw
# ---------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one request got back. ``kind``: ok, error-event (a 200 stream ending in an error event
    and [DONE]), http-<status>, refused (no connection), reset (connection dropped with no answer),
    truncated (a stream cut without an error event or [DONE]), timeout."""

    kind: str
    status: int | None = None
    pod: str | None = None
    sent_at: float = 0.0
    took_s: float = 0.0
    retry_after: str | None = None
    detail: str = ""

    @property
    def answered(self) -> bool:
        """The client got a well-formed answer: a success, an HTTP error, or an error event + [DONE]."""
        return self.kind == "ok" or self.kind == "error-event" or self.kind.startswith("http-")

    @property
    def clean(self) -> bool:
        """Anything but a silent loss (a truncated stream or a hang). A refused connection is clean:
        the client knows at once that nothing was sent."""
        return self.kind not in ("truncated", "timeout", "reset")


def completion_body(prompt: str, max_tokens: int = 8, stream: bool = True, model: str = "sim-model") -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}


async def send(client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str] | None = None,
               timeout_s: float = 20.0, path: str = "/v1/completions") -> Outcome:
    """POST one request and classify the answer; bounded by ``timeout_s``."""
    t0 = time.monotonic()
    out = Outcome("timeout", sent_at=t0)
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", path, json=body, headers=headers or {}) as r:
                out.status, out.pod = r.status_code, r.headers.get("x-kvroute-pod")
                out.retry_after = r.headers.get("retry-after")
                data = b""
                try:
                    async for chunk in r.aiter_bytes():
                        data += chunk
                except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                    out.kind, out.detail = "truncated", type(exc).__name__
                    return out
                if r.status_code != 200:
                    out.kind = f"http-{r.status_code}"
                    try:
                        err = orjson.loads(data)["error"]
                        assert isinstance(err["message"], str) and err["code"] == r.status_code
                    except Exception:  # noqa: BLE001 - not an OpenAI error: say so
                        out.kind, out.detail = "malformed", data[:200].decode(errors="replace")
                    return out
                if not body.get("stream"):
                    orjson.loads(data)
                    out.kind = "ok"
                    return out
                events = [e for e in data.split(b"\n\n") if e.startswith(b"data: ")]
                if not events or events[-1] != b"data: [DONE]":
                    out.kind = "truncated"
                elif any(e.startswith(b'data: {"error"') for e in events):
                    out.kind = "error-event"
                else:
                    out.kind = "ok"
    except TimeoutError:
        out.kind = "timeout"
    except httpx.ConnectError:
        out.kind = "refused"
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        out.kind, out.detail = "reset", type(exc).__name__
    finally:
        out.took_s = time.monotonic() - t0
    return out


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)

    def kinds(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in self.outcomes:
            out[o.kind] = out.get(o.kind, 0) + 1
        return dict(sorted(out.items()))

    @property
    def sent(self) -> int:
        return len(self.outcomes)

    @property
    def answered(self) -> int:
        return sum(o.answered for o in self.outcomes)

    def saw(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in self.kinds().items())


async def open_loop(base: str, rate: float, duration_s: float, make_body, tally: Tally,
                    headers: dict[str, str] | None = None, timeout_s: float = 20.0,
                    stop: asyncio.Event | None = None) -> None:
    """Send ``rate`` requests per second for ``duration_s`` (open loop: arrivals do not wait for
    answers), each classified into ``tally``."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base, timeout=None, limits=limits) as client:
        tasks = []
        t0 = time.monotonic()
        i = 0
        while True:
            due = t0 + i / rate
            now = time.monotonic()
            if due - t0 >= duration_s or (stop is not None and stop.is_set()):
                break
            if due > now:
                await asyncio.sleep(due - now)
            tasks.append(asyncio.create_task(_record(client, make_body(i), headers, timeout_s, tally)))
            i += 1
        await asyncio.gather(*tasks)


async def _record(client, body, headers, timeout_s, tally: Tally) -> None:
    tally.outcomes.append(await send(client, body, headers, timeout_s))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]
