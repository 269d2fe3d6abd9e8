"""The simulated engines: when each request gets its tokens, and what the prefix cache does meanwhile.

Two timing models share one block pool, one event path and one set of metrics:

* ``CostEngine`` ('cost'): vLLM's scheduler in miniature. Each step takes running requests first
  (decode: 1 token; unfinished prefill: the next chunk), then waiting ones in FIFO order while the
  token budget (``max_num_batched_tokens``), ``max_num_seqs`` and free blocks allow; a running
  request that cannot get a block preempts the newest running one (recompute). A step lasts
  ``step_overhead_s + compute_s_per_token * tokens + kv_read_s_per_token * resident KV tokens of
  the batch`` (times the slow-down fault). Full blocks are cached as they fill and announced once
  per step in one event batch, as vLLM's scheduler does.
* ``SeedEngine`` ('seed'): one FIFO prefill server at ``prefill_tokens_per_s`` that computes only
  the uncached part; the cache (LRU in blocks) is updated at admission; decode runs beside it at
  ``decode_s_per_token``.

Both reuse at most ``(prompt_len - 1) // block_size`` cached blocks, as vLLM does (the last prompt
token is always computed to get logits).

The arithmetic of both (who is scheduled, what is cached, how long a step or a prefill takes) lives
in ``simulator/core.py``, free of asyncio, so ``kvroute simulate`` (``whatif/``) runs the same
models in simulated time; this module adds the clock, the output streams, metrics and events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from simulator.block_pool import BlockPool
from simulator.core import CostCore, CostParams, SeedCore, SeedParams
from simulator.events import all_blocks_cleared, block_removed, block_stored
from simulator.faults import Faults
from simulator.metrics import PodMetrics
from simulator.request import SimRequest
from simulator.settings import SimSettings
from simulator.tasks import cancel_and_wait

log = logging.getLogger("kvroute.sim.engine")


class OutputTokens:
    """The tokens the sim 'generates': a fixed text, cycled (so outputs are deterministic)."""

    TEXT = (" The quick brown fox jumps over the lazy dog, and the cache remembers every block"
            " it has seen before.")

    def __init__(self, encode: Callable[[str], list[int]]):
        self.ids = encode(self.TEXT) or [32]

    def at(self, i: int) -> int:
        return self.ids[i % len(self.ids)]


class EngineBase:
    def __init__(self, settings: SimSettings, metrics: PodMetrics, faults: Faults,
                 publish: Callable[[list], None], output: OutputTokens):
        self.settings = settings
        self.block_size = settings.block_size
        self.metrics = metrics
        self.faults = faults
        self._publish = publish
        self.output = output
        self.fmt = settings.kv_events_format
        self.pending_events: list = []
        self.window_blocks = settings.hybrid_window_blocks
        self.window_held: set[int] = set()   # hashes the sliding-window group holds (hybrid mode)
        self.pool = BlockPool(settings.num_gpu_blocks, settings.block_size, self._on_pool_event)
        self.on_release: Callable[[SimRequest], None] | None = None  # NIXL lease hook
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- events ------------------------------------------------------------------------------
    def _on_pool_event(self, ev: tuple) -> None:
        kind = ev[0]
        if kind == "stored":
            extra = ev[4] if len(ev) > 4 else None
            lora = ev[5] if len(ev) > 5 else None
            self.pending_events.append(block_stored(self.fmt, ev[1], ev[2], ev[3], self.block_size, extra_keys=extra,
                                                    lora=lora))
            if self.window_blocks:  # the sliding-window group stores the same blocks
                self.pending_events.append(block_stored(self.fmt, ev[1], ev[2], ev[3], self.block_size,
                                                        extra_keys=extra, group_idx=1, kind="sliding_window",
                                                        lora=lora))
                self.window_held.update(ev[1])
        elif kind == "removed":
            self.pending_events.append(block_removed(self.fmt, ev[1]))
            gone = [h for h in ev[1] if h in self.window_held]
            if gone:
                self.window_held.difference_update(gone)
                self.pending_events.append(block_removed(self.fmt, gone, group_idx=1))
        else:
            self.window_held.clear()
            self.pending_events.append(all_blocks_cleared(self.fmt))

    def _drop_out_of_window(self, req: SimRequest) -> None:
        """Hybrid mode: a finished request's blocks older than the window leave the sliding-window
        group (vLLM frees them as the sequence moves past the window; here they go at the finish,
        as if evicted at once), while the full-attention group keeps them."""
        old = [h for h in req.hashes[:max(0, len(req.hashes) - self.window_blocks)] if h in self.window_held]
        if old:
            self.window_held.difference_update(old)
            self.pending_events.append(block_removed(self.fmt, old, group_idx=1))

    def flush_events(self) -> None:
        if self.pending_events:
            events, self.pending_events = self.pending_events, []
            self._publish(events)

    # --- shared bookkeeping ------------------------------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def now(self) -> float:
        return self.loop.time()

    def _count_prefix(self, req: SimRequest, hit_tokens: int) -> None:
        m = self.metrics
        if req.reads_cache:  # vLLM counts no query for a request that skipped the lookup
            m.prefix_queries.inc(req.n_prompt)
        if hit_tokens:
            m.prefix_hits.inc(hit_tokens)
        # a NIXL read brings the whole rest of the prompt: vLLM 0.32 counts every prompt token past
        # the local hit as transferred (external_kv_transfer, external hits), local_compute 0, even
        # though the decoder recomputes the last one for its logits
        external = req.n_prompt - hit_tokens if req.remote_tokens else 0
        if external:
            m.external_queries.inc(req.n_prompt)
            m.external_hits.inc(external)
        m.prompt_by_source["local_cache_hit"].inc(hit_tokens)
        m.prompt_by_source["external_kv_transfer"].inc(external)
        m.prompt_by_source["local_compute"].inc(req.n_prompt - hit_tokens - external)
        # vllm:prompt_tokens is the whole prompt, cached or not, once per request (vLLM 0.32 adds the
        # PrefillStats' num_prompt_tokens, the sum of the three sources above)
        m.prompt_tokens.inc(req.n_prompt)
        # like vLLM, a request's cached tokens include KV received from a remote prefill (the usage
        # answer keeps the last token out: it is computed here)
        req.cached_tokens = max(hit_tokens, req.remote_tokens)

    def _record_finish(self, req: SimRequest, reason: str, now: float) -> None:
        m = self.metrics
        if reason != "abort":
            m.prompt_len.observe(req.n_prompt)
            m.generation_len.observe(req.num_output)
            m.e2e.observe(now - req.arrival)
            if req.first_token_at is not None:
                m.decode_time.observe(now - req.first_token_at)
        m.success[reason].inc()
        req.finish(reason, now)
        if self.window_blocks:
            self._drop_out_of_window(req)
            self.flush_events()

    def reset_prefix_cache(self) -> None:
        self.pool.reset()
        self.flush_events()

    def usage(self) -> float:
        return self.pool.usage()

    def release_blocks(self, block_ids: list[int]) -> None:
        """Give back blocks held past a request's end (a NIXL lease)."""
        self.pool.release(block_ids)
        self.wake()

    def wake(self) -> None:
        pass

    def forget_cache(self) -> None:
        self.pool.forget()
        self.window_held.clear()


