"""Indexer benchmarks: ingest rate, lookup time, memory per block, key computation.

    python bench/index_bench.py [--blocks 1000000] [--quick]

* ingest: BlockStored blocks/s from real msgpack frames (vLLM's exact encoding), decode + apply
  on one core, events of 32 blocks (a 512-token prompt) and of 1 block (decode-time blocks),
  each run twice: "cold" (the process still takes its memory from the OS) and "warm" (a
  long-running router's state, memory already in the allocator's arenas);
* lookup: ``PrefixIndex.match`` for 1k/8k/32k-token prompts across 8 and 64 pods, keys
  precomputed, with every pod holding a different-length prefix of the prompt (the worst case: a
  bisection per pod); key computation is reported separately;
* memory: tracemalloc bytes per indexed block, 1M blocks over 8 pods and over 64 pods.

Prints one figure per line; the last line is the headline.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from indexer import wire  # noqa: E402
from indexer.events import decode_frame  # noqa: E402
from indexer.index import PrefixIndex  # noqa: E402
from indexer.keys import block_keys, key_seed  # noqa: E402

BS = 16
MODEL = "bench-model"


def make_frames(n_blocks: int, blocks_per_event: int, seed: int = 1) -> list[list[bytes]]:
    rng = random.Random(seed)
    frames, seq, h = [], 0, 1
    per_batch = max(1, 32 // blocks_per_event)  # about 32 blocks per batch either way
    made = 0
    while made < n_blocks:
        events = []
        for _ in range(per_batch):
            parent = None if blocks_per_event > 1 or rng.random() < 0.05 or h == 1 else h - 1
            hashes = list(range(h, h + blocks_per_event))
            h += blocks_per_event
            tokens = [rng.randrange(150_000) for _ in range(blocks_per_event * BS)]
            events.append(wire.stored(hashes, parent, tokens, BS, extra_keys=[None] * blocks_per_event,
                                      group_idx=0, kv_cache_spec_kind="full_attention"))
            made += blocks_per_event
        frames.append(wire.frames("kv@pod-0@bench-model", seq, wire.encode_batch(events, ts=time.time())))
        seq += 1
    return frames


def bench_ingest(n_blocks: int, blocks_per_event: int) -> tuple[float, float, float]:
    frames = make_frames(n_blocks, blocks_per_event)
    total = sum(len(ev.block_hashes) for f in frames for ev in decode_frame(f)[2].events)
    gc.collect()
    t0 = time.perf_counter()
    batches = [decode_frame(f)[2] for f in frames]
    t_dec = time.perf_counter() - t0
    ix = PrefixIndex(block_size=BS, max_blocks_per_pod=10 * n_blocks)
    ix.add_pod("pod-0", MODEL)
    t0 = time.perf_counter()
    for b in batches:
        ix.apply_batch("pod-0", b.events)
    t_apply = time.perf_counter() - t0
    assert ix.stats()["blocks_stored"] == total or blocks_per_event == 1
    del batches, ix
    gc.collect()
    ix = PrefixIndex(block_size=BS, max_blocks_per_pod=10 * n_blocks)
    ix.add_pod("pod-0", MODEL)
    t0 = time.perf_counter()
    for f in frames:
        ix.apply_batch("pod-0", decode_frame(f)[2].events)
    t_all = time.perf_counter() - t0
    return total / t_dec, total / t_apply, total / t_all


def bench_lookup(n_pods: int, prompt_tokens: int, reps: int) -> tuple[float, float]:
    rng = random.Random(n_pods)
    tokens = [rng.randrange(150_000) for _ in range(prompt_tokens)]
    seed = key_seed(MODEL)
    keys = block_keys(tokens, BS, seed)
    ix = PrefixIndex(block_size=BS)
    for p in range(n_pods):
        pid = f"pod-{p}"
        ix.add_pod(pid, MODEL)
        depth = len(keys) - p * len(keys) // (2 * n_pods)  # from all blocks down to about half
        ix._add(ix._pods[pid].primary, list(range(depth)), keys[:depth], "GPU")
        # plus unrelated blocks so the dicts are not tiny
        other = block_keys([rng.randrange(150_000) for _ in range(256 * BS)], BS, seed)
        ix._add(ix._pods[pid].primary, list(range(10**6, 10**6 + len(other))), other, "GPU")
    result = ix.match(keys)
    assert result["pod-0"].blocks == len(keys)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ix.match(keys)
        times.append(time.perf_counter() - t0)
    k_times = []
    for _ in range(max(3, reps // 10)):
        t0 = time.perf_counter()
        block_keys(tokens, BS, seed)
        k_times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6, statistics.median(k_times) * 1e6


def bench_memory(n_blocks: int, n_pods: int) -> float:
    rng = random.Random(7)
    seed = key_seed(MODEL)
    per_pod = n_blocks // n_pods
    chunks = []
    for _ in range(n_pods):
        tokens = [rng.randrange(150_000) for _ in range(per_pod * BS)]
        chunks.append(block_keys(tokens, BS, seed))
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    ix = PrefixIndex(block_size=BS, max_blocks_per_pod=per_pod + 1)
    h = 1 << 62
    for p, keys in enumerate(chunks):
        pid = f"pod-{p}"
        ix.add_pod(pid, MODEL)
        src = ix._pods[pid].primary
        for i in range(0, len(keys), 32):  # engine hashes as fresh 64-bit ints, as decoded from the wire
            part = keys[i:i + 32]
            ix._add(src, [h + p * per_pod + i + j for j in range(len(part))], part, "GPU")
    del chunks
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    blocks = ix.stats()["entries"]
    return used / blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1_000_000, help="blocks for the memory measurement")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    ap.add_argument("--json", default="", help="also write the figures, with the command and commit, here")
    args = ap.parse_args()
    out: dict = {"python": sys.version.split()[0], "block_size": BS, "ingest": [], "lookup": [], "memory": []}
    n_ingest = 20_000 if args.quick else 200_000
    reps = 20 if args.quick else 200
    print(f"python {sys.version.split()[0]}, block size {BS}")
    for bpe in (32, 1):
        for run in ("cold", "warm"):  # cold: the process still gets its memory from the OS
            dec, app, both = bench_ingest(n_ingest, bpe)
            print(f"ingest ({run}), {bpe:2d} block(s)/event: decode {dec:,.0f} blocks/s, apply {app:,.0f} blocks/s, "
                  f"decode+apply {both:,.0f} blocks/s")
            out["ingest"].append({"run": run, "blocks_per_event": bpe, "decode_blocks_per_s": dec,
                                  "apply_blocks_per_s": app, "both_blocks_per_s": both})
    headline_lookup = None
    for pods in (8, 64):
        for toks in (1024, 8192, 32768):
            us, key_us = bench_lookup(pods, toks, reps)
            print(f"lookup {toks:6d} tokens x {pods:2d} pods: match {us:7.1f} us (median); "
                  f"computing the {toks // BS} keys {key_us:7.1f} us")
            out["lookup"].append({"tokens": toks, "pods": pods, "match_us": us, "keys_us": key_us})
            if pods == 64 and toks == 32768:
                headline_lookup = us
    mem = {}
    for pods in (8, 64):
        mem[pods] = bench_memory(args.blocks if not args.quick else 100_000, pods)
        print(f"memory: {mem[pods]:.0f} bytes per indexed block ({args.blocks if not args.quick else 100_000:,} "
              f"blocks over {pods} pods, tracemalloc)")
        out["memory"].append({"pods": pods, "blocks": args.blocks if not args.quick else 100_000,
                              "bytes_per_block": mem[pods]})
    dec32, app32, both32 = bench_ingest(n_ingest, 32)
    if args.json:
        import json

        from bench.provenance import stamp
        out["headline"] = {"ingest_blocks_per_s": both32, "lookup_32k_64_pods_us": headline_lookup,
                           "bytes_per_block_8_pods": mem[8]}
        Path(args.json).write_text(json.dumps({**stamp("index_bench.py"), **out}, indent=2))
    print(f"HEADLINE ingest {both32:,.0f} blocks/s (32-block events, decode+apply, warm) | "
          f"32k-token lookup x 64 pods {headline_lookup:.0f} us | {mem[8]:.0f} bytes/block (8 pods)")


if __name__ == "__main__":
    main()
