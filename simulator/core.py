"""The simulated pod's timing arithmetic, free of asyncio, clocks and I/O.

Two models, each a plain synchronous class over a ``BlockPool``:

* ``SeedCore`` ('seed'): one FIFO prefill server at ``prefill_tokens_per_s`` that computes only the
  uncached part of a prompt; the prefix cache (LRU in blocks) is updated when a request is admitted.
  ``admit(req, now)`` returns when its prefill starts and when its first token comes.
* ``CostCore`` ('cost'): vLLM's scheduler in miniature (running requests first, then waiting ones in
  FIFO order within the token budget, ``max_num_seqs`` and free blocks; recompute preemption).
  ``schedule(now)`` builds one step's batch, ``step_cost(batch)`` says how long it lasts and
  ``commit(batch, end, duration)`` applies it at its end.

The caller owns time: ``simulator/engine.py`` drives them from the event loop with real sleeps (a
pod you can send HTTP to) and ``whatif/`` drives the very same classes from a discrete-event loop
in simulated time, so the two never drift apart. What happens around a step (metrics, output
streams, NIXL leases) is left to hooks the engine overrides (``_on_admitted``, ``_on_preempted``,
``_on_prefill_tokens``, ``_on_token``, ``_release_finished``, ``_on_finish``, ``_output_token``).

Both reuse at most ``(prompt_len - 1) // block_size`` cached blocks, as vLLM does (the last prompt
token is always computed to get logits).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from simulator.block_pool import BlockPool


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class CoreRequest(Protocol):
    """What the timing models read and write on a request (``simulator.request.SimRequest`` is one)."""

    prompt: list[int]
    n_prompt: int
    all_tokens: list[int]
    hashes: list[int]
    block_ids: list[int]
    num_computed: int
    num_cached_blocks: int
    num_output: int
    max_tokens: int
    length_capped: bool
    remote_tokens: int
    aborted: bool
    admitted: bool
    keep_blocks: bool
    scheduled_at: float | None
    first_token_at: float | None
    last_token_at: float | None
    finish_reason: str | None
    prefill_compute_s: float
    reads_cache: bool  # False: no prefix-cache or connector hit (vLLM's skip_reading_prefix_cache)

    def extend_hashes(self, full_blocks: int, block_size: int) -> None: ...

    def emit(self, token_id: int, now: float) -> None: ...

    def finish(self, reason: str, now: float) -> None: ...

    @property
    def done_generating(self) -> bool: ...


def max_hit_blocks(hashes: Sequence[int], n_prompt: int, block_size: int) -> int:
    """Cached blocks a prompt may reuse: every full block but the one holding the last prompt token."""
    return min(len(hashes), (n_prompt - 1) // block_size)


def cached_prefix_blocks(pool: BlockPool, hashes: Sequence[int], n_prompt: int, block_size: int) -> int:
    """Leading blocks of a prompt the pool would reuse now (no change to the pool)."""
    return len(pool.match_prefix(hashes[:max_hit_blocks(hashes, n_prompt, block_size)]))


# ---------------------------------------------------------------------------------------------------
# seed: one FIFO prefill server
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SeedParams:
    block_size: int = 16
    prefill_tokens_per_s: float = 20000.0
    decode_s_per_token: float = 0.01

    @classmethod
    def from_settings(cls, s: Any) -> SeedParams:
        return cls(block_size=s.block_size, prefill_tokens_per_s=s.prefill_tokens_per_s,
                   decode_s_per_token=s.decode_s_per_token)


@dataclass(frozen=True, slots=True)
class SeedAdmission:
    """The fate of one request on a seed pod, fixed at admission."""

    hit_tokens: int     # tokens reused from the local prefix cache
    computed: int       # tokens with KV before the prefill (local hit, or KV received over NIXL)
    uncached: int       # tokens the prefill computes
    start: float        # the prefill server starts on it
    first_at: float     # its first token
    compute_s: float    # the prefill's duration

    def token_time(self, i: int, decode_s_per_token: float) -> float:
        """When output token ``i`` (0 = the first) comes."""
        return self.first_at + i * decode_s_per_token


class SeedCore:
    """One FIFO prefill server; the cache is updated when a request is admitted."""

    def __init__(self, pool: BlockPool, params: SeedParams):
        self.pool = pool
        self.params = params
        self.free_at = 0.0  # the prefill server is busy until then

    def admit(self, req: CoreRequest, now: float, slowdown: float = 1.0) -> SeedAdmission:
        """Admit ``req`` at ``now``: touch its cached prefix, cache every other full prompt block (as
        many as fit, evicting the least recently used), and queue its uncached part on the server."""
        bs = self.params.block_size
        pool = self.pool
        hit = pool.match_prefix(req.hashes[:max_hit_blocks(req.hashes, req.n_prompt, bs)]) if req.reads_cache else []
        hit_tokens = len(hit) * bs
        computed = max(hit_tokens, min(req.remote_tokens, req.n_prompt - 1))
        req.admitted = True
        pool.touch(hit)
        full = len(req.hashes)
        new = pool.allocate(min(full - len(hit), pool.num_free)) or []
        parent = req.hashes[len(hit) - 1] if hit else None
        span = slice(len(hit), len(hit) + len(new))
        pool.cache(new, req.hashes[span], parent, req.prompt[span.start * bs:span.stop * bs],
                   salt=getattr(req, "salt", None), lora=getattr(req, "lora", None))
        req.block_ids = hit + new
        if not req.keep_blocks:
            pool.release(req.block_ids)
            req.block_ids = []
        uncached = req.n_prompt - computed
        start = max(now, self.free_at)
        compute = uncached / self.params.prefill_tokens_per_s * slowdown
        req.prefill_compute_s = compute
        self.free_at = start + compute
        return SeedAdmission(hit_tokens=hit_tokens, computed=computed, uncached=uncached, start=start,
                             first_at=start + compute, compute_s=compute)

    def ttft_if_admitted(self, hashes: Sequence[int], n_prompt: int, now: float, slowdown: float = 1.0) -> float:
        """The exact TTFT a request would get if admitted now (nothing changes): perfect knowledge."""
        bs = self.params.block_size
        uncached = n_prompt - cached_prefix_blocks(self.pool, hashes, n_prompt, bs) * bs
        start = max(now, self.free_at)
        return start + uncached / self.params.prefill_tokens_per_s * slowdown - now


# ---------------------------------------------------------------------------------------------------
# cost: batched steps, chunked prefill, token budget
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CostParams:
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    step_overhead_s: float = 0.004
    compute_s_per_token: float = 5e-5
    kv_read_s_per_token: float = 2e-8

    @classmethod
    def from_settings(cls, s: Any) -> CostParams:
        return cls(block_size=s.block_size, max_num_seqs=s.max_num_seqs,
                   max_num_batched_tokens=s.max_num_batched_tokens, step_overhead_s=s.step_overhead_s,
                   compute_s_per_token=s.compute_s_per_token, kv_read_s_per_token=s.kv_read_s_per_token)


Batch = list[tuple[Any, int]]  # (request, tokens it computes in the step)


class CostCore:
    """vLLM's scheduler in miniature over one block pool (see the module docstring)."""

    def __init__(self, pool: BlockPool, params: CostParams):
        self.pool = pool
        self.cost_params = params
        self.waiting: deque[Any] = deque()
        self.running: list[Any] = []

    # --- hooks (the async engine records metrics and streams tokens here) ------------------------
    def _on_admitted(self, req: Any, hit_tokens: int, now: float) -> None:
        """First scheduling of ``req`` (``hit_tokens`` from the local prefix cache)."""

    def _on_preempted(self, req: Any) -> None:
        pass

    def _on_prefill_tokens(self, req: Any, n: int) -> None:
        pass

    def _on_token(self, req: Any, first: bool, last: float | None, now: float) -> None:
        """``req`` got an output token at ``now`` (``last``: its previous token's time)."""

    def _output_token(self, i: int) -> int:
        return 32

    def _release_finished(self, req: Any) -> None:
        self.pool.release(req.block_ids)
        req.block_ids = []

    def _on_finish(self, req: Any, reason: str, now: float) -> None:
        req.finish(reason, now)

    # --- the model ------------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def submit(self, req: Any) -> None:
        self.waiting.append(req)

    def step_cost(self, batch: Batch) -> float:
        p = self.cost_params
        tokens = 0
        resident = 0
        for req, n in batch:
            tokens += n
            resident += req.num_computed + n
        return p.step_overhead_s + p.compute_s_per_token * tokens + p.kv_read_s_per_token * resident

    def _blocks_needed(self, req: Any, n: int) -> int:
        return ceil_div(req.num_computed + n, self.cost_params.block_size) - len(req.block_ids)

    def _preempt(self, req: Any) -> None:
        self.running.remove(req)
        self.pool.release(req.block_ids)
        req.block_ids = []
        req.num_computed = 0
        req.num_cached_blocks = 0
        self.waiting.appendleft(req)
        self._on_preempted(req)

    def _drop(self, req: Any, now: float) -> None:
        """Remove an aborted request and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        self.pool.release(req.block_ids)
        req.block_ids = []
        self._on_finish(req, "abort", now)

    def schedule(self, now: float) -> Batch:
        """One step's batch: running requests first (decode 1 token, prefill the next chunk), then
        waiting ones in FIFO order while budget, ``max_num_seqs`` and free blocks allow."""
        p = self.cost_params
        bs = p.block_size
        pool = self.pool
        budget = p.max_num_batched_tokens
        batch: Batch = []
        in_batch: set[int] = set()

        for req in [r for r in self.running if r.aborted]:
            self._drop(req, now)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(len(req.all_tokens) - req.num_computed, budget)
            need = self._blocks_needed(req, n)
            preempted_self = False
            while need > pool.num_free:
                victim = self.running[-1]
                if id(victim) in in_batch:  # cannot take blocks back from a request already scheduled
                    break
                self._preempt(victim)
                if victim is req:
                    preempted_self = True
                    break
            if preempted_self:
                continue
            if need > pool.num_free:
                break
            if need > 0:
                req.block_ids.extend(pool.allocate(need))
            self._cache_full_blocks(req, req.num_computed + n)
            batch.append((req, n))
            in_batch.add(id(req))
            budget -= n
            i += 1

        waiting = self.waiting
        while waiting and budget > 0 and len(self.running) < p.max_num_seqs:
            req = waiting[0]
            if req.aborted:
                waiting.popleft()
                self._on_finish(req, "abort", now)
                continue
            first_time = not req.admitted
            hit = pool.match_prefix(req.hashes[:max_hit_blocks(req.hashes, req.n_prompt, bs)]) \
                if req.reads_cache else []
            computed = len(hit) * bs
            remote = req.remote_tokens if req.remote_tokens > computed else 0
            start = max(computed, remote)
            n = min(len(req.all_tokens) - start, budget)
            need = ceil_div(start + n, bs) - len(hit)
            if pool.free_after_touch(hit) < need:
                break  # FIFO: the head waits for blocks
            pool.touch(hit)
            new = pool.allocate(need) if need > 0 else []
            req.block_ids = hit + (new or [])
            req.num_cached_blocks = len(hit)
            req.num_computed = start
            # cached as they are scheduled, the KV received from a prefill pod (``remote``) included
            self._cache_full_blocks(req, start + n)
            if first_time:
                req.admitted = True
                req.scheduled_at = now
                self._on_admitted(req, computed, now)
            waiting.popleft()
            self.running.append(req)
            batch.append((req, n))
            in_batch.add(id(req))
            budget -= n
        return batch

    def _cache_full_blocks(self, req: Any, upto: int) -> None:
        """Register the full blocks of ``req``'s first ``upto`` tokens in the prefix cache. Called when a
        step is scheduled, for the tokens it will compute, as vLLM's ``KVCacheManager.allocate_slots``
        does (``cache_blocks`` up to the computed plus the newly scheduled tokens): a request scheduled
        after it in the same step, or in the next one, finds those blocks cached, and the events that
        announce them go out when the step ends (``update_from_output`` publishes them)."""
        bs = self.cost_params.block_size
        full = min(upto, len(req.all_tokens)) // bs
        full = min(full, len(req.block_ids))
        have = req.num_cached_blocks
        if full <= have:
            return
        req.extend_hashes(full, bs)
        parent = req.hashes[have - 1] if have else None
        self.pool.cache(req.block_ids[have:full], req.hashes[have:full], parent,
                        req.all_tokens[have * bs:full * bs], salt=getattr(req, "salt", None),
                        lora=getattr(req, "lora", None))
        req.num_cached_blocks = full

    def commit(self, batch: Batch, now: float, duration: float) -> None:
        """Apply a step that ended at ``now`` and lasted ``duration``."""
        step_tokens = sum(n for _, n in batch)
        for req, n in batch:
            if req.aborted or req.finish_reason is not None:
                continue
            prefill = req.num_computed < req.n_prompt
            req.num_computed += n
            if prefill:
                self._on_prefill_tokens(req, n)
                req.prefill_compute_s += duration * n / step_tokens
            if req.num_computed < len(req.all_tokens):
                continue  # still prefilling (chunked)
            first = req.first_token_at is None
            last = req.last_token_at
            req.emit(self._output_token(req.num_output), now)
            self._on_token(req, first, last, now)
            if req.done_generating:
                self._finish(req, "length" if req.length_capped else "stop", now)

    def _finish(self, req: Any, reason: str, now: float) -> None:
        self.running.remove(req)
        self._release_finished(req)
        self._on_finish(req, reason, now)