class CostEngine(EngineBase, CostCore):
    """The 'cost' model (``simulator.core.CostCore``) driven by the event loop with real sleeps."""

    def __init__(self, *args, **kwargs):
        EngineBase.__init__(self, *args, **kwargs)
        CostCore.__init__(self, self.pool, CostParams.from_settings(self.settings))
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._busy_until = 0.0

    def start(self) -> None:
        if self._task is None:
            self._task = self.loop.create_task(self._run())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    def wake(self) -> None:
        self._wake.set()

    def submit(self, req: SimRequest) -> None:
        self.waiting.append(req)
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        req.aborted = True
        self._wake.set()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    async def _run(self) -> None:
        loop = self.loop
        while True:
            try:
                batch = self.schedule(self.now())
                if not batch:  # otherwise the step's events go out when it ends, as vLLM publishes them
                    self.flush_events()
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                duration = self.step_cost(batch) * self.faults.slowdown
                start = max(loop.time(), self._busy_until)
                end = start + duration
                self._busy_until = end
                delay = end - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                else:
                    await asyncio.sleep(0)
                self.commit(batch, end, duration)
                self.flush_events()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad step kill the pod
                log.exception("engine step failed")
                await asyncio.sleep(0.01)

    # --- the core's hooks: metrics, output tokens, NIXL leases ----------------------------------
    def _on_admitted(self, req: SimRequest, hit_tokens: int, now: float) -> None:
        self.metrics.queue_time.observe(now - req.arrival)
        self._count_prefix(req, hit_tokens)

    def _on_preempted(self, req: SimRequest) -> None:
        self.metrics.preemptions.inc()

    def _output_token(self, i: int) -> int:
        return self.output.at(i)

    def _on_token(self, req: SimRequest, first: bool, last: float | None, now: float) -> None:
        m = self.metrics
        m.generation_tokens.inc()
        if first:
            m.ttft.observe(now - req.arrival)
            if req.scheduled_at is not None:
                m.prefill_time.observe(now - req.scheduled_at)
        elif last is not None:
            m.itl.observe(now - last)

    def _release_finished(self, req: SimRequest) -> None:
        if req.keep_blocks and self.on_release is not None:
            self.on_release(req)  # the NIXL lease now owns the blocks
        else:
            self.pool.release(req.block_ids)
            req.block_ids = []

    def _on_finish(self, req: SimRequest, reason: str, now: float) -> None:
        self._record_finish(req, reason, now)


