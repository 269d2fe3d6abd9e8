"""``kvroute demo``: a few simulated pods and a prompt whose follow-up reuses its prefix.

It shows the effect the router is built on: a pod that already holds a prompt's prefix in its KV
cache answers a follow-up sharing that prefix much sooner (time to first token, TTFT), while another
pod, which has never seen it, pays the full prefill again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Callable

import httpx

from simulator.testing import running_sims

DOCUMENT = ("Section {i}. The KV cache keeps the attention keys and values of every prompt block a pod has "
            "computed, so a later prompt that starts with the same blocks skips their prefill. ")


@dataclass
class Shot:
    label: str
    pod: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


def stream_ttft(client: httpx.Client, url: str, prompt: str, max_tokens: int = 8) -> tuple[float, dict]:
    """Send one streaming completion; return (seconds to the first token, final usage).

    Reuse one ``client``: building an httpx client costs tens of milliseconds (TLS set-up), which
    would otherwise land in the measured TTFT."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    usage: dict = {}
    with client.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
    return (first if first is not None else time.perf_counter() - start), usage


def prefix_cache_demo(urls: list[str], document_sections: int = 40,
                      out: Callable[[str], None] = print) -> list[Shot]:
    """Cold prompt on pod 0, a follow-up sharing its prefix on pod 0 (warm) and on pod 1 (cold)."""
    document = "".join(DOCUMENT.format(i=i) for i in range(document_sections))
    asks = [("cold: first question, pod 0", urls[0], document + "Question: what does the cache keep?"),
            ("warm: follow-up, same pod 0", urls[0], document + "Question: what does a prefix hit skip?")]
    if len(urls) > 1:
        asks.append(("cold: same follow-up, pod 1", urls[1], document + "Question: what does a prefix hit skip?"))
    shots = []
    with httpx.Client(trust_env=False) as client:
        for url in urls[:2]:
            client.get(url + "/health")  # open the connections before timing anything
        for label, url, prompt in asks:
            ttft, usage = stream_ttft(client, url, prompt)
            details = usage.get("prompt_tokens_details") or {}
            shots.append(Shot(label, url, ttft, usage.get("prompt_tokens", 0), details.get("cached_tokens", 0)))
    out(f"{'request':32} {'pod':24} {'prompt tok':>10} {'cached tok':>10} {'TTFT ms':>9}")
    for s in shots:
        out(f"{s.label:32} {s.pod:24} {s.prompt_tokens:>10} {s.cached_tokens:>10} {s.ttft_s * 1000:>9.1f}")
    cold, warm = shots[0], shots[1]
    out(f"prefix-cache hit: {warm.cached_tokens} of {warm.prompt_tokens} prompt tokens reused, "
        f"TTFT {cold.ttft_s * 1000:.0f} ms -> {warm.ttft_s * 1000:.0f} ms "
        f"({cold.ttft_s / max(warm.ttft_s, 1e-6):.1f}x faster)")
    return shots


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvroute demo", description=__doc__.splitlines()[0])
    p.add_argument("--pods", type=int, default=3, help="simulated pods to start (default: 3)")
    p.add_argument("--sections", type=int, default=40,
                   help="length of the shared document, in ~180-token sections (default: 40)")
    args = p.parse_args(argv)
    if args.pods < 1 or args.sections < 1:
        p.error("--pods and --sections must be at least 1")
    print(f"starting {args.pods} simulated vLLM pods (kvroute sim --count {args.pods}) ...", flush=True)
    with running_sims(args.pods) as urls:
        prefix_cache_demo(urls, args.sections)
    return 0


if __name__ == "__main__":
    sys.exit(main())
