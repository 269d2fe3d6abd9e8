"""What holds kvroute's event loop while cold big prompts and small requests share one process.

``bench/overhead.py --sizes``'s last measurement, one connection of cold prompts of about
``--size`` tokens (the real-vLLM tier's tokenizer) beside one connection of small chat requests,
with a timer around each synchronous step the event loop runs for a request: parsing the body,
``Router.plan`` (for a small request this includes tokenizing it on the spot; a big one is
tokenized in a tokenize thread first) and ``Router.book`` (the ledger and the speculative credit of
the prompt's blocks), and the garbage collector's pauses. A step that runs long holds up every
request that arrives meanwhile. Run twice: as shipped, and with a prompt's whole credit given in
one piece (``CREDIT_NOW_BLOCKS`` raised past any prompt), which is how ``Router.speculate`` worked
before it split the credit.

    python bench/loop_stalls.py [--size 32000] [--seconds 5] [--json bench/results/loop_stalls.json]

Timings are per call, in milliseconds, split into the small requests' and the big ones'. The last
line printed is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import overhead as ov  # noqa: E402
from bench.provenance import stamp  # noqa: E402
from simulator.testing import free_port, spawn, stop_process, wait_ready  # noqa: E402

BIG_KEYS = 300  # a prompt with more block keys than this counts as big


def run_router(out: str, one_piece: bool, argv: list[str]) -> None:
    """``kvroute serve ARGV`` with timers around the loop's steps; writes them to ``out`` at exit."""
    import router.api as api
    import router.routing as routing
    from router.cli import main

    if one_piece:
        routing.CREDIT_NOW_BLOCKS = 1 << 30
    times: dict[str, list[float]] = {}

    def timed(owner, name: str, label) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times.setdefault(label(args, kwargs), []).append((time.perf_counter() - t0) * 1000)

        setattr(owner, name, wrapper)

    timed(api, "_parse", lambda a, k: "parse")
    timed(routing.Router, "plan", lambda a, k: "plan (big)" if k.get("tokens") is not None else "plan (small)")
    timed(routing.Router, "book", lambda a, k: "book (big)" if len(a[1].keys) > BIG_KEYS else "book (small)")
    started: list[float] = []

    def collected(phase: str, info: dict) -> None:  # the garbage collector's pauses hold the loop too
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            times.setdefault(f"gc gen{info['generation']}", []).append((time.perf_counter() - started[0]) * 1000)

    gc.callbacks.append(collected)

    def write(*_: object) -> None:
        Path(out).write_text(json.dumps(times))
        os._exit(0)

    # uvicorn shuts down on SIGTERM and then raises it again with the handler found at start: this one
    signal.signal(signal.SIGTERM, write)
    sys.argv = ["kvroute", *argv]
    main()


def summary(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    n = len(v)
    return {"calls": n, "p50_ms": v[n // 2], "p99_ms": v[min(n - 1, int(n * 0.99))], "max_ms": v[-1],
            "total_ms": sum(v)}


def measure(folder: Path, size: int, seconds: float, one_piece: bool, stats: Path) -> dict:
    from indexer.tokens import HFTokenizer

    tok = HFTokenizer(folder)
    big, mean = ov.chat_requests(tok, size, count=200, follow_up=0.0, conversations=200, seed=7)
    small, _ = ov.chat_requests(tok, 20, count=50, seed=8)
    procs = []
    try:
        _, upstream = ov.start_backend(procs)
        port = free_port()
        pods = json.dumps([{"id": "pod-0", "url": upstream, "model": "sim-model"}])
        cmd = [sys.executable, __file__, "--role", "router", "--stats", str(stats)]
        if one_piece:
            cmd.append("--one-piece")
        proc = spawn(cmd + ["--", "serve", "--pods", pods, "--log-level", "error", "--port", str(port),
                            "--tokenizer", str(folder)])
        procs.append(proc)
        wait_ready(f"http://127.0.0.1:{port}/ready", proc, 60.0)
        time.sleep(2.0)
        mixed = asyncio.run(ov.mixed(port, seconds, big, small))
        stop_process(proc)
    finally:
        for p in procs:
            stop_process(p)
    steps = {name: summary(v) for name, v in sorted(json.loads(stats.read_text()).items())}
    return {"credit": "in one piece" if one_piece else "in pieces (as shipped)", "big_prompt_tokens": mean,
            **mixed, "steps": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=32000)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--tokenizer", default="", help="model folder with tokenizer.json (default: the real tier's)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--stats", default="", help=argparse.SUPPRESS)
    ap.add_argument("--one-piece", action="store_true", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)
    if args.role == "router":
        run_router(args.stats, args.one_piece, [a for a in rest if a != "--"])
        return 0
    from realvllm.engines import RealVLLMUnavailable, find

    try:
        folder = Path(args.tokenizer) if args.tokenizer else find().model
    except RealVLLMUnavailable as exc:
        print(f"{exc}, or pass --tokenizer")
        return 2
    out = {**stamp("loop_stalls.py", argv), "size": args.size, "seconds": args.seconds, "runs": []}
    stats = Path(f"/tmp/kvroute-loop-stalls-{time.time_ns()}.json")
    try:
        for one_piece in (False, True):
            run = measure(folder, args.size, args.seconds, one_piece, stats)
            out["runs"].append(run)
            print(f"credit {run['credit']}: cold {run['big_prompt_tokens']:.0f}-token prompts beside small "
                  f"requests, small p50 {run['small_p50_ms']:.2f} ms p99 {run['small_p99_ms']:.2f} ms")
            for name, s in run["steps"].items():
                print(f"  {name:<14} {s['calls']:>6} calls  p50 {s['p50_ms']:.3f} ms  p99 {s['p99_ms']:.3f} ms  "
                      f"max {s['max_ms']:.3f} ms")
    finally:
        stats.unlink(missing_ok=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    shipped, before = (r["steps"].get("book (big)", {}) for r in out["runs"])
    print(f"booking a cold {args.size}-token prompt holds the event loop p50 {shipped.get('p50_ms', 0):.2f} ms, "
          f"max {shipped.get('max_ms', 0):.2f} ms (in one piece: p50 {before.get('p50_ms', 0):.2f} ms, "
          f"max {before.get('max_ms', 0):.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