class SeedEngine(EngineBase):
    """One FIFO prefill server; the cache is updated when a request is admitted."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.core = SeedCore(self.pool, SeedParams.from_settings(self.settings))
        self._waiting = 0
        self._running = 0
        self._tasks: set[asyncio.Task] = set()
        self._req_tasks: dict[int, asyncio.Task] = {}

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass

    @property
    def num_running(self) -> int:
        return self._running

    @property
    def num_waiting(self) -> int:
        return self._waiting

    def submit(self, req: SimRequest) -> None:
        adm = self.core.admit(req, self.now(), self.faults.slowdown)
        self._count_prefix(req, adm.hit_tokens)
        self.flush_events()
        start, compute = adm.start, adm.compute_s
        self._waiting += 1
        task = self.loop.create_task(self._serve(req, start, start + compute))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._req_tasks[id(req)] = task

    async def _serve(self, req: SimRequest, start: float, first_at: float) -> None:
        loop = self.loop
        m = self.metrics
        waiting = True
        try:
            await asyncio.sleep(max(0.0, start - loop.time()))
            self._waiting -= 1
            waiting = False
            self._running += 1
            req.scheduled_at = start
            m.queue_time.observe(start - req.arrival)
            await asyncio.sleep(max(0.0, first_at - loop.time()))
            now = first_at
            req.emit(self.output.at(0), now)
            m.generation_tokens.inc()
            m.ttft.observe(now - req.arrival)
            m.prefill_time.observe(now - start)
            itl = self.settings.decode_s_per_token * self.faults.slowdown
            while not req.done_generating:
                now += itl
                delay = now - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                req.emit(self.output.at(req.num_output), now)
                m.generation_tokens.inc()
                m.itl.observe(itl)
            self._running -= 1
            self._end(req, "length" if req.length_capped else "stop", now)
        except asyncio.CancelledError:
            if waiting:
                self._waiting -= 1
            else:
                self._running -= 1
            self._end(req, "abort", loop.time())
            raise
        finally:
            self._req_tasks.pop(id(req), None)

    def _end(self, req: SimRequest, reason: str, now: float) -> None:
        if req.block_ids:
            if req.keep_blocks and reason != "abort" and self.on_release is not None:
                self.on_release(req)
            else:
                self.pool.release(req.block_ids)
                req.block_ids = []
        self._record_finish(req, reason, now)

    def abort(self, req: SimRequest) -> None:
        task = self._req_tasks.get(id(req))
        if task is not None:
            task.cancel()

