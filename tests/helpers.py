"""Test helpers shared by every test module: free ports, real processes on loopback, waiting.

Tests start real kvroute processes (``python -m router.cli <subcommand> ...``) on ports they pick,
wait until they answer, and stop them at the end; nothing leaves loopback.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_http(url: str, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers 2xx; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    last: Exception | str | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered:\n{out[-4000:]}")
        try:
            r = httpx.get(url, timeout=1.0)
            if r.status_code < 300:
                return
            last = f"status {r.status_code}"
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout}s: {last}")


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


def stop_process(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the process group, then SIGKILL after ``grace`` seconds."""
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
            proc.wait(timeout=grace)
    if proc.stdout:
        proc.stdout.close()
