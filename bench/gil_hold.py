"""How long big-prompt work in a thread keeps the router's event loop from running.

Part 1: a thread tokenizes one ~35k-token text with each of the Hugging Face tokenizers' calls
while the main thread, sleeping 0.2 ms at a time, records the longest gap between its wake-ups
(what the event loop would feel). Part 2: one kvroute process (the real-vLLM tier's tokenizer)
in front of a static backend, one connection of small chat requests beside one of cold 32k-token
prompts (``bench/overhead.py``'s mixed measurement), at several ``gil_switch_interval_ms``.

    python bench/gil_hold.py [--json bench/results/gil_hold.json]

The last line printed is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import overhead as ov  # noqa: E402
from bench.provenance import stamp  # noqa: E402


def longest_gap_ms(work) -> tuple[float, float]:
    """(the work's own ms, the longest gap in ms the main thread saw while it ran in a thread)."""
    done = threading.Event()
    took: list[float] = []

    def run() -> None:
        t0 = time.perf_counter()
        work()
        took.append((time.perf_counter() - t0) * 1000)
        done.set()

    worst = 0.0
    last = time.perf_counter()
    th = threading.Thread(target=run)
    th.start()
    while not done.is_set():
        now = time.perf_counter()
        worst = max(worst, now - last)
        last = now
        time.sleep(0.0002)
    th.join()
    return took[0], worst * 1000


def main(argv: list[str] | None = None) -> int:
    from tokenizers import Tokenizer

    from indexer.tokens import HFTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--intervals", default="5,1,0.5", help="gil_switch_interval_ms values for part 2")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    folder = ov.tier_model()
    if folder is None:
        return 2
    tk = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    text = " ".join(rng.choice(words) for _ in range(6500))
    out: dict = {"tokenizer": str(folder), "text_tokens": len(tk.encode(text).ids), "calls": {}, "mixed": {}}
    calls = {"encode().ids": lambda: tk.encode(text).ids,
             "encode_batch()[0].ids": lambda: tk.encode_batch([text])[0].ids,
             "encode_batch_fast()[0].ids": lambda: tk.encode_batch_fast([text])[0].ids,
             "encode().offsets": lambda: tk.encode(text).offsets,
             "encode_batch()[0].offsets": lambda: tk.encode_batch([text])[0].offsets}
    print(f"part 1: a {out['text_tokens']}-token text tokenized in a thread; the main thread's longest gap")
    for name, fn in calls.items():
        got = [longest_gap_ms(fn) for _ in range(args.repeats)]
        out["calls"][name] = [{"work_ms": w, "longest_gap_ms": g} for w, g in got]
        print(f"  {name:<28} work {', '.join(f'{w:.1f}' for w, _ in got)} ms   longest gap "
              f"{', '.join(f'{g:.1f}' for _, g in got)} ms", flush=True)

    tok = HFTokenizer(folder)
    big, _ = ov.chat_requests(tok, 32000, count=60, follow_up=0.0, conversations=60, seed=7)
    small, _ = ov.chat_requests(tok, 20, count=50, seed=8)
    procs: list = []
    print(f"part 2: small chat requests beside cold 32k-token prompts, one kvroute process, {args.seconds:g} s each")
    try:
        _, upstream = ov.start_backend(procs)
        pods = json.dumps([{"id": "pod-0", "url": upstream, "model": "sim-model"}])
        for ms in [float(x) for x in args.intervals.split(",") if x.strip()]:
            port = ov.free_port()
            proc = ov.spawn([sys.executable, "-m", "router.cli", "serve", "--pods", pods, "--log-level", "error",
                             "--tokenizer", str(folder), "--gil-switch-interval-ms", str(ms), "--port", str(port)])
            try:
                ov.wait_ready(f"http://127.0.0.1:{port}/ready", proc, 60.0)
                time.sleep(1.5)
                asyncio.run(ov.load(port, 1, 1.0, requests=small))  # warm
                runs = [asyncio.run(ov.mixed(port, args.seconds, big, small)) for _ in range(args.repeats)]
            finally:
                ov.stop_process(proc)
            out["mixed"][str(ms)] = runs
            p99s = ", ".join(f"{r['small_p99_ms']:.1f}" for r in runs)
            bigs = ", ".join(f"{r['big_p50_ms']:.0f}" for r in runs)
            print(f"  gil_switch_interval_ms {ms:<4g} small p99 {p99s} ms  (big p50 {bigs} ms)", flush=True)
    finally:
        for p in procs:
            ov.stop_process(p)
    if args.json:
        Path(args.json).write_text(json.dumps({**stamp("gil_hold.py", argv), **out}, indent=2))
    gaps = {k: max(r["longest_gap_ms"] for r in v) for k, v in out["calls"].items()}
    mixed = {k: max(r["small_p99_ms"] for r in v) for k, v in out["mixed"].items()}
    print("longest loop gap per call: " + ", ".join(f"{k} {v:.1f} ms" for k, v in gaps.items())
          + "; small-request p99 beside cold 32k prompts by switch interval (ms): "
          + ", ".join(f"{k}: {v:.1f}" for k, v in mixed.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
