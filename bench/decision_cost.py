"""What one routing decision costs in Python, by fleet size, in one process with no network.

A ``Router`` built by ``kvroute simulate``'s own builder (healthy pods that publish KV events,
the default policy, a byte tokenizer; the real clock) routes the same small completion over and over:
``plan`` (tokenize, block keys, index lookup, fleet snapshot, prediction and ranking per pod) then
``book`` and ``finish`` (the ledger, the speculative credit, the metrics). This is the part of a
request's time that grows with the fleet; the HTTP side is ``bench/overhead.py``'s.

    python bench/decision_cost.py [--pods 1,8,32] [--requests 3000] [--repeats 7] [--json PATH]

Each figure is the best of ``--repeats`` timed passes of ``--requests`` decisions (after a warm-up
pass), in microseconds per decision, with the garbage collector off while timing. The last line
printed is the headline.

    python bench/decision_cost.py --prompt-sizes 8000,32000 [--pods 1,8] [--no-events] [--json PATH]

times the decision at real prompt sizes instead (``sized_cost_us``): ``bench/overhead.py``'s
multi-turn chat requests with the real-vLLM tier's tokenizer, replayed in order, the chosen pod's
KV events for each prompt applied between requests (so a follow-up's history is held by events),
medians over the follow-ups and the new conversations of one pass each. With ``--no-events`` the
pods publish no KV events, as ``bench/overhead.py``'s backend, so a follow-up's history is the
router's own credit of the turns before. The last line printed is the headline.

    python bench/decision_cost.py --instructions [--pods 1,32] [--json PATH]

counts the CPU instructions of a decision instead, under valgrind's callgrind (``valgrind`` on the
path; about a minute per fleet size): the script runs itself twice per size with
``PYTHONHASHSEED=0`` and the garbage collector off from the start (a full collection's cost
depends on where in the run it falls), ``SMALL`` and ``LARGE`` decisions (each a warm-up pass and
one timed pass), and the difference of the two totals over the difference in decisions is the
instructions of one decision, start-up excluded. Use it to compare two trees: the same tree's
count repeats closely whatever else the machine does, where the timings above move by up to 40 %
on this machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import commit  # noqa: E402
from router.routing import Router  # noqa: E402
from whatif.simulate import SimConfig, _build_router  # noqa: E402

BODY = {"model": "sim-model", "max_tokens": 16,
        "prompt": "Say hello to the router, please: one two three four five six seven eight nine"}


def build_router(pods: int, events: bool = True) -> Router:
    """``kvroute simulate``'s router for ``pods`` aggregated pods, on the real clock (no objective:
    nothing is rejected). ``events=False``: pods that publish no KV events (approximate in the index,
    credited every routed block for ``approximate_ttl_s``), their KV capacity unknown, as
    ``bench/overhead.py``'s backend is to the router."""
    cfg = SimConfig(pods=pods, objective_s=None)
    if not events:
        from router.config import PodConfig

        cfg.router = {"pods": [PodConfig(id=pid, url=f"http://{pid}.simulated:8000", role=role, model=cfg.model)
                               for pid, role in cfg.pod_ids()]}
    router = _build_router(cfg, cast(Any, time.monotonic))
    if not events:
        for state in router.registry.pods.values():
            state.num_gpu_blocks = None
    return router


def cost_us(pods: int, requests: int, repeats: int) -> float:
    if os.environ.get(NO_GC_ENV):  # --instructions: no collection anywhere, so the counts repeat
        gc.disable()
    router = build_router(pods)
    headers: dict[str, str] = {}

    def one() -> None:
        plan = router.plan("completion", BODY, headers)
        chosen = plan.decision.chosen
        assert chosen is not None, "the decision rejected the request"
        router.finish(router.book(plan, chosen))

    for _ in range(requests):
        one()
    best = float("inf")
    gc.disable()
    try:
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(requests):
                one()
            best = min(best, (time.perf_counter() - started) / requests * 1e6)
    finally:
        gc.enable()
    return best


