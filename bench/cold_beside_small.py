"""Small requests beside cold big prompts, one router setting against another, in alternating rounds.

The last measurement of ``bench/overhead.py --sizes`` (one connection of cold prompts of the largest
size beside one connection of small chat requests) gives one 3-second p99: about 3,500 small
requests, so the p99 is their 35th slowest, and on the 2-core build machine it moved between 2.3
and 7 ms from one run of the same tree to the next. To tell whether a change helps, this runs the
same measurement in rounds, each condition with a fresh ``kvroute serve`` (one process, or
``--workers N``) per round, the conditions alternating, and reports each round's p99 and the p99
over every small request of a condition's rounds together.

    python bench/cold_beside_small.py --condition off:KVROUTE_TOKENIZE_PROCESS_BATCH=false \\
        --condition on: --rounds 8 --json bench/results/cold_beside_small_batch.json

A condition is ``NAME[@TREE]:ENV=VALUE,ENV=VALUE``: the router's settings are environment variables,
and ``@TREE`` runs the router from another checkout of the project (``git worktree add``) for a
change that is not a setting. ``--prefill N`` first sends N other cold prompts (four connections),
so the index is as full as a router's that has run for a while (at its default cap of a million
blocks per pod from about 500 of 32k tokens) and evicts throughout; ``--cap N`` sets
``KVROUTE_INDEX_MAX_BLOCKS_PER_POD`` for all. The last line is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import overhead as ov  # noqa: E402
from bench.provenance import commit, stamp  # noqa: E402
from indexer.tokens import HFTokenizer  # noqa: E402
from simulator.testing import free_port, stop_process, wait_ready  # noqa: E402


def parse_condition(text: str) -> tuple[str, str, dict[str, str]]:
    """``NAME[@TREE]:ENV=VALUE,...`` -> (name, tree, env)."""
    head, _, settings = text.partition(":")
    name, _, tree = head.partition("@")
    env = {}
    for item in filter(None, settings.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--condition {text!r}: want NAME[@TREE]:ENV=VALUE[,ENV=VALUE]")
        env[key] = value
    if tree and not (Path(tree) / "router" / "cli.py").exists():
        raise SystemExit(f"--condition {text!r}: {tree} is not a checkout of this project")
    return name, tree or str(ROOT), env


def tokenizer(given: str | None) -> tuple[Path, HFTokenizer]:
    """``--tokenizer``'s folder, else the real-vLLM tier's model, and the tokenizer loaded from it."""
    folder = Path(given) if given else ov.tier_model()
    if folder is None:
        raise SystemExit("no tokenizer: build the real-vLLM tier's model (make real-vllm) or pass --tokenizer")
    return folder, HFTokenizer(str(folder))


def start_router(tree: str, env: dict[str, str], pods: str, workers: int,
                 tokenizer: Path) -> tuple[int, subprocess.Popen]:
    """``kvroute serve`` from ``tree`` with ``env`` in front of ``pods``, ready and settled for 2 s;
    returns its port and process (stop it with ``stop_process``)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "router.cli", "serve", "--pods", pods, "--log-level", "error",
                             "--workers", str(workers), "--tokenizer", str(tokenizer), "--port", str(port)],
                            cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}/ready", proc, 60.0)
    except BaseException:
        stop_process(proc)
        raise
    time.sleep(2.0)
    return port, proc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--condition", action="append", required=True, help="NAME:ENV=VALUE,... (twice or more)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--workers", type=int, default=1, help="kvroute serve --workers for every condition")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--size", type=int, default=32000, help="tokens of each cold prompt")
    ap.add_argument("--cap", type=int, default=None, help="KVROUTE_INDEX_MAX_BLOCKS_PER_POD for every condition")
    ap.add_argument("--prefill", type=int, default=0, help="other cold prompts sent first, to fill the index")
    ap.add_argument("--tokenizer", default=None, help="default: the real-vLLM tier's model")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    conditions = [parse_condition(c) for c in args.condition]
    folder, tok = tokenizer(args.tokenizer)
    n_big = ov.cold_count(args.size, args.seconds)
    big, _ = ov.chat_requests(tok, args.size, count=n_big, follow_up=0.0, conversations=n_big, seed=7, sample=10)
    small, _ = ov.chat_requests(tok, 20, count=50, seed=8)
    fill: list[bytes] = []
    if args.prefill:
        fill, _ = ov.chat_requests(tok, args.size, count=args.prefill, follow_up=0.0, conversations=args.prefill,
                                   seed=99, sample=10)
    procs: list = []
    results: dict[str, dict] = {name: {"tree": tree, "commit": commit(tree), "env": env, "rounds": [], "latencies": []}
                                for name, tree, env in conditions}
    try:
        _, upstream = ov.start_backend(procs)
        pods = json.dumps([{"id": "pod-0", "url": upstream, "model": "sim-model"}])
        for r in range(args.rounds):
            for name, tree, env in conditions:
                full = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
                if args.cap is not None:
                    full["KVROUTE_INDEX_MAX_BLOCKS_PER_POD"] = str(args.cap)
                port, proc = start_router(tree, full, pods, args.workers, folder)
                try:
                    if fill:
                        filled = itertools.count()
                        asyncio.run(ov.load(port, 4, 0.012 * len(fill), requests=fill, cursor=filled))
                        time.sleep(0.5)
                    m = asyncio.run(ov.mixed(port, args.seconds, big, small, latencies=True))
                finally:
                    stop_process(proc)
                lat = m.pop("small_latencies")
                results[name]["latencies"] += lat
                results[name]["rounds"].append({**m, "small_requests": len(lat)})
                print(f"round {r} {name:<12} small p50 {m['small_p50_ms']:.2f} ms p99 {m['small_p99_ms']:.2f} ms, "
                      f"{m['big_sent']} cold {args.size}-token prompts sent", flush=True)
    finally:
        for p in procs:
            stop_process(p)
    summary = {}
    for name, got in results.items():
        lat = sorted(got.pop("latencies"))
        p99s = [x["small_p99_ms"] for x in got["rounds"]]
        got.update(pooled_small_requests=len(lat),
                   pooled_p50_ms=lat[len(lat) // 2] * 1000 if lat else None,
                   pooled_p99_ms=lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000 if lat else None,
                   pooled_p999_ms=lat[min(len(lat) - 1, int(0.999 * len(lat)))] * 1000 if lat else None,
                   pooled_max_ms=lat[-1] * 1000 if lat else None,
                   median_round_p99_ms=statistics.median(p99s) if p99s else None,
                   big_sent_mean=statistics.fmean(x["big_sent"] for x in got["rounds"]) if p99s else None)
        summary[name] = got
        print(f"{name:<12} p99 by round {', '.join(f'{x:.2f}' for x in sorted(p99s))} ms; over all "
              f"{len(lat)} small requests p50 {got['pooled_p50_ms']:.2f} p99 {got['pooled_p99_ms']:.2f} "
              f"p99.9 {got['pooled_p999_ms']:.2f} max {got['pooled_max_ms']:.1f} ms; "
              f"cold prompts sent {got['big_sent_mean']:.0f} a round")
    if args.json:
        out = {**stamp("cold_beside_small.py"), "size": args.size, "seconds": args.seconds, "rounds": args.rounds,
               "cap": args.cap, "prefill": args.prefill, "cold_distinct": n_big, "conditions": summary}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    print("small-request p99 beside cold prompts, all rounds pooled: " +
          "; ".join(f"{name} {got['pooled_p99_ms']:.2f} ms" for name, got in summary.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
