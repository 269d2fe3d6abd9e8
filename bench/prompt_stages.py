"""Where a chat request's routing time goes at real sizes, stage by stage, in one process.

The workload is ``bench/overhead.py``'s multi-turn chat requests (90 % follow-ups of an earlier
conversation plus ~300 new tokens) with the real-vLLM tier's tokenizer; each stage is timed over
every request after a warm-up pass, as the router runs it: parse the body, check the chat fields,
render the template, tokenize (through the prefix token cache, warm, as the router asks it: no token
list built), find the cache's chunk ends, compute the block keys (the remembered keys of the
prefix plus the new blocks), look the keys up in a prefix index of 8 pods, and credit them to one pod.
Then the same texts are tokenized once more in their order through a fresh cache, as a router meets
them: the medians of the follow-ups (their new turn) and of the new conversations (all of it).

    python bench/prompt_stages.py [--sizes 8000] [--json bench/results/prompt_stages.json]

The last line printed is the headline.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import overhead as ov  # noqa: E402
from bench.provenance import stamp  # noqa: E402


def measure(tok, size: int) -> tuple[float, dict[str, float], int]:
    """(mean prompt tokens, ms per request by stage, requests) for ``bench/overhead.py``'s chat
    requests of about ``size`` tokens."""
    import orjson

    from indexer.index import PrefixIndex
    from indexer.keys import block_keys, key_seed
    from indexer.prefix_tokens import CachedTokens, PrefixTokenCache, boundaries
    from indexer.tokens import ChatRequest, routing_encoder

    reqs, mean = ov.chat_requests(tok, size)
    raws = [r.split(b"\r\n\r\n", 1)[1] for r in reqs]
    stages: dict[str, float] = {}

    def timed(name: str, fn) -> list:
        fn(0)  # warm
        t0 = time.perf_counter()
        got = [fn(i) for i in range(len(raws))]
        stages[name] = (time.perf_counter() - t0) / len(raws) * 1000
        return got

    bodies = timed("parse the body (orjson)", lambda i: orjson.loads(raws[i]))
    chats = timed("check the chat fields", lambda i: ChatRequest.from_body(bodies[i], "chat", False))
    texts = timed("render the chat template", lambda i: tok.apply_chat_template(
        chats[i].messages, chat_template=chats[i].chat_template, **chats[i].template_kwargs))
    encode = routing_encoder(tok)
    seed = key_seed("sim-model")
    for t in texts:  # the cache learns every conversation once (tokens and keys), as a running router would have
        got = encode(t, False)
        if isinstance(got, CachedTokens):
            got.block_keys(16, seed)
    ids = timed("tokenize (prefix token cache, warm)", lambda i: encode(texts[i], False))
    timed("  of which: find the chunk ends", lambda i: boundaries(texts[i], 256))
    keys = timed("block keys (16-token blocks)", lambda i: ids[i].block_keys(16, seed)
                 if isinstance(ids[i], CachedTokens) else block_keys(ids[i], 16, seed))
    index = PrefixIndex(block_size=16)
    for p in range(8):
        index.add_pod(f"pod-{p}", "sim-model", approximate=True)
    rng = random.Random(0)
    for k in keys:
        index.record_route(f"pod-{rng.randrange(8)}", k)
    timed("index lookup (8 pods)", lambda i: index.match(keys[i]))
    timed("credit the route (speculative)", lambda i: index.record_route("pod-0", keys[i]))
    # the same texts in their order through a fresh cache, as a router meets them: a follow-up
    # tokenizes its new turn, a new conversation all of it (medians; not part of the total above)
    fresh = PrefixTokenCache(tok.prefix_cache._hf, verify_every=0, tiktoken=tok.prefix_cache.twin)
    took: dict[bool, list[float]] = {True: [], False: []}
    for t in texts:
        hits = fresh.stats.hits
        t0 = time.perf_counter()
        fresh.encode_cached(t, False)
        took[fresh.stats.hits > hits].append((time.perf_counter() - t0) * 1000)
    for follow_up, name in ((True, "follow-ups"), (False, "new conversations")):
        if took[follow_up]:
            stages[f"  tokenize in order, {name} (median of {len(took[follow_up])})"] = statistics.median(
                took[follow_up])
    return mean, stages, len(raws)


def main(argv: list[str] | None = None) -> int:
    from indexer.tokens import HFTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8000")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-tiktoken", action="store_true",
                    help="tokenize with the tokenizers library, not tiktoken's twin (the router's tokenize_tiktoken)")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as kvroute serve runs the tokenizer
    folder = ov.tier_model()
    if folder is None:
        return 2
    tok = HFTokenizer(folder)
    cache = tok.cache_prefixes(max_tokens=4_000_000, tiktoken=not args.no_tiktoken)
    print(f"tokenizing with {'tiktoken' if cache.twin else 'tokenizers'} ({cache.twin_reason or 'the same ids'})")
    out: dict = {"tokenizer": str(folder), "tiktoken": cache.twin, "sizes": {}}
    heads = []
    for size in [int(x) for x in args.sizes.split(",") if x.strip()]:
        mean, stages, n = measure(tok, size)
        total = sum(v for k, v in stages.items() if not k.startswith("  "))
        out["sizes"][str(size)] = {"mean_prompt_tokens": mean, "stages_ms": stages, "total_ms": total}
        print(f"chat requests of {mean:,.0f} tokens on average ({n} requests):")
        for name, ms in stages.items():
            print(f"  {name:<40} {ms:7.3f} ms")
        print(f"  {'total':<40} {total:7.3f} ms", flush=True)
        heads.append(f"{mean:,.0f} tokens: {total:.2f} ms of routing work before the HTTP layers")
    if args.json:
        Path(args.json).write_text(json.dumps({**stamp("prompt_stages.py", argv), **out}, indent=2))
    print("; ".join(heads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