def sized_cost_us(pods: int, size: int, count: int, events: bool = True) -> dict[str, Any]:
    """The decision for ``bench/overhead.py``'s multi-turn chat requests of about ``size`` tokens (the
    real-vLLM tier's tokenizer), replayed in order as a router meets them: ``plan`` (with the prompt's
    length and block keys, as the tokenize process hands them over), ``book``, and after the engine's
    KV events for the prompt's blocks have reached the index (applied here, not timed, as BlockStored
    from the chosen pod: the next turn finds its history held by events) ``ended``. Medians in
    microseconds over the follow-ups and over the new conversations. ``events=False``: pods without
    KV events (:func:`build_router`), so the history a follow-up finds is the router's own credit."""
    import statistics

    from bench import overhead as ov
    from indexer.events import BlockStored
    from indexer.tokens import HFTokenizer, chat_request_ids
    from router.tokenize_proc import PromptLength

    folder = ov.tier_model()
    if folder is None:
        raise SystemExit(2)
    tok = HFTokenizer(folder)
    reqs, mean = ov.chat_requests(tok, size, count=count, sample=20)
    router = build_router(pods, events)
    bs = router.block_size
    prompts = []
    for raw in reqs:
        body = json.loads(raw.split(b"\r\n\r\n", 1)[1])
        ids = chat_request_ids(body, tok)
        prompts.append((body, ids, router.keys_for(body["model"], ids)))
    took: dict[bool, list[float]] = {True: [], False: []}
    seen: set[int] = set()
    headers: dict[str, str] = {}
    for body, ids, keys in prompts:
        follow_up = bool(keys) and keys[0] in seen  # its system prompt's first block was routed before
        t0 = time.perf_counter()
        plan = router.plan("chat", body, headers, tokens=PromptLength(len(ids)), rest=0, keys=keys)
        chosen = plan.decision.chosen
        assert chosen is not None, "the decision rejected the request"
        booking = router.book(plan, chosen)
        t1 = time.perf_counter()
        n = len(keys)
        if events:
            router.index.apply_event(chosen.pod_id, BlockStored(block_hashes=list(keys), parent_block_hash=None,
                                                                 token_ids=list(ids[:n * bs]), block_size=bs))
        t2 = time.perf_counter()
        router.ended(booking)
        took[follow_up].append((t1 - t0 + time.perf_counter() - t2) * 1e6)
        seen.update(keys[:1])
    held = router.index.match(prompts[-1][2])
    assert max(m.blocks for m in held.values()) == len(prompts[-1][2]), "the prompt is not held in the index"
    return {"pods": pods, "size": size, "events": events, "mean_prompt_tokens": mean, "blocks": len(prompts[-1][2]),
            "follow_ups": len(took[True]), "us_follow_up_median": round(statistics.median(took[True][20:]), 1),
            "us_new_conversation_median": round(statistics.median(took[False]), 1) if took[False] else None}


SMALL, LARGE = 100, 600  # --instructions: decisions per pass of the two runs whose totals are subtracted
NO_GC_ENV = "DECISION_COST_NO_GC"


def instructions(pods: int, requests: int) -> int:
    """Instructions callgrind counts for this script's whole run at ``pods`` and ``requests``."""
    out = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
                          __file__, "--pods", str(pods), "--requests", str(requests), "--repeats", "1"],
                         env={**os.environ, "PYTHONHASHSEED": "0", NO_GC_ENV: "1"}, capture_output=True, text=True,
                         timeout=900)
    found = re.search(r"Collected\s*:\s*(\d+)", out.stderr)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"valgrind failed (rc {out.returncode}): {out.stderr[-500:]}")
    return int(found.group(1))


