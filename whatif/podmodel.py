"""The pods of ``kvroute simulate``: the simulated pod's own timing models, in simulated time.

A ``PodModel`` wraps one of ``simulator/core.py``'s cores (the very classes ``kvroute sim`` runs
behind its HTTP server, so the two cannot drift apart) around a ``BlockPool`` with the simulated
pod's capacity, and turns the pool's changes into the KV events a real pod would publish
(``BlockStored`` when blocks are cached, ``BlockRemoved`` when they are evicted), handed to
``sink`` for the router's prefix index.

* ``seed``: one FIFO prefill server; a request's start and first-token time are fixed when it is
  admitted (``SeedCore.admit``), its cache update too, and its events go out at once.
* ``cost``: batched steps (``CostCore.schedule`` / ``step_cost`` / ``commit``); the discrete-event
  loop calls ``start_step`` when the pod is idle or a step ends, and ``end_step`` at the step's end,
  which reports first tokens and finished requests through ``on_first_token`` / ``on_finish``.

Block hashes are the router's own block keys (``indexer.keys``) continued over output blocks, so
no second hash is computed per block; any injective naming would give the same timings.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from indexer.events import AllBlocksCleared, BlockRemoved, BlockStored
from indexer.keys import block_keys
from simulator.block_pool import BlockPool
from simulator.core import Batch, CostCore, CostParams, SeedAdmission, SeedCore, SeedParams, cached_prefix_blocks

OUTPUT_TOKENS = (464, 2068, 7586, 21831, 18045, 35308, 625, 262, 16931, 3290, 11)  # cycled output ids


@dataclass(frozen=True)
class PodSpec:
    """One simulated pod: the timing model and its knobs (the defaults of ``kvroute sim``)."""

    timing: Literal["seed", "cost"] = "seed"
    block_size: int = 16
    num_gpu_blocks: int = 4096
    # seed
    prefill_tokens_per_s: float = 20000.0
    decode_s_per_token: float = 0.01
    # cost
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    step_overhead_s: float = 0.004
    compute_s_per_token: float = 5e-5
    kv_read_s_per_token: float = 2e-8
    # NIXL link between a prefill and a decode pod (P/D)
    kv_bytes_per_token: int = 131072
    link_bandwidth_bytes_per_s: float = 25e9
    link_latency_s: float = 0.001

    def seed_params(self) -> SeedParams:
        return SeedParams(block_size=self.block_size, prefill_tokens_per_s=self.prefill_tokens_per_s,
                          decode_s_per_token=self.decode_s_per_token)

    def cost_params(self) -> CostParams:
        return CostParams(block_size=self.block_size, max_num_seqs=self.max_num_seqs,
                          max_num_batched_tokens=self.max_num_batched_tokens, step_overhead_s=self.step_overhead_s,
                          compute_s_per_token=self.compute_s_per_token, kv_read_s_per_token=self.kv_read_s_per_token)

    @property
    def prefill_rate(self) -> float:
        """Prefill tokens per second (the router's prior for this pod)."""
        if self.timing == "seed":
            return self.prefill_tokens_per_s
        return 1.0 / self.compute_s_per_token if self.compute_s_per_token > 0 else 1e9


class ModelRequest:
    """A request inside a ``PodModel``: what ``simulator.core.CoreRequest`` needs, nothing more."""

    __slots__ = ("index", "prompt", "n_prompt", "all_tokens", "hashes", "block_ids", "num_computed",
                 "num_cached_blocks", "num_output", "max_tokens", "length_capped", "remote_tokens", "aborted",
                 "admitted", "keep_blocks", "scheduled_at", "first_token_at", "last_token_at", "finish_reason",
                 "finished_at", "prefill_compute_s", "arrival", "hit_tokens", "tag", "reads_cache")

    def __init__(self, index: int, prompt: list[int], hashes: list[int], max_tokens: int, arrival: float,
                 tag: Any = None):
        self.index = index
        self.prompt = prompt
        self.n_prompt = len(prompt)
        self.all_tokens = list(prompt)
        self.hashes = list(hashes)
        self.block_ids: list[int] = []
        self.num_computed = 0
        self.num_cached_blocks = 0
        self.num_output = 0
        self.reads_cache = True  # replayed traces ask for no prompt logprobs
        self.max_tokens = max(1, max_tokens)
        self.length_capped = True
        self.remote_tokens = 0
        self.aborted = False
        self.admitted = False
        self.keep_blocks = False
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finish_reason: str | None = None
        self.finished_at: float | None = None
        self.prefill_compute_s = 0.0
        self.arrival = arrival
        self.hit_tokens = 0
        self.tag = tag  # the simulation's own handle (its booking, its record)

    def extend_hashes(self, full_blocks: int, block_size: int) -> None:
        have = len(self.hashes)
        if full_blocks <= have:
            return
        seed = self.hashes[-1] if self.hashes else 0
        self.hashes.extend(block_keys(self.all_tokens[have * block_size:full_blocks * block_size], block_size, seed))

    def emit(self, token_id: int, now: float) -> None:
        self.all_tokens.append(token_id)
        self.num_output += 1
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now

    def finish(self, reason: str, now: float) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.finished_at = now

    @property
    def done_generating(self) -> bool:
        return self.num_output >= self.max_tokens


class _CostPodCore(CostCore):
    def __init__(self, pool: BlockPool, params: CostParams, owner: PodModel):
        super().__init__(pool, params)
        self.owner = owner

    def _on_admitted(self, req: Any, hit_tokens: int, now: float) -> None:
        req.hit_tokens = hit_tokens
        self.owner.count_prefix(req.n_prompt, hit_tokens)

    def _output_token(self, i: int) -> int:
        return OUTPUT_TOKENS[i % len(OUTPUT_TOKENS)]

    def _on_token(self, req: Any, first: bool, last: float | None, now: float) -> None:
        if first:
            self.owner.first_tokens.append(req)

    def _release_finished(self, req: Any) -> None:
        if not req.keep_blocks:  # a P/D prefill leg keeps its blocks leased until they are read
            super()._release_finished(req)

    def _on_finish(self, req: Any, reason: str, now: float) -> None:
        req.finish(reason, now)
        self.owner.finished.append(req)


class PodModel:
    """One simulated pod in simulated time (see the module docstring)."""

    def __init__(self, pod_id: str, spec: PodSpec, sink: Callable[[str, list[Any]], None]):
        self.pod_id = pod_id
        self.spec = spec
        self.block_size = spec.block_size
        self._sink = sink
        self._pending: list[Any] = []
        self.pool = BlockPool(spec.num_gpu_blocks, spec.block_size, self._on_pool_event)
        self.queries = 0  # prompt tokens looked up (vllm:prefix_cache_queries)
        self.hits = 0     # of which found cached (vllm:prefix_cache_hits)
        self.seed: SeedCore | None = None
        self.cost: _CostPodCore | None = None
        if spec.timing == "seed":
            self.seed = SeedCore(self.pool, spec.seed_params())
        else:
            self.cost = _CostPodCore(self.pool, spec.cost_params(), self)
        # seed: (start, end of decode) of the requests admitted, for the scraped waiting/running
        self._spans: list[tuple[float, float]] = []
        # cost: the step in progress
        self.batch: Batch = []
        self.step_duration = 0.0
        self.busy_until = 0.0
        self.stepping = False
        self.first_tokens: list[ModelRequest] = []
        self.finished: list[ModelRequest] = []

    # --- events ------------------------------------------------------------------------------
    def _on_pool_event(self, ev: tuple[Any, ...]) -> None:
        kind = ev[0]
        if kind == "stored":
            self._pending.append(BlockStored(block_hashes=list(ev[1]), parent_block_hash=ev[2],
                                             token_ids=list(ev[3]), block_size=self.block_size))
        elif kind == "removed":
            self._pending.append(BlockRemoved(block_hashes=list(ev[1])))
        else:
            self._pending.append(AllBlocksCleared())

    def flush_events(self) -> None:
        if self._pending:
            events, self._pending = self._pending, []
            self._sink(self.pod_id, events)

    def count_prefix(self, n_prompt: int, hit_tokens: int) -> None:
        self.queries += n_prompt
        self.hits += hit_tokens

    def fits(self, tokens: int) -> bool:
        """Whether a request of ``tokens`` tokens (prompt and output) fits this pod's KV cache at all."""
        return -(-tokens // self.block_size) <= self.spec.num_gpu_blocks

    # --- seed --------------------------------------------------------------------------------
    def admit_seed(self, req: ModelRequest, now: float) -> SeedAdmission:
        assert self.seed is not None
        adm = self.seed.admit(req, now)
        req.hit_tokens = adm.hit_tokens
        self.count_prefix(req.n_prompt, adm.hit_tokens)
        req.scheduled_at = adm.start
        req.first_token_at = adm.first_at
        self._spans.append((adm.start, adm.first_at + (req.max_tokens - 1) * self.spec.decode_s_per_token))
        self.flush_events()
        return adm

    # --- cost --------------------------------------------------------------------------------
    def submit_cost(self, req: ModelRequest) -> None:
        assert self.cost is not None
        self.cost.submit(req)

    def start_step(self, now: float) -> float | None:
        """Schedule the next step at ``now``; its end time, or None when there is nothing to run."""
        assert self.cost is not None
        batch = self.cost.schedule(now)
        if not batch:  # otherwise the step's events go out when it ends, as vLLM publishes them
            self.flush_events()
            self.stepping = False
            return None
        self.batch = batch
        self.step_duration = self.cost.step_cost(batch)
        self.busy_until = now + self.step_duration
        self.stepping = True
        return self.busy_until

    def end_step(self, now: float) -> tuple[list[ModelRequest], list[ModelRequest]]:
        """Apply the step ending at ``now``; (requests that got their first token, requests finished)."""
        assert self.cost is not None
        self.first_tokens, self.finished = [], []
        self.cost.commit(self.batch, now, self.step_duration)
        self.batch = []
        self.flush_events()
        return self.first_tokens, self.finished

    # --- what the router scrapes ----------------------------------------------------------------
    def load(self, now: float) -> tuple[int, int, float]:
        """(waiting, running, KV usage) as the pod's /metrics would say at ``now``."""
        if self.cost is not None:
            return len(self.cost.waiting), len(self.cost.running), self.pool.usage()
        self._spans = [s for s in self._spans if s[1] > now]
        waiting = sum(1 for s in self._spans if s[0] > now)
        return waiting, len(self._spans) - waiting, self.pool.usage()

    # --- perfect knowledge (the oracle policy) -------------------------------------------------
    def cached_blocks(self, hashes: Sequence[int], n_prompt: int) -> int:
        return cached_prefix_blocks(self.pool, hashes, n_prompt, self.block_size)

    def true_ttft(self, hashes: Sequence[int], n_prompt: int, now: float) -> float:
        """The TTFT a request would get here if sent now, from the pod's true queue and cache.

        Exact for ``seed`` (the FIFO server's schedule is fixed at admission). For ``cost`` a copy of
        the pod stepped forward (``_forward_ttft``): exact if nothing arrives after the request.
        """
        if self.seed is not None:
            return self.seed.ttft_if_admitted(hashes, n_prompt, now)
        return self._forward_ttft(hashes, n_prompt, now)

    def _forward_ttft(self, hashes: Sequence[int], n_prompt: int, now: float) -> float:
        """``cost``: a copy of this pod (its block pool, its running and waiting requests) stepped
        forward by ``CostCore`` itself with this request appended, until its first token: the TTFT it
        gets if nothing arrives after it. Later arrivals queue behind it, but the step that completes
        its prefill gives them its unused budget, which makes that step longer."""
        assert self.cost is not None
        pool = self.pool.copy()
        core = _ForwardCore(pool, self.cost.cost_params)
        twins: dict[int, ModelRequest] = {}

        def twin(r: ModelRequest) -> ModelRequest:
            c = copy.copy(r)
            c.all_tokens, c.hashes, c.block_ids, c.tag = list(r.all_tokens), list(r.hashes), list(r.block_ids), None
            twins[id(r)] = c
            return c

        core.running = [twin(r) for r in self.cost.running]
        core.waiting = deque(twin(r) for r in self.cost.waiting)
        t = now
        if self.stepping and self.batch:  # the step in progress ends first (stepping, no batch: one starts now)
            t = self.busy_until
            core.commit([(twins[id(r)], n) for r, n in self.batch], t, self.step_duration)
        target = ModelRequest(-1, [0] * n_prompt, list(hashes), 1, now)  # token ids only name output blocks
        core.submit(target)
        while target.first_token_at is None:
            batch = core.schedule(t)
            if not batch:  # nothing can run: blocks that never free up
                return math.inf
            duration = core.step_cost(batch)
            t += duration
            core.commit(batch, t, duration)
        return target.first_token_at - now


class _ForwardCore(CostCore):
    """``PodModel._forward_ttft``'s scheduler: the pod's own, keeping a P/D prefill leg's blocks as
    ``_CostPodCore`` does, and telling no one."""

    def _release_finished(self, req: Any) -> None:
        if not req.keep_blocks:
            super()._release_finished(req)
