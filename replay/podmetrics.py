"""Reading pods' prefix-cache counters from their Prometheus ``/metrics`` pages."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp

QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"


def metrics_url(url: str) -> str:
    """``http://host:port`` -> ``http://host:port/metrics``; a URL with a path is kept as given."""
    stripped = url.rstrip("/")
    scheme_end = stripped.find("://")
    rest = stripped[scheme_end + 3:] if scheme_end >= 0 else stripped
    return stripped if "/" in rest else stripped + "/metrics"


def parse_prefix_counters(text: str) -> dict[str, float]:
    """Sum of the prefix-cache query and hit counters over all label sets in an exposition page."""
    out = {"queries": 0.0, "hits": 0.0}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        end = brace if 0 <= brace < space or (brace >= 0 and space < 0) else space
        name = line[:end] if end >= 0 else line
        if name not in (QUERIES, HITS):
            continue
        value_part = line[line.rfind("}") + 1:] if brace >= 0 else line[len(name):]
        fields = value_part.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        out["queries" if name == QUERIES else "hits"] += value
    return out


async def scrape(session: aiohttp.ClientSession, urls: Sequence[str],
                 timeout: float = 5.0) -> dict[str, dict[str, float]]:
    """{url: {"queries", "hits"}} for every pod that answered; unreachable pods are left out."""

    async def one(url: str) -> tuple[str, dict[str, float] | None]:
        try:
            async with session.get(metrics_url(url), timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    return url, None
                return url, parse_prefix_counters(await resp.text())
        except (TimeoutError, aiohttp.ClientError, OSError):
            return url, None

    results = await asyncio.gather(*(one(u) for u in urls))
    return {u: v for u, v in results if v is not None}
