"""How long the prefix index holds the event loop in one call, once it is full and churning.

A router that has run for a while has a full index: every new prompt's blocks go in and as many old
ones go out, either by the index's own cap (a pod without KV events, credited from the router's
routes) or by the engines' BlockRemoved events (a pod with events). The mean cost of a call hides
the calls that stop everything else: a dict rebuilt at a million entries, or an eviction that walks
every entry evicted before it. This drives ``PrefixIndex`` alone, in one process, with no network,
and reports every call's time:

* ``approximate``: one pod without events, cold prompts of ``--blocks`` blocks (2,057: a 32,913-token
  prompt, the sized bench's 32k row) credited 256 blocks per call (``Router.speculate`` did until 9996da9; 64 now), at
  the index's cap (``--cap``, the default 1M blocks per pod), until three caps' worth went through;
* ``events``: ``--pods`` pods with KV events, each an engine of ``--engine-blocks`` blocks that
  stores each cold prompt (one BlockStored of ``--blocks`` blocks, keys computed from tokens as the
  subscriber does) and removes its oldest prompts' blocks (BlockRemoved) to stay within its size,
  until each engine has turned over three times. All pods' blocks share one any-pod map.

Each scenario also times a ``match`` of the newest prompt after every prompt.

    python bench/index_churn.py [--tree NAME=DIR ...] [--json bench/results/index_churn.json]

Each ``--tree NAME=DIR`` is measured in a process of its own with the indexer of that checkout
(``git worktree add``), on the same prompts, to compare a change with what was there before; the
default is this checkout. The last line printed is the headline: the longest single call per tree.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

PIECE = 256  # blocks per credit call (router.routing.CREDIT_NOW_BLOCKS; the router credits a prompt of over
# 1,024 blocks 64 at a time since 9996da9, LONG_CREDIT_PIECE: kept at 256 so runs compare with the earlier ones)
BS = 16


def summary(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    n = len(s)

    def pct(q: float) -> float:
        return round(s[min(n - 1, int(q * n))], 3)
    return {"calls": n, "mean_ms": round(statistics.fmean(s), 4), "p50_ms": pct(0.5), "p99_ms": pct(0.99),
            "p999_ms": pct(0.999), "max_ms": round(s[-1], 2), "calls_over_5ms": sum(1 for x in s if x > 5.0),
            "total_s": round(sum(s) / 1000, 2)}


def approximate(PrefixIndex, blocks: int, cap: int, rng: random.Random) -> dict:
    ix = PrefixIndex(block_size=BS, max_blocks_per_pod=cap, approximate_ttl_s=1e9)
    ix.add_pod("p", "m", approximate=True)
    credit, match = [], []
    prompts = 3 * cap // blocks + 1
    pc = time.perf_counter
    for _ in range(prompts):
        keys = [rng.getrandbits(64) for _ in range(blocks)]
        for i in range(0, blocks, PIECE):
            t = pc()
            ix.record_route("p", keys[i:i + PIECE])
            credit.append((pc() - t) * 1000)
        t = pc()
        ix.match(keys)
        match.append((pc() - t) * 1000)
    assert ix.match(keys)["p"].blocks == blocks
    return {"prompts": prompts, "predicted_at_end": ix.stats()["predicted_keys"],
            "record_route": summary(credit), "match": summary(match)}


def events(PrefixIndex, BlockStored, BlockRemoved, blocks: int, pods: int, engine_blocks: int,
           rng: random.Random) -> dict:
    ix = PrefixIndex(block_size=BS)
    names = [f"p{i}" for i in range(pods)]
    for p in names:
        ix.add_pod(p, "m")
    held: dict[str, list[list[int]]] = {p: [] for p in names}   # per engine, its prompts' hashes, oldest first
    size = dict.fromkeys(names, 0)
    store, remove, match = [], [], []
    prompts = 3 * engine_blocks // blocks + 1
    pc = time.perf_counter
    filler = [rng.randrange(50_000) for _ in range(blocks * BS)]
    n = 0
    for _ in range(prompts):
        for p in names:
            n += 1
            tokens = [n, n >> 16, *filler[2:]]   # a distinct first block: keys are chained, so all differ
            hashes = [rng.getrandbits(64) for _ in range(blocks)]
            while size[p] + blocks > engine_blocks:
                old = held[p].pop(0)
                ev = BlockRemoved(block_hashes=old[::-1], medium="GPU")
                t = pc()
                ix.apply_event(p, ev)
                remove.append((pc() - t) * 1000)
                size[p] -= len(old)
            ev = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=BS,
                             medium="GPU")
            t = pc()
            ix.apply_event(p, ev)
            store.append((pc() - t) * 1000)
            held[p].append(hashes)
            size[p] += blocks
        t = pc()
        ix.match(ix_keys(ix, p, tokens))
        match.append((pc() - t) * 1000)
    st = ix.stats()
    return {"prompts_per_pod": prompts, "keys_at_end": st["keys"], "entries_at_end": st["entries"],
            "block_stored": summary(store), "block_removed": summary(remove), "match": summary(match)}


def ix_keys(ix, pod: str, tokens: list[int]) -> list[int]:
    from indexer.keys import prompt_keys
    return prompt_keys(tokens, BS, "m")


def measure(a: argparse.Namespace, tree: str) -> dict:
    sys.path.insert(0, tree)
    import indexer.index as mod
    from indexer.events import BlockRemoved, BlockStored
    from indexer.index import PrefixIndex
    out: dict = {"indexer": str(Path(mod.__file__).resolve().parent)}
    gc.freeze()  # as the router does after start-up: the collector's own pauses are not the index's
    t0 = time.perf_counter()
    out["approximate"] = approximate(PrefixIndex, a.blocks, a.cap, random.Random(a.seed))
    out["events"] = events(PrefixIndex, BlockStored, BlockRemoved, a.blocks, a.pods, a.engine_blocks,
                           random.Random(a.seed))
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


ROWS = (("credit 256 blocks (no events)", "approximate", "record_route"),
        ("BlockStored, 2,057 blocks", "events", "block_stored"),
        ("BlockRemoved, 2,057 blocks", "events", "block_removed"),
        ("match, 32k prompt, 4 pods", "events", "match"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="a checkout whose indexer is measured, in a process of its own (repeatable; "
                         "default: this one, as 'this')")
    ap.add_argument("--blocks", type=int, default=2057, help="blocks per cold prompt")
    ap.add_argument("--cap", type=int, default=1_000_000, help="the index's blocks per pod (approximate)")
    ap.add_argument("--pods", type=int, default=4, help="pods with events")
    ap.add_argument("--engine-blocks", type=int, default=400_000, help="each engine's KV blocks (events)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--one", help=argparse.SUPPRESS)   # internal: measure this tree, print JSON
    ap.add_argument("--json", help="write the summary here")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(a, a.one)))
        return
    trees = [t.split("=", 1) for t in a.tree] or [["this", str(Path(__file__).resolve().parent.parent)]]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.provenance import commit

    out: dict = {"command": " ".join(["python", *sys.argv]), "commit": commit(), "blocks": a.blocks, "cap": a.cap,
                 "pods": a.pods,
                 "engine_blocks": a.engine_blocks, "seed": a.seed, "python": sys.version.split()[0], "trees": {}}
    for name, tree in trees:
        args = [sys.executable, __file__, "--one", tree, "--blocks", str(a.blocks), "--cap", str(a.cap),
                "--pods", str(a.pods), "--engine-blocks", str(a.engine_blocks), "--seed", str(a.seed)]
        res = json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)
        out["trees"][name] = {**res, "commit": commit(tree)}
        print(f"{name}: indexer from {res['indexer']}, {res['seconds']} s", flush=True)
    print(f"{'call':34s} " + " ".join(f"{n + ' ' + c:>16s}" for n, _ in trees for c in ("mean", "p99", "max")))
    for label, scen, key in ROWS:
        cells = []
        for name, _ in trees:
            r = out["trees"][name][scen][key]
            cells += [f"{r['mean_ms']:>14.3f}ms", f"{r['p99_ms']:>14.3f}ms", f"{r['max_ms']:>14.1f}ms"]
        print(f"{label:34s} " + " ".join(f"{c:>16s}" for c in cells))
    worst = {name: max(out["trees"][name][s][k]["max_ms"] for _, s, k in ROWS[:3]) for name, _ in trees}
    out["worst_call_ms"] = worst
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    print("headline: longest index call " + ", ".join(f"{n} {w:.1f} ms" for n, w in worst.items()))


if __name__ == "__main__":
    main()
