"""Small helpers for tests, demos and benchmarks that start simulated pods, routers and sidecars.

One copy of the process plumbing (free ports, starting a child in its own process group, waiting
until it answers, stopping its whole group) so the tests, ``fleet.trial`` and the ``bench/``
scripts all launch and tear down fleets the same way.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, below the ephemeral range: a port the
    kernel hands out (bind to 0) can be given to some process's outgoing connection before the
    caller binds it (a test pod once failed to start so), and ``consecutive_free_ports`` also never
    hands out the same port twice in one process."""
    return consecutive_free_ports(1)


# Port runs this process has handed out, oldest first. A caller usually picks several runs (a fleet's
# HTTP ports, then its event ports) before any child binds them, so "free a moment ago" alone lets
# the second pick land on the first; a run handed out recently is never handed out again.
_HANDED_OUT: deque[range] = deque(maxlen=512)


def consecutive_free_ports(n: int, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A base port P such that P..P+n-1 were all free a moment ago and overlap no run this process
    handed out recently (for ``--count`` and event ports)."""
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(20000, 32000 - n)  # below the usual ephemeral range (32768+)
        if any(base < r.stop and r.start < base + n for r in _HANDED_OUT):
            continue
        socks = []
        try:
            for i in range(n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                socks.append(s)
                s.bind((host, base + i))
            _HANDED_OUT.append(range(base, base + n))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports found")


def sim_kv_events(events_port: int, index: int, ranks: int = 1) -> list[dict[str, str]]:
    """The ``kv_events`` entries of pod ``index`` of a ``kvroute sim --kv-events-port P --count N`` fleet:
    pod i publishes on P + 2i and answers replay requests on P + 2i + 1; with ``--data-parallel-size R``
    its rank r publishes on P + 2Ri + r and answers replay on P + 2Ri + R + r (one entry per rank)."""
    base = events_port + 2 * ranks * index
    return [{"endpoint": f"tcp://127.0.0.1:{base + r}", "replay": f"tcp://127.0.0.1:{base + ranks + r}"}
            for r in range(ranks)]


def pd_pods(urls: Sequence[str], sidecars: Sequence[str], events_port: int, prefill: int = 2,
            **decode_extra: Any) -> list[dict[str, Any]]:
    """Router pod entries for a P/D fleet: the first ``prefill`` sims are prefill pods, each later one a
    decode pod reached through its sidecar (its metrics still scraped from the pod itself)."""
    pods: list[dict[str, Any]] = []
    for i, url in enumerate(urls):
        ev = sim_kv_events(events_port, i)
        if i < prefill:
            pods.append({"id": f"prefill-{i}", "url": url, "role": "prefill", "kv_events": ev})
        else:
            pods.append({"id": f"decode-{i - prefill}", "url": sidecars[i - prefill], "metrics_url": url,
                         "role": "decode", "kv_events": ev, **decode_extra})
    return pods


def spawn(cmd: Sequence[str], log: Path | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` from the repository root in its own session, so ``stop_process`` can end the whole group.

    Output goes to ``log`` when given; otherwise stdout is dropped and stderr kept in a pipe, for the
    error message should it exit before it is ready.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if log is not None:
        with open(log, "wb") as out:  # the child holds its own descriptor
            return subprocess.Popen(list(cmd), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                    start_new_session=True)
    return subprocess.Popen(list(cmd), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=full_env,
                            start_new_session=True)


def _output_tail(proc: subprocess.Popen | None, log: Path | None, chars: int = 4000) -> str:
    if log is not None:
        return log.read_text(errors="replace")[-chars:]
    pipe = (proc.stdout or proc.stderr) if proc is not None else None
    return pipe.read().decode(errors="replace")[-chars:] if pipe else ""


def wait_ready(url: str, proc: subprocess.Popen | None = None, timeout: float = 30.0, *,
               body: dict[str, Any] | None = None, log: Path | None = None, interval: float = 0.05) -> None:
    """Poll ``url`` (GET, or POST ``body`` as JSON) until it answers 2xx.

    Fails early, with the tail of the process's output (``log`` or its pipe), if ``proc`` exits first;
    raises ``TimeoutError`` with the last answer or error after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered:\n"
                               f"{_output_tail(proc, log)}")
        try:
            r = httpx.request("POST" if body is not None else "GET", url, json=body, trust_env=False,
                              timeout=min(5.0, max(deadline - time.monotonic(), 0.1)))
            if 200 <= r.status_code < 300:
                return
            last = f"status {r.status_code} {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = exc
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    tail = f"; the process's output ends:\n{_output_tail(proc, log)}" if log is not None else ""
    raise TimeoutError(f"{url} did not answer within {timeout:g}s: {last}{tail}")


def stop_process(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the process group, then SIGKILL after ``grace`` seconds; close its pipes."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:  # a process stuck in the kernel can outlive SIGKILL for a while; do not fail over it
                proc.wait(timeout=max(grace, 30.0))
            except subprocess.TimeoutExpired:
                print(f"process {proc.pid} still not reaped 30 s after SIGKILL", file=sys.stderr)
    for pipe in (proc.stdout, proc.stderr):
        if pipe:
            pipe.close()


def process_tree(pids: list[int]) -> list[int]:
    """``pids`` and all their descendants now (Linux ``/proc``; just ``pids`` elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry))
    except OSError:
        return list(pids)
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of ``pids`` so far (their threads included; 0 for one that is gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


@contextmanager
def running_sims(count: int = 1, args: Sequence[str] = (), host: str = "127.0.0.1",
                 timeout: float = 30.0) -> Iterator[list[str]]:
    """Run ``kvroute sim --count N`` as a child process on free ports; yield the pods' base URLs.

    The process is terminated (then killed) on exit. ``args`` are extra ``kvroute sim`` flags.
    """
    base = consecutive_free_ports(count, host)
    cmd = [sys.executable, "-m", "router.cli", "sim", "--host", host, "--port", str(base), "--count", str(count),
           *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    urls = [f"http://{host}:{base + i}" for i in range(count)]
    try:
        deadline = time.monotonic() + timeout
        for url in urls:
            wait_ready(url + "/health", proc, timeout=max(deadline - time.monotonic(), 0.0))
        yield urls
    finally:
        stop_process(proc)
