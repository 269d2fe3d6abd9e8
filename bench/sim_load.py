"""How much load one ``kvroute sim`` process carries: N pods, R req/s of long token-id prompts.

Starts ``kvroute sim --count N`` (seed timing: 20k tok/s, 3000 blocks of 64, as in the routing
benchmark), sends requests at a fixed rate round-robin over the pods for D seconds, and prints the
simulator's CPU use, the client-side latency overhead over the sim's own simulated TTFT, and the
achieved rate. Prompts share a per-conversation prefix so the cache sees hits.

    .venv/bin/python bench/sim_load.py --pods 8 --rate 70 --tokens 8000 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simulator.testing import consecutive_free_ports, cpu_seconds  # noqa: E402


async def run(args) -> None:
    base = consecutive_free_ports(args.pods)
    proc = subprocess.Popen([sys.executable, "-m", "router.cli", "sim", "--port", str(base), "--count", str(args.pods),
                             "--timing", args.timing, "--block-size", "64", "--num-gpu-blocks", "3000",
                             "--prefill-tokens-per-s", "20000", "--decode-s-per-token", "0.005",
                             "--max-model-len", "65536"]
                            + (["--kv-events-port", str(consecutive_free_ports(2 * args.pods))] if args.events else []),
                            cwd=ROOT)
    urls = [f"http://127.0.0.1:{base + i}" for i in range(args.pods)]
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            for _ in range(200):
                try:
                    async with s.get(urls[-1] + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.05)
            rng = random.Random(1)
            prefixes = [[rng.randrange(50000) for _ in range(args.tokens - 500)] for _ in range(32)]
            overhead, ttfts, errors = [], [], 0
            cpu0, t0 = cpu_seconds([proc.pid]), time.monotonic()

            async def one(i: int) -> None:
                nonlocal errors
                prompt = prefixes[i % len(prefixes)] + [rng.randrange(50000) for _ in range(500)]
                start = time.monotonic()
                try:
                    async with s.post(urls[i % len(urls)] + "/v1/completions",
                                      json={"prompt": prompt, "max_tokens": args.max_tokens}) as r:
                        await r.read()
                        if r.status != 200:
                            errors += 1
                            return
                        sim_ttft = float(r.headers["x-sim-ttft-s"])
                        itl = float(r.headers.get("x-sim-decode-s", 0.0))
                        overhead.append(time.monotonic() - start - sim_ttft - itl)
                        ttfts.append(sim_ttft)
                except aiohttp.ClientError:
                    errors += 1

            tasks = []
            n = int(args.rate * args.seconds)
            for i in range(n):
                due = t0 + i / args.rate
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
            elapsed = time.monotonic() - t0
            cpu = cpu_seconds([proc.pid]) - cpu0
        answered = len(overhead)
        # over all requests sent: a failed one counts at infinity
        overhead = sorted(overhead) + [math.inf] * (n - answered)
        ttfts = sorted(ttfts) + [math.inf] * (n - answered)

        def ms(v: float) -> str:
            return f"{v * 1000:.1f} ms" if math.isfinite(v) else "inf (a failure)"

        print(f"pods={args.pods} sent={n} ok={answered} errors={errors} elapsed={elapsed:.1f}s "
              f"achieved={answered / elapsed:.1f} req/s")
        if n:
            print(f"sim TTFT over all sent: p50={ms(ttfts[(n - 1) // 2])}")
            print(f"client overhead over simulated time, over all sent: p50={ms(overhead[(n - 1) // 2])} "
                  f"p99={ms(overhead[min(n - 1, math.ceil(0.99 * n) - 1)])}")
        print(f"sim process CPU: {cpu / elapsed * 100:.0f}% of one core at {answered / elapsed:.1f} req/s "
              f"of {args.tokens}-token prompts")
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pods", type=int, default=8)
    p.add_argument("--rate", type=float, default=70.0)
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timing", choices=["seed", "cost"], default="seed")
    p.add_argument("--events", action="store_true", help="publish KV events (no subscriber)")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
