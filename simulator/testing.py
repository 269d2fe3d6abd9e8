"""Small helpers for tests, demos and benchmarks that start simulated pods."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Iterator, Sequence

import httpx


def consecutive_free_ports(n: int, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A base port P such that P..P+n-1 were all free a moment ago (for ``--count`` and event ports)."""
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(20000, 32000 - n)  # below the usual ephemeral range (32768+)
        socks = []
        try:
            for i in range(n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                socks.append(s)
                s.bind((host, base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports found")


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
            while True:
                if proc.poll() is not None:
                    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                    raise RuntimeError(f"kvroute sim exited with {proc.returncode}: {err[-2000:]}")
                try:
                    if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} did not become healthy within {timeout}s")
                time.sleep(0.05)
        yield urls
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        if proc.stderr:
            proc.stderr.close()
