"""Starvation: a victim key's latency while an attacker key floods the router with big bodies.

    python bench/starvation.py                        # this tree, about 50 s
    python bench/starvation.py --tree /tmp/old        # the router of another checkout (before/after)
    python bench/starvation.py --json bench/results/starvation.json

One simulated pod, a served router with two API keys: ``victim`` (no limits) and ``attacker``
(50,000 prompt tokens/s, no request limit). The victim sends small completions one after another
(one connection) for ``--seconds``, alone, then while ``--attackers`` connections of a
separate process send 3-8 MB completion bodies as fast as the router takes them (nearly all are
refused with 429: the point is what refusing them costs); ``--rounds`` such pairs, alternated, so
other work on a shared machine weighs on both phases alike. Reported: the victim's p50/p99 latency
in both phases and their ratio (goal: p99 under attack within 2x of p99 without). The last line is
the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import commit, stamp  # noqa: E402
from simulator.testing import free_port, running_sims, stop_process, wait_ready  # noqa: E402

VICTIM, ATTACKER = "sk-victim-0b1c2d", "sk-attacker-9f8e7d"


def _attack(port: int, connections: int, seconds: float, counts) -> None:
    """A flood of 3-8 MB bodies on ``connections`` sockets for ``seconds`` (a separate process)."""
    sizes = [3, 5, 8]
    bodies = []
    for mb in sizes:
        text = "x" * (mb * 1024 * 1024 - 200)
        bodies.append(json.dumps({"model": "sim-model", "prompt": text, "max_tokens": 1}).encode())

    async def one(i: int) -> None:
        deadline = time.monotonic() + seconds
        n = i
        while time.monotonic() < deadline:
            body = bodies[n % len(bodies)]
            n += 1
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
                head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        f"Authorization: Bearer {ATTACKER}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
                writer.write(head.encode())
                writer.write(body)
                drained = asyncio.ensure_future(writer.drain())
                line = await asyncio.wait_for(reader.readline(), 30)
                drained.cancel()
                code = line.split()[1].decode() if len(line.split()) > 1 else "none"
                counts[code] = counts.get(code, 0) + 1
                writer.close()
            except (TimeoutError, OSError):
                counts["error"] = counts.get("error", 0) + 1
                await asyncio.sleep(0.05)

    async def main() -> None:
        await asyncio.gather(*(one(i) for i in range(connections)))

    asyncio.run(main())


async def _victim(base: str, seconds: float) -> list[float]:
    prompt = "The victim asks a small question about its own data. " * 8
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 1}
    out: list[float] = []
    headers = {"Authorization": f"Bearer {VICTIM}"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            async with s.post(base + "/v1/completions", json=body, headers=headers,
                              timeout=aiohttp.ClientTimeout(total=30)) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"victim got {r.status}")
            out.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def run(tree: Path, seconds: float, attackers: int, rounds: int) -> dict:
    with running_sims(1) as urls, tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        cfg = {"port": port, "pods": [{"id": "p0", "url": urls[0], "model": "sim-model"}], "health_interval_s": 0.5,
               "api_keys": [{"key": VICTIM, "name": "victim"},
                            {"key": ATTACKER, "name": "attacker", "prompt_tokens_per_s": 50_000}]}
        path = Path(tmp) / "router.yaml"
        path.write_text(yaml.safe_dump(cfg))
        proc = subprocess.Popen([sys.executable, "-m", "router.cli", "serve", "--config", str(path)], cwd=tree,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(tree)})
        try:
            base = f"http://127.0.0.1:{port}"
            wait_ready(base + "/ready", proc, 30)
            asyncio.run(_victim(base, 2.0))  # warm up
            alone: list[float] = []
            attacked: list[float] = []
            with multiprocessing.Manager() as manager:
                counts = manager.dict()
                # alternate the phases, so a machine shared with other work loads both alike
                for _ in range(rounds):
                    alone += asyncio.run(_victim(base, seconds))
                    attacker = multiprocessing.Process(target=_attack, args=(port, attackers, seconds + 2, counts))
                    attacker.start()
                    time.sleep(1.0)  # the flood is under way
                    attacked += asyncio.run(_victim(base, seconds))
                    attacker.join(seconds + 40)
                    if attacker.is_alive():
                        attacker.terminate()
                    time.sleep(0.5)
                codes = dict(counts)
        finally:
            stop_process(proc)
    result = {
        "tree": str(tree), "commit": commit(tree), "seconds_per_phase": seconds, "rounds": rounds,
        "attack_connections": attackers,
        "alone": {"requests": len(alone), "p50_ms": round(_pct(alone, 0.5), 1), "p99_ms": round(_pct(alone, 0.99), 1),
                  "mean_ms": round(statistics.mean(alone) * 1000, 1)},
        "attacked": {"requests": len(attacked), "p50_ms": round(_pct(attacked, 0.5), 1),
                     "p99_ms": round(_pct(attacked, 0.99), 1), "mean_ms": round(statistics.mean(attacked) * 1000, 1)},
        "attacker_answers": codes,
    }
    result["p99_ratio"] = round(result["attacked"]["p99_ms"] / max(result["alone"]["p99_ms"], 1e-9), 2)
    result["p50_ratio"] = round(result["attacked"]["p50_ms"] / max(result["alone"]["p50_ms"], 1e-9), 2)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default=str(ROOT), help="checkout whose router to run (default: this one)")
    ap.add_argument("--seconds", type=float, default=6.0, help="length of each victim phase")
    ap.add_argument("--rounds", type=int, default=3, help="alone/attacked phase pairs, alternated")
    ap.add_argument("--attackers", type=int, default=4, help="attacker connections")
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args(argv)
    r = run(Path(args.tree).resolve(), args.seconds, args.attackers, args.rounds)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        made = stamp("starvation.py", argv)
        Path(args.json).write_text(json.dumps({"command": made["command"], "date": made["date"], **r}, indent=2) + "\n")
    print(json.dumps(r, indent=2))
    a, b = r["alone"], r["attacked"]
    print(f"victim p50 {a['p50_ms']} -> {b['p50_ms']} ms, p99 {a['p99_ms']} -> {b['p99_ms']} ms under a "
          f"{args.attackers}-connection flood of 3-8 MB bodies ({r['p99_ratio']}x p99; goal <= 2x; attacker got "
          f"{r['attacker_answers']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