def count_main(sizes: list[int], json_path: str | None, argv: list[str]) -> int:
    if shutil.which("valgrind") is None:
        print("--instructions needs valgrind (apt-get install valgrind)")
        return 2
    print(f"decision instructions: Python {platform.python_version()}, callgrind, runs of {SMALL} and {LARGE} "
          "decisions per pass (a warm-up and one timed pass each)")
    rows = []
    for n in sizes:
        per = (instructions(n, LARGE) - instructions(n, SMALL)) / (2 * (LARGE - SMALL))
        rows.append({"pods": n, "instructions_per_decision": round(per)})
        print(f"  {n:>3} pods: {per:,.0f} instructions per decision", flush=True)
    per_pod = ((rows[-1]["instructions_per_decision"] - rows[0]["instructions_per_decision"]) / (sizes[-1] - sizes[0])
               if len(rows) > 1 and sizes[-1] != sizes[0] else None)
    if json_path:
        Path(json_path).write_text(json.dumps({
            "command": "python bench/decision_cost.py " + " ".join(argv), "commit": commit(),
            "date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "rows": rows,
            "instructions_per_added_pod": round(per_pod) if per_pod is not None else None}, indent=2) + "\n")
    head = ", ".join(f"{r['pods']} pods {r['instructions_per_decision']:,}" for r in rows)
    print(f"decision instructions: {head}" + (f"; {per_pod:,.0f} per added pod" if per_pod is not None else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", default="1,8,32", help="fleet sizes, comma-separated")
    ap.add_argument("--requests", type=int, default=3000, help="decisions per timed pass")
    ap.add_argument("--repeats", type=int, default=7, help="timed passes; the best is kept")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--no-events", action="store_true",
                    help="with --prompt-sizes: pods without KV events (the router's own credit is the history)")
    ap.add_argument("--instructions", action="store_true",
                    help="count instructions per decision under callgrind instead of timing (slow, repeatable)")
    ap.add_argument("--prompt-sizes", default="",
                    help="instead: the decision for multi-turn chat prompts of these sizes in tokens "
                         "(comma-separated), with the pods' KV events applied between requests")
    args = ap.parse_args(argv)
    sizes = [int(n) for n in args.pods.split(",") if n.strip()]
    if args.prompt_sizes:
        return sized_main(sizes, [int(n) for n in args.prompt_sizes.split(",") if n.strip()], args.json,
                          argv if argv is not None else sys.argv[1:], events=not args.no_events)
    if args.instructions:
        return count_main(sizes, args.json, argv if argv is not None else sys.argv[1:])
    print(f"decision cost: Python {platform.python_version()}, {os.cpu_count()} CPUs, best of {args.repeats} "
          f"passes of {args.requests} decisions")
    rows = []
    for n in sizes:
        us = cost_us(n, args.requests, args.repeats)
        rows.append({"pods": n, "us_per_decision": round(us, 1)})
        print(f"  {n:>3} pods: {us:7.1f} us per decision", flush=True)
    per_pod = ((rows[-1]["us_per_decision"] - rows[0]["us_per_decision"]) / (sizes[-1] - sizes[0])
               if len(rows) > 1 and sizes[-1] != sizes[0] else None)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": "python bench/decision_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "commit": commit(), "date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "rows": rows,
            "us_per_added_pod": round(per_pod, 2) if per_pod is not None else None}, indent=2) + "\n")
    head = ", ".join(f"{r['pods']} pods {r['us_per_decision']:.1f} us" for r in rows)
    print(f"decision cost: {head}" + (f"; {per_pod:.2f} us per added pod" if per_pod is not None else ""))
    return 0


def sized_main(pods: list[int], sizes: list[int], json_path: str | None, argv: list[str], events: bool = True) -> int:
    print(f"decision cost at prompt sizes: Python {platform.python_version()}, {os.cpu_count()} CPUs, medians of "
          "one pass over each size's requests (plan + book + ended; " +
          ("the pods' events applied between)" if events else "pods without KV events)"))
    rows = []
    for size in sizes:
        for n in pods:
            # no more blocks than the index keeps per pod (1M; 600 prompts of 32k tokens would pass it and
            # its cap would drop the oldest conversations' first blocks, which no engine does)
            row = sized_cost_us(n, size, max(100, min(600, 800_000 * 16 // size)), events)
            rows.append(row)
            print(f"  {row['mean_prompt_tokens']:>8,.0f} tokens, {n:>2} pods: {row['us_follow_up_median']:8.1f} us per "
                  f"follow-up, {row['us_new_conversation_median']:8.1f} us per new conversation", flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps({
            "command": "python bench/decision_cost.py " + " ".join(argv), "commit": commit(),
            "date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "rows": rows}, indent=2) + "\n")
    print("decision cost per follow-up: " + ", ".join(
        f"{r['mean_prompt_tokens']:,.0f} tokens at {r['pods']} pods {r['us_follow_up_median']:.0f} us" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
