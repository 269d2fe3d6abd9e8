"""How fast the replay client can send: sustained rate of 10k-token prompts and send lateness.

A fast streaming backend (``replay.fake_backend`` with prompt parsing off, answering at once with
a few tokens) runs in its own process; the client replays ``--rate`` requests/s of
``--prompt-len``-token prompts for ``--seconds`` with constant or Poisson arrivals and reports the
achieved rate and how late sends left against the schedule. The last line is the headline.

    .venv/bin/python bench/replay_client.py [--rate 200] [--seconds 10] [--prompt-len 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from replay import arrivals, runner, workloads  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"backend on port {port} did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="", help="also write the figures, with the command and commit, here")
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--prompt-len", type=int, default=10_000)
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--arrival", choices=["constant", "poisson"], default="poisson")
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="uvloop")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=False,
                        help="client on CPU 0, backend on the other CPUs (less contention between the two)")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    pin = args.pin and len(cpus) >= 2

    port = free_port()
    backend = subprocess.Popen([sys.executable, "-m", "replay.fake_backend", "--port", str(port), "--tokens",
                                str(args.output_tokens), "--no-cache-stats"], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    if pin:
        os.sched_setaffinity(backend.pid, cpus[1:])
        os.sched_setaffinity(0, cpus[:1])
    try:
        wait_port(port)
        n = int(args.rate * args.seconds)
        # 10k-token prompts: 20 shared 8k system prompts, each request its own question.
        sys_len = min(8192, args.prompt_len // 2)
        t = time.perf_counter()
        specs = workloads.shared_prefix(num_groups=20, prompts_per_group=(n + 19) // 20, system_prompt_len=sys_len,
                                        question_len=args.prompt_len - sys_len, output_len=args.output_tokens)[:n]
        offsets = arrivals.schedule(args.arrival, n, rate=args.rate, seed=0)
        build_s = time.perf_counter() - t
        if args.loop == "uvloop":
            import uvloop

            uvloop.install()
        t = time.perf_counter()
        cpu0 = os.times()
        result = asyncio.run(runner.run(f"http://127.0.0.1:{port}", specs, offsets, model="fake-model",
                                        start_delay=0.5))
        wall = time.perf_counter() - t
        cpu1 = os.times()
    finally:
        backend.terminate()
        backend.wait(timeout=10)
    s = result.summary
    sent = [r.sent for r in result.records if r.sent is not None]
    span = max(sent) - min(sent) if sent else 0.0
    achieved = (len(sent) - 1) / span if span > 0 else 0.0
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    body_kb = len(specs[0].prompt_json()) / 1024
    print(f"workload: {n} requests of {args.prompt_len} tokens (~{body_kb:.0f} KiB bodies), "
          f"{args.arrival} at {args.rate:g} req/s; specs built in {build_s:.2f} s, bodies encoded before the "
          f"run in {result.config['encode_s']:.2f} s ({result.config['body_bytes'] / 2**20:.0f} MiB)")
    print(f"completed {s['completed']}/{s['requests']}, errors {s['errors']}, rejected {s['rejected']}")
    print(f"send rate achieved: {achieved:.1f} req/s over {span:.2f} s; run wall {wall:.2f} s; "
          f"client CPU {cpu:.2f} s ({100 * cpu / wall:.0f}% of one core)")
    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v * 1000:.2f} ms"

    print(f"TTFT over all {s['requests']} sent (a failure at infinity): p50 {ms(s['ttft_p50_all'])}, "
          f"p99 {ms(s['ttft_p99_all'])} (fast backend, loopback)")
    print(f"send lateness p50 {s['lateness_p50_ms']:.2f} ms, p99 {s['lateness_p99_ms']:.2f} ms, "
          f"max {s['lateness_max_ms']:.2f} ms")
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average during run {load[0]:.2f} (1 min); other processes "
          "competing for the CPUs raise the lateness tail; "
          + ("client pinned to one CPU, backend to the rest" if pin else "not pinned"))
    if args.json:
        import json

        from bench.provenance import stamp
        Path(args.json).write_text(json.dumps({
            **stamp("replay_client.py"), "requests": s["requests"], "completed": s["completed"],
            "errors": s["errors"], "rejected": s["rejected"], "prompt_len": args.prompt_len, "rate": args.rate,
            "arrival": args.arrival, "loop": args.loop, "pinned": bool(pin), "achieved_rps": achieved,
            "ttft_p50_ms": s["median_ttft_ms"], "ttft_p99_ms": s["p99_ttft_ms"],  # over those answered
            "ttft_p50_all_s": s["ttft_p50_all"], "ttft_p99_all_s": s["ttft_p99_all"],  # over all sent
            "lateness_p50_ms": s["lateness_p50_ms"], "lateness_p99_ms": s["lateness_p99_ms"],
            "lateness_max_ms": s["lateness_max_ms"], "client_cpu_s": cpu, "wall_s": wall,
            "load_average_1m": load[0]}, indent=2))
    print(f"HEADLINE: {achieved:.0f} req/s of {args.prompt_len}-token prompts sustained, "
          f"send lateness p99 {s['lateness_p99_ms']:.2f} ms ({args.loop})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
