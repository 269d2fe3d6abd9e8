"""CPU instructions one ``kvroute serve`` process spends per small completion, over real HTTP.

The timed benches on this 2-core machine move by 20-40 % from run to run, more than most changes to
the request path are worth, so a change there could not be told from noise. This counts instead:
``kvroute serve`` (one process, the overhead bench's configuration: one pod, the static backend of
``bench/overhead.py``) runs under valgrind's callgrind, a client sends it ``SMALL`` and then, in a
second run, ``LARGE`` small completions one after another over one kept-alive connection, and the
difference of the two runs' totals over the difference in requests is what one request costs,
start-up and shut-down excluded. Everything in the router's process counts: uvicorn, the ASGI
layers, kvroute's handler, the decision, the lifecycle and the upstream client, in user space
(callgrind does not see the kernel's side of system calls, so a change that saves system calls
shows only in the timed benches).

    python bench/request_instructions.py [--json PATH]
    python bench/request_instructions.py --stream 32 [--json PATH]

With ``--distinct`` every request has a prompt of its own (its number, then the prompt) where
the default sends one prompt again and again: the default is the count every row of docs/router.md's
table was made with, and it favours paths that a repeated prompt takes (the note of an earlier
credit vouches for its blocks, the index's lookups find them); a fleet's traffic looks more like
``--distinct``.

With ``--stream N`` each completion is streamed as N events (the static backend's, 5 ms apart, so
that each reaches the router in a read of its own, as a pod's tokens do), in runs of
``STREAM_SMALL`` and ``STREAM_LARGE`` requests, and the count is per streamed answer.

The router's background loops (pod health checks, metrics scrapes and the KV-event sources check) run once an hour here
instead of every 0.25-1 s, so that only requests are counted; ``PYTHONHASHSEED=0``. About three
minutes (two runs, each mostly start-up under callgrind). The last line printed is the headline.
Compare two trees by running this file from each (``git worktree add`` the other, copy this file
into it): the router counted is the tree's that the file is in.
"""

from __future__ import annotations

import argparse
import http.client
import json
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import commit as full_commit  # noqa: E402
from simulator.testing import free_port, spawn, stop_process, wait_ready  # noqa: E402

SMALL, LARGE = 200, 1200
STREAM_SMALL, STREAM_LARGE = 40, 240  # --stream: each answer takes ~N x 5 ms
STREAM_GAP_MS = 5.0
SMALL_BODY = {"model": "sim-model", "prompt": "Say hello to the router, please", "max_tokens": 16}


def bodies(body: dict, n: int, distinct: bool) -> list[bytes]:
    """``n`` request bodies: ``body`` every time, or with ``distinct`` its prompt after a number, each
    its own (as a fleet's traffic is: no two prompts alike, so each request's blocks, the first
    included, are new to the index and no note of an earlier credit vouches for them)."""
    if not distinct:
        return [json.dumps(body).encode()] * n
    return [json.dumps({**body, "prompt": f"{i} {body['prompt']}"}).encode() for i in range(n)]


def send(port: int, bodies: list[bytes]) -> None:
    """The requests, one after another, on one kept-alive connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        for body in bodies:
            conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                raise RuntimeError(f"the router answered {resp.status}")
    finally:
        conn.close()


def instructions(upstream: str, requests: int, workdir: Path, body: dict, distinct: bool) -> int:
    """Instructions callgrind counts in one router process's whole run that serves ``requests``."""
    port = free_port()
    log = workdir / f"valgrind-{requests}.log"
    pods = json.dumps([{"id": "pod-0", "url": upstream, "model": "sim-model"}])
    proc = spawn(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", f"--log-file={log}",
                  sys.executable, "-m", "router.cli", "serve", "--port", str(port), "--pods", pods,
                  "--log-level", "error", "--health-interval-s", "3600", "--scrape-interval-s", "3600",
                  "--kv-events-check-interval-s", "3600"],
                 workdir / f"router-{requests}.out", env={"PYTHONHASHSEED": "0"})
    try:
        wait_ready(f"http://127.0.0.1:{port}/ready", proc, 600.0)
        send(port, bodies(body, requests, distinct))
    finally:
        stop_process(proc, grace=120.0)  # callgrind writes its count as the process exits
    found = re.search(r"Collected\s*:\s*(\d+)", log.read_text(errors="replace"))
    if found is None:
        raise RuntimeError(f"no instruction count in {log}: {log.read_text(errors='replace')[-500:]}")
    return int(found.group(1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--stream", type=int, default=0, help="stream each answer as this many events (0: whole)")
    ap.add_argument("--distinct", action="store_true", help="a prompt of its own for every request (default: "
                    "the same one each time, as every count before this option)")
    args = ap.parse_args(argv)
    body = {**SMALL_BODY, **({"max_tokens": args.stream, "stream": True} if args.stream else {})}
    small, large = (STREAM_SMALL, STREAM_LARGE) if args.stream else (SMALL, LARGE)
    what = f"streamed answers of {args.stream} events" if args.stream else "small completions"
    if shutil.which("valgrind") is None:
        print("request_instructions needs valgrind (apt-get install valgrind)")
        return 2
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    print(f"request instructions: Python {platform.python_version()}, callgrind, tree {ROOT} ({commit}), "
          f"runs of {small} and {large} {what}", flush=True)
    backend = spawn([sys.executable, str(ROOT / "bench" / "overhead.py"), "--role", "backend",
                     "--port", str(bport := free_port()), "--stream-gap-ms", str(STREAM_GAP_MS)])
    try:
        upstream = f"http://127.0.0.1:{bport}"
        wait_ready(f"{upstream}/health", backend)
        with tempfile.TemporaryDirectory(prefix="kvroute-request-instructions-") as tmp:
            counts = {n: instructions(upstream, n, Path(tmp), body, args.distinct) for n in (small, large)}
    finally:
        stop_process(backend)
    per = (counts[large] - counts[small]) / (large - small)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": "python bench/request_instructions.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "tree": commit,
            "commit": full_commit(),
            "totals": {str(k): v for k, v in counts.items()},
            "instructions_per_request": round(per), "distinct_prompts": args.distinct,
            **({"stream_events": args.stream} if args.stream else {})},
            indent=2) + "\n")
    one = f"streamed answer of {args.stream} events" if args.stream else "small completion"
    one += " (distinct prompts)" if args.distinct else ""
    print(f"request instructions: {per:,.0f} per {one} (one kvroute process, tree {commit})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
