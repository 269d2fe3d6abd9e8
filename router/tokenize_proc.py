"""Big prompts tokenized in a child process, so their Python work never holds the router's GIL.

A request body of ``tokenize_offload_bytes`` or more is tokenized off the event loop. The tokenizer's
Rust encode lets go of the GIL, but the Python around it does not: rendering the chat template,
finding the chunk ends and hashing chunks and blocks for the prefix token cache, copying ids. For
a cold 32k-token prompt that is about 17 ms of Python, and while a tokenize *thread* runs it every
small request waits for the GIL at each of its awaits. On the build machine (2 cores, one
connection of small chat requests beside one of cold 32k-token prompts, six alternating rounds of
4 s) the small requests' p99 was 4.9-6.3 ms (median 5.7) with the thread and 3.1-4.5 ms (median
3.5) with the same work in a child process; a thread that only slept as long gave 3.2-4.3 ms, so
the process removes what the GIL cost (docs/router.md, "Overhead at real prompt sizes").

**The child.** One process (``multiprocessing`` spawn), started with the router and owning a
tokenizer loaded from the same ``tokenizer`` setting and its own prefix token cache; jobs run one
at a time in it, at most ``MAX_JOBS`` admitted at once. A job sends the parsed body and what keys
the blocks (block size, the model's key seed, adapter, salt) and gets back the prompt's length, the
other prompts' tokens of a completion batch, the block keys packed as 64-bit ints, the tokens
themselves only when the prompt has no full block (the decision needs them then), and the cache's
counters. A prompt the child cannot tokenize (a bad chat request) comes back as the same 400 the
thread would raise.

**When it cannot answer** the request is tokenized in a tokenize thread, as without the process:
while the child starts (the first second or two), after it died (it is started again, at most
once every ``RESTART_AFTER_S``, 5 s) and when a job runs past ``timeout_s`` (the child is killed and
started again, since a job cannot be taken back from it). ``kvroute_tokenize_process_jobs`` counts
the outcomes.

**Chunk sharing.** With workers or replicas on the booking bus, the chunks the child stores come
back with each answer and are published as the router's own; chunks heard from the bus go to the
child as well as to the router's cache (which keeps serving the prompts tokenized on the loop).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.errors import APIError

log = logging.getLogger("kvroute")

MAX_JOBS = 16  # admitted at once; the rest wait their turn (each waits at most ``timeout_s`` in all)
RESTART_AFTER_S = 5.0  # the least time between two starts of the child


@dataclass(frozen=True)
class CacheCounts:
    """The child's prefix token cache, as its last answer left it (for the router's gauges)."""

    reused: int = 0
    tokenized: int = 0
    held: int = 0
    key_hits: int = 0
    key_misses: int = 0
    adopted: int = 0
    disabled: bool = False


@dataclass(frozen=True)
class Answer:
    count: int = 0
    rest: int = 0
    keys: bytes = b""
    tokens: list[int] | None = None  # only for a prompt without a full block
    cache: CacheCounts | None = None
    stored: list[tuple[int, array]] | None = None
    error: tuple[int, str, str | None, Any] | None = None  # an APIError's status, message, param, code


class PromptLength(Sequence[int]):
    """Stands in for a prompt's tokens where only their number is needed (the decision, which keys
    the prompt by its block keys)."""

    __slots__ = ("_n",)

    def __init__(self, n: int):
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        raise TypeError("a prompt tokenized in the tokenize process has only its length and block keys")


# ---- the child's side ----------------------------------------------------------------------------
_tokenizer: Any = None
_stored: list[tuple[int, array]] = []


def _child_start(spec: str, cache_tokens: int, share: bool) -> None:
    global _tokenizer
    from indexer.tokens import HFTokenizer, load_tokenizer

    _tokenizer = load_tokenizer(spec)
    if isinstance(_tokenizer, HFTokenizer) and cache_tokens > 0:
        cache = _tokenizer.cache_prefixes(max_tokens=cache_tokens)
        if share:
            cache.on_stored = _stored.extend


def _child_counts() -> CacheCounts | None:
    cache = getattr(_tokenizer, "prefix_cache", None)
    if cache is None:
        return None
    s = cache.stats
    return CacheCounts(s.reused_tokens, s.tokenized_tokens, cache.held_tokens, s.key_hits, s.key_misses,
                       s.adopted, cache.disabled)


def _child_ping() -> CacheCounts | None:
    return _child_counts()


def _child_tokenize(kind: str, body: dict[str, Any], block_size: int, seed: int, adapter: str | None,
                    salt: str | None, chars_per_token: float) -> Answer:
    from router.costs import batch_rest_tokens
    from router.prompts import prompt_block_keys, prompt_tokens

    try:
        tokens = prompt_tokens(kind, body, _tokenizer)
        rest = batch_rest_tokens(body, _tokenizer.encode, chars_per_token) if kind == "completion" else 0
    except APIError as exc:
        return Answer(error=(exc.status, exc.message, exc.param, exc.code))
    keys = prompt_block_keys(tokens, block_size, seed, adapter, salt)
    stored = _stored[:]
    _stored.clear()
    return Answer(count=len(tokens), rest=rest, keys=array("Q", keys).tobytes(),
                  tokens=None if keys else list(tokens), cache=_child_counts(), stored=stored or None)


def _child_adopt(chunks: list[tuple[int, array]]) -> int:
    cache = getattr(_tokenizer, "prefix_cache", None)
    return cache.adopt(chunks) if cache is not None else 0


# ---- the router's side ---------------------------------------------------------------------------
class TokenizeProcess:
    """The router's handle on the child. ``run`` answers ``(tokens, rest, keys)``, or None when the
    child cannot answer now (the caller tokenizes in a thread instead)."""

    def __init__(self, spec: str, cache_tokens: int, timeout_s: float, share: bool = False,
                 on_stored: Callable[[list[tuple[int, array]]], None] | None = None,
                 restart_after_s: float = RESTART_AFTER_S):
        self.spec = spec
        self.restart_after_s = restart_after_s
        self.cache_tokens = cache_tokens
        self.timeout_s = timeout_s
        self.share = share
        self.on_stored = on_stored
        self.jobs: Counter[str] = Counter()  # done, bad-request, unavailable, busy, failed, timeout
        self.starts = 0
        self.cache: CacheCounts | None = None
        self._pool: ProcessPoolExecutor | None = None
        self._ready = False
        self._started_at = -restart_after_s
        self._slots: asyncio.Semaphore | None = None

    @property
    def ready(self) -> bool:
        return self._ready

    def start(self) -> None:
        """Start the child (it loads its tokenizer meanwhile; ``run`` answers None until it is up)."""
        self._started_at = time.monotonic()
        self.starts += 1
        self._ready = False
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_child_start,
                                   initargs=(self.spec, self.cache_tokens, self.share))
        self._pool = pool

        def up(fut: Any) -> None:
            if self._pool is pool and not fut.cancelled() and fut.exception() is None:
                self._ready = True
                self.cache = fut.result()

        pool.submit(_child_ping).add_done_callback(up)

    def stop(self) -> None:
        pool, self._pool, self._ready = self._pool, None, False
        if pool is None:
            return
        for proc in list(getattr(pool, "_processes", {}).values()):  # a job may be running: do not wait
            proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def _restart_later(self, why: str) -> None:
        log.warning("tokenize process %s: prompts go to the tokenize threads until it is started again", why)
        self.stop()

    async def run(self, kind: str, body: dict[str, Any], block_size: int, seed: int, adapter: str | None,
                  salt: str | None, chars_per_token: float) -> tuple[Sequence[int], int, list[int]] | None:
        if self._pool is None and time.monotonic() - self._started_at >= self.restart_after_s:
            self.start()
        pool = self._pool
        if pool is None or not self._ready:
            self.jobs["unavailable"] += 1
            return None
        if self._slots is None:
            self._slots = asyncio.Semaphore(MAX_JOBS)
        submitted = False
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._slots:
                    job = pool.submit(_child_tokenize, kind, body, block_size, seed, adapter, salt, chars_per_token)
                    submitted = True
                    answer: Answer = await asyncio.wrap_future(job)
        except TimeoutError:
            if not submitted:  # waited that long for a slot: busy, not stuck
                self.jobs["busy"] += 1
                return None
            self.jobs["timeout"] += 1
            if self._pool is pool:
                self._restart_later(f"took over {self.timeout_s:g} s for a prompt")
            return None
        except (BrokenProcessPool, RuntimeError, OSError) as exc:  # it died, or was stopped meanwhile
            self.jobs["failed"] += 1
            if self._pool is pool:
                self._restart_later(f"failed ({type(exc).__name__}: {exc})")
            return None
        if answer.cache is not None:
            self.cache = answer.cache
        if answer.stored and self.on_stored is not None:
            self.on_stored(answer.stored)
        if answer.error is not None:
            self.jobs["bad-request"] += 1
            status, message, param, code = answer.error
            raise APIError(status, message, param=param, code=code)
        self.jobs["done"] += 1
        keys = array("Q")
        keys.frombytes(answer.keys)
        tokens: Sequence[int] = answer.tokens if answer.tokens is not None else PromptLength(answer.count)
        return tokens, answer.rest, keys.tolist()

    def adopt(self, chunks: list[tuple[int, array]]) -> None:
        """Chunks another router process tokenized (the booking bus): the child takes them too."""
        if self._pool is not None:
            try:
                self._pool.submit(_child_adopt, chunks)
            except (BrokenProcessPool, RuntimeError):
                pass  # it is being restarted: the chunks are lost to it, as to a process that was down


class TokenizeProcessCollector(Collector):
    """``kvroute_tokenize_process_jobs{outcome}``, ``_starts`` and ``_up``, read at scrape time."""

    def __init__(self, process: TokenizeProcess):
        self.process = process

    def describe(self):
        return []

    def collect(self):
        p = self.process
        jobs = CounterMetricFamily("kvroute_tokenize_process_jobs", "Large prompts offered to the tokenize process "
                                   "by outcome: done, bad-request (answered 400), and those tokenized in a thread "
                                   "instead: unavailable (starting or restarting), busy, failed, timeout",
                                   labels=["outcome"])
        for outcome in ("done", "bad-request", "unavailable", "busy", "failed", "timeout"):
            jobs.add_metric([outcome], float(p.jobs[outcome]))
        yield jobs
        starts = CounterMetricFamily("kvroute_tokenize_process_starts", "Times the tokenize process was started")
        starts.add_metric([], float(p.starts))
        yield starts
        up = GaugeMetricFamily("kvroute_tokenize_process_up", "1 while the tokenize process answers")
        up.add_metric([], 1.0 if p.ready else 0.0)
        yield up
