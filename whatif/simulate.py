"""``kvroute simulate``'s engine: the live router's decision code against pod models, in simulated time.

One discrete-event loop per run. Every request of the workload arrives at its offset; the real
``router.routing.Router`` (ledger, calibrator, scorers, admission, the real ``indexer.PrefixIndex``)
plans it with the prompt's token ids and a clock that returns simulated time, books it on the pod
it picks, and the pod model (``whatif.podmodel``: the simulator's own timing cores) serves it. The
pod's KV events reach the index after ``event_delay_s``; its waiting/running/KV usage reach the
router's registry every ``scrape_interval_s``, as the live router's scrape would; the first token
releases the booking and feeds the calibrator, as the live router does when the first chunk comes.

With ``prefill`` > 0 the fleet is disaggregated (``prefill-i`` and ``decode-j`` pods) and the
router's P/D planner decides. A remote prefill runs as the sidecar runs it: a one-token prefill leg
on the prefill pod (its blocks leased), the KV read over the link (``kv_bytes_per_token`` x the
blocks the decode pod lacks / bandwidth + latency, as ``kvroute sim``'s NIXL read), then the decode
leg on the decode pod with the prompt's KV received; the router learns the prefill pod's speed from
the prefill leg's duration, as from the sidecar's ``x-kvroute-prefill-ms``.

The ``oracle`` policy bypasses the router (aggregated fleets only): it sees every pod's true queue
and true cache and sends each request where its true TTFT is lowest, rejecting it when even that
misses the objective (exact in ``seed`` timing; in ``cost`` timing exact if nothing arrives after
it: see ``PodModel.true_ttft``). It is greedy, not an upper bound: the pod best for one request can
be the one a later request needed.

The ``true-state`` policy (aggregated fleets only) is kvroute's own decision code (the
``predicted-ttft`` scorers, the learnt error model, admission) with each pod's point prediction
replaced by that pod's true TTFT for the state at the decision (``PodModel.true_ttft``): what
kvroute would do with a perfect model of the present, its error model left to learn only what
comes after (later arrivals). Where it beats kvroute, better prediction would pay; where it does
not, the misses are the fleet's, not the predictor's.

The result is a ``replay.runner.RunResult``: per-request records and the replay report's summary
(attainment over ALL requests sent, a rejection is a miss; hit rate from the pods' prefix-cache
counters; TTFT percentiles), so ``replay.report`` prints and saves it unchanged.
"""

from __future__ import annotations

import heapq
import itertools
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from replay.metrics import RequestRecord, summarize
from replay.runner import RunResult
from whatif.podmodel import ModelRequest, PodModel, PodSpec

POLICIES = ("random", "round-robin", "least-load", "cache-only", "predicted-ttft", "oracle", "true-state")
MODEL = "sim-model"

# event kinds, in the order they run at equal times: an idle cost pod starts its step after every
# request arriving at that instant has been submitted, as the async engine's loop does
_EVENTS, _STEP, _FIRST, _READ, _SCRAPE, _DELIVER, _ARRIVE, _KICK, _END = range(9)


@dataclass
class SimConfig:
    """One simulated run: the fleet, the policy and the objective."""

    policy: str = "predicted-ttft"
    admission: bool = False
    objective_s: float | None = 2.0
    slo_tpot: float | None = None  # counted in attainment only (no router decision reads it)
    pods: int = 8
    prefill: int = 0               # > 0: the first ``prefill`` pods prefill, the others decode (P/D)
    spec: PodSpec = field(default_factory=PodSpec)
    pod_specs: tuple[PodSpec, ...] = ()  # per pod, in order, where pods differ (a heterogeneous fleet); else ``spec``
    event_delay_s: float = 0.0
    request_latency_s: float = 0.0  # from the router's decision to the pod's admission (HTTP, event loops)
    scrape_interval_s: float = 0.25
    router: dict[str, Any] = field(default_factory=dict)  # RouterSettings overrides
    model: str = MODEL
    label: str | None = None

    def name(self) -> str:
        if self.label:
            return self.label
        return self.policy + (" + early rejection" if self.admission else "")

    def pod_ids(self) -> list[tuple[str, str]]:
        """(pod id, role) of every pod."""
        if self.prefill <= 0:
            return [(f"pod-{i}", "both") for i in range(self.pods)]
        return [(f"prefill-{i}", "prefill") for i in range(self.prefill)] + \
               [(f"decode-{j}", "decode") for j in range(self.pods - self.prefill)]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _build_router(cfg: SimConfig, clock: _Clock) -> Any:
    from indexer.index import PrefixIndex
    from indexer.tokens import ByteTokenizer
    from router.config import PodConfig, RouterSettings
    from router.metrics import RouterMetrics
    from router.pods import PodRegistry
    from router.routing import Router

    bs = cfg.spec.block_size
    pods = [PodConfig(id=pid, url=f"http://{pid}.simulated:8000", role=role, model=cfg.model,
                      kv_events=[f"tcp://{pid}.simulated:5557"]) for pid, role in cfg.pod_ids()]
    values: dict[str, Any] = {
        "pods": pods, "policy": "predicted-ttft" if cfg.policy == "true-state" else cfg.policy,
        "admission": cfg.admission,
        "ttft_objective_ms": cfg.objective_s * 1000.0 if cfg.admission and cfg.objective_s else None,
        "block_size": bs, "prefill_tokens_per_s": cfg.spec.prefill_rate, "scrape_interval_s": cfg.scrape_interval_s,
        "kv_bytes_per_token": float(cfg.spec.kv_bytes_per_token),
        "kv_link_bandwidth_bytes_per_s": cfg.spec.link_bandwidth_bytes_per_s,
        "kv_link_latency_ms": cfg.spec.link_latency_s * 1000.0,
        **cfg.router}
    settings = RouterSettings(**values)
    registry = PodRegistry(settings.pods, clock=clock)
    for state in registry.pods.values():
        state.healthy = state.checked = True
        state.block_size = bs
        state.num_gpu_blocks = cfg.spec.num_gpu_blocks
    index = PrefixIndex(block_size=bs, max_blocks_per_pod=settings.index_max_blocks_per_pod,
                        tier_weights=dict(settings.tier_weights), speculative_ttl_s=settings.speculative_ttl_s,
                        clock=clock)
    for p in settings.pods:
        index.add_pod(p.id, p.model, approximate=not p.kv_events)
    return Router(settings, registry, index, cast(Any, ByteTokenizer()), RouterMetrics(), block_size=bs, clock=clock)


def simulate(specs: Sequence[Any], arrivals: Sequence[float], cfg: SimConfig,
             progress: Callable[[int, int], None] | None = None) -> RunResult:
    """Run ``specs`` (``replay.workloads.RequestSpec``, or anything with ``token_ids`` and
    ``output_len``) arriving at ``arrivals`` (seconds) through ``cfg``."""
    if cfg.policy not in POLICIES:
        raise ValueError(f"unknown policy {cfg.policy!r}; choose one of {', '.join(POLICIES)}")
    if len(arrivals) < len(specs):
        raise ValueError("fewer arrival times than requests")
    if cfg.prefill and not 0 < cfg.prefill < cfg.pods:
        raise ValueError(f"a P/D fleet of {cfg.pods} pods needs 1..{cfg.pods - 1} prefill pods, got {cfg.prefill}")
    if cfg.prefill and cfg.policy in ("oracle", "true-state"):
        raise ValueError(f"the {cfg.policy} policy is for aggregated fleets")
    return _Run(specs, arrivals, cfg, progress).run()


@dataclass(slots=True)
class _Leg:
    """What a request inside a pod model belongs to."""

    record: RequestRecord
    booking: Any
    kind: str = "main"              # "main" (whole request), "prefill" or "decode" (P/D remote)
    decode_pod: str | None = None   # prefill leg: where the KV goes
    prefill_pod: str | None = None
    output_len: int = 1
    prefill_s: float = 0.0          # decode leg: the prefill leg's duration (the sidecar's report)


class _Run:
    def __init__(self, specs: Sequence[Any], arrivals: Sequence[float], cfg: SimConfig,
                 progress: Callable[[int, int], None] | None):
        self.specs = specs
        self.arrivals = arrivals
        self.cfg = cfg
        self.progress = progress
        self.clock = _Clock()
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = itertools.count()
        self.oracle = cfg.policy == "oracle"
        self.router: Any = None if self.oracle else _build_router(cfg, self.clock)
        self.pods = {pid: PodModel(pid, cfg.pod_specs[i] if i < len(cfg.pod_specs) else cfg.spec, self._events)
                     for i, (pid, _) in enumerate(cfg.pod_ids())}
        self.salts = {pid: zlib.crc32(pid.encode()) for pid in self.pods}
        self.records: list[RequestRecord] = []
        self.end = 0.0
        self.modes: dict[str, int] = {}
        self._key_seed: int | None = None
        self._segments: dict[tuple[Any, int], list[int]] = {}
        self._arriving: tuple[list[int], int] | None = None  # true-state: (block keys, prompt tokens) being planned
        if self.router is not None and cfg.policy == "true-state":
            self.router.planner.predictor = self.true_prediction

    # --- plumbing -------------------------------------------------------------------------------
    def push(self, at: float, kind: int, payload: Any) -> None:
        heapq.heappush(self.heap, (at, kind, next(self.seq), payload))

    def _events(self, pod_id: str, events: list[Any]) -> None:
        if self.router is None:
            return
        if self.cfg.event_delay_s > 0:
            self.push(self.clock.now + self.cfg.event_delay_s, _EVENTS, (pod_id, events))
        else:
            self.router.index.apply_batch(pod_id, events)

    def keys(self, tokens: list[int]) -> list[int]:
        if self.router is not None:
            return list(self.router.keys_for(self.cfg.model, tokens))
        from indexer.keys import block_keys, key_seed

        if self._key_seed is None:
            self._key_seed = key_seed(self.cfg.model)
        return block_keys(tokens, self.cfg.spec.block_size, self._key_seed)

    def tokens(self, spec: Any) -> list[int]:
        """A request's prompt ids; a workload's blocks (``replay.workloads`` segments) are listed once."""
        segments = getattr(spec, "segments", None)
        if segments is None:
            return list(spec.token_ids)
        out: list[int] = []
        cache = self._segments
        for key, n in segments:
            ids = cache.get((key, n))
            if ids is None:
                if len(cache) >= 20000:  # bounded: a long trace's blocks would not all fit
                    cache.clear()
                ids = cache[(key, n)] = spec.bank.ids(key)[:n].tolist()
            out.extend(ids)
        return out

    # --- the loop -------------------------------------------------------------------------------
    def run(self) -> RunResult:
        started = time.perf_counter()
        n = len(self.specs)
        for i in range(n):
            self.push(float(self.arrivals[i]), _ARRIVE, i)
        if self.router is not None and n:
            self.push(0.0, _SCRAPE, None)
        last_arrival = float(self.arrivals[n - 1]) if n else 0.0
        done = 0
        heap = self.heap
        while heap:
            at, kind, _, payload = heapq.heappop(heap)
            self.clock.now = at
            if kind == _ARRIVE:
                self.arrive(payload)
                done += 1
                if self.progress is not None and done % 10000 == 0:
                    self.progress(done, n)
            elif kind == _FIRST:
                self.first_token(payload)
                if payload.max_tokens <= 1:
                    self.finished(payload)
            elif kind == _STEP:
                self.step_end(payload)
            elif kind == _KICK:
                self.start_step(payload)
            elif kind == _READ:
                self.read_done(payload)
            elif kind == _DELIVER:
                self.submit(*payload)
            elif kind == _EVENTS:
                pod_id, events = payload
                self.router.index.apply_batch(pod_id, events)
            elif kind == _END:  # a seed pod's request has streamed its last token
                self.router.ended(payload)
            elif kind == _SCRAPE:
                self.scrape()
                if at < last_arrival:
                    self.push(at + self.cfg.scrape_interval_s, _SCRAPE, None)
        return self.result(n, last_arrival, time.perf_counter() - started)

    def result(self, n: int, last_arrival: float, wall: float) -> RunResult:
        for rec in self.records:  # admitted and never answered: a pod that could not run it
            if not rec.status and rec.error is None:
                rec.error = "unanswered"
        duration = max([self.end, last_arrival, 1e-9])
        summary = summarize(self.records, duration=duration, slo_ttft=self.cfg.objective_s, slo_tpot=self.cfg.slo_tpot)
        queries = sum(p.queries for p in self.pods.values())
        hits = sum(p.hits for p in self.pods.values())
        summary["hit_rate"] = hits / queries if queries else None
        summary["hit_rate_per_pod"] = {pid: (p.hits / p.queries if p.queries else None) for pid, p in self.pods.items()}
        summary["prefix_cache_queries"] = float(queries)
        summary["prefix_cache_hits"] = float(hits)
        summary["routes"] = dict(sorted(self.modes.items()))
        summary["simulated"] = True
        summary["wall_s"] = wall
        cfg = self.cfg
        config = {"label": cfg.name(), "policy": cfg.policy, "admission": cfg.admission, "objective_s": cfg.objective_s,
                  "slo_tpot": cfg.slo_tpot, "pods": cfg.pods, "prefill": cfg.prefill, "timing": cfg.spec.timing,
                  "pod_spec": asdict(cfg.spec), "pod_specs": [asdict(p) for p in cfg.pod_specs],
                  "event_delay_s": cfg.event_delay_s,
                  "request_latency_s": cfg.request_latency_s,
                  "scrape_interval_s": cfg.scrape_interval_s, "router": cfg.router, "num_requests": n,
                  "slo_ttft": cfg.objective_s}
        return RunResult(self.records, summary, config)

    def scrape(self) -> None:
        now = self.clock.now
        for pid, pod in self.pods.items():
            state = self.router.registry.pods[pid]
            state.waiting, state.running, state.kv_usage = pod.load(now)
            state.last_scrape = now

    # --- one request -----------------------------------------------------------------------------
    def arrive(self, i: int) -> None:
        spec = self.specs[i]
        now = self.clock.now
        tokens = self.tokens(spec)
        rec = RequestRecord(index=i, scheduled=now, input_tokens=len(tokens), sent=now, lateness=0.0)
        self.records.append(rec)
        booking = None
        mode, prefill_pod = "aggregated", None
        if self.oracle:
            keys = self.keys(tokens)
            pod_id = self.oracle_pick(keys, len(tokens), now)
        else:
            body = {"model": self.cfg.model, "max_tokens": spec.output_len, "stream": True}
            if self.cfg.policy == "true-state":
                self._arriving = (self.keys(tokens), len(tokens))
            plan = self.router.plan("completion", body, {}, tokens=tokens)
            decision = plan.decision
            keys = plan.keys
            pod_id = None
            if decision.verdict.admitted and decision.ranked:
                cand = decision.ranked[0]
                pod_id = cand.pod_id
                booking = self.router.book(plan, cand)
                route = decision.routes.get(pod_id) if decision.routes else None
                if route is not None:
                    mode, prefill_pod = route.mode, route.prefill_pod
        if pod_id is None:
            rec.status = 429
            rec.error = "rejected"
            self.modes["rejected"] = self.modes.get("rejected", 0) + 1
            return
        self.modes[mode] = self.modes.get(mode, 0) + 1
        rec.pod = pod_id
        if mode == "remote" and prefill_pod is not None:
            leg = _Leg(rec, booking, "prefill", decode_pod=pod_id, prefill_pod=prefill_pod,
                       output_len=spec.output_len)
            req = ModelRequest(i, tokens, keys, 1, now, tag=leg)
            req.keep_blocks = True  # the lease: held until the decode pod has read them
            self.deliver(self.pods[prefill_pod], req)
        else:
            self.deliver(self.pods[pod_id], ModelRequest(i, tokens, keys, spec.output_len, now,
                                                         tag=_Leg(rec, booking)))

    def deliver(self, pod: PodModel, req: ModelRequest) -> None:
        """The routed request reaches its pod ``request_latency_s`` after the decision."""
        if self.cfg.request_latency_s > 0:
            req.arrival = self.clock.now + self.cfg.request_latency_s
            self.push(req.arrival, _DELIVER, (pod, req))
        else:
            self.submit(pod, req)

    def submit(self, pod: PodModel, req: ModelRequest) -> None:
        now = self.clock.now
        if pod.cost is not None and not pod.fits(req.n_prompt + req.max_tokens):
            self.refuse(pod, req)
            return
        if pod.seed is not None:
            adm = pod.admit_seed(req, now)
            self.push(adm.first_at, _FIRST, req)
        else:
            pod.submit_cost(req)
            if not pod.stepping:
                pod.stepping = True  # a step starts at this instant, after the other arrivals
                self.push(now, _KICK, pod)

    def refuse(self, pod: PodModel, req: ModelRequest) -> None:
        """A prompt and output longer than the pod's whole KV cache: vLLM caps ``max_model_len`` at
        what its cache holds and answers such a request 400 at once. Batched, it would preempt
        itself for ever once its blocks ran out (a loop with no end in simulated time)."""
        leg: _Leg = req.tag
        rec = leg.record
        rec.status = 400
        rec.error = (f"prompt + output of {req.n_prompt + req.max_tokens} tokens is more than {pod.pod_id}'s KV cache "
                     f"holds ({pod.spec.num_gpu_blocks} blocks of {pod.block_size} tokens)")
        if leg.booking is not None:
            self.router.ended(leg.booking)

    def true_prediction(self, candidate: Any, request: Any) -> Any:
        """``true-state``: the pod's true TTFT for the request being planned, as a prediction whose
        parts keep the router's split (its own prefill at the pod's calibrated rate, the rest as
        queue) and whose error model is the pod's learnt one."""
        from router.scheduling.snapshot import Prediction

        assert self._arriving is not None
        keys, n_prompt = self._arriving
        pod = self.pods[candidate.pod_id]
        ttft = pod.true_ttft(keys, n_prompt, self.clock.now)
        own = max(n_prompt - pod.cached_blocks(keys, n_prompt) * pod.block_size, 1)
        prefill_s = min(own / max(candidate.prefill_tokens_per_s, 1.0), ttft)
        log_mean, log_sd = candidate.error_model(ttft)
        return Prediction(queue_s=ttft - prefill_s, prefill_s=prefill_s, overhead_s=0.0, uncached_tokens=own,
                          log_mean=log_mean, log_sd=log_sd)

    def oracle_pick(self, keys: list[int], n_prompt: int, now: float) -> str | None:
        anchor = keys[-1] if keys else n_prompt
        best: tuple[float, int, int] | None = None
        best_pod = None
        for pid, pod in self.pods.items():
            ttft = pod.true_ttft(keys, n_prompt, now)
            tie = ((anchor ^ self.salts[pid]) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
            key = (round(ttft, 9), -pod.cached_blocks(keys, n_prompt), tie)
            if best is None or key < best:
                best, best_pod = key, pid
        if best is None:
            return None
        objective = self.cfg.objective_s
        if self.cfg.admission and objective is not None and best[0] > objective:
            return None
        return best_pod

    def start_step(self, pod: PodModel) -> None:
        end = pod.start_step(self.clock.now)
        if end is not None:
            self.push(end, _STEP, pod)

    def step_end(self, pod: PodModel) -> None:
        firsts, finished = pod.end_step(self.clock.now)
        for req in firsts:
            self.first_token(req)
        for req in finished:
            self.finished(req)
        self.start_step(pod)

    def first_token(self, req: ModelRequest) -> None:
        leg: _Leg = req.tag
        rec, booking = leg.record, leg.booking
        now = self.clock.now
        if leg.kind == "prefill":  # the prefill leg answered: the decode pod reads the KV
            spec = self.cfg.spec
            decode = self.pods[leg.decode_pod or ""]
            local = decode.cached_blocks(req.hashes, req.n_prompt)
            leased = len(req.block_ids)
            moved = max(0, leased - local) * spec.block_size * spec.kv_bytes_per_token
            leg.prefill_s = now - req.arrival
            self.push(now + spec.link_latency_s + moved / spec.link_bandwidth_bytes_per_s, _READ, req)
            return
        rec.ttft = now - rec.scheduled
        if leg.kind == "main":
            rec.cached_tokens = req.hit_tokens
        else:
            rec.cached_tokens = req.n_prompt - 1
        if booking is not None:
            if leg.kind == "decode":  # the sidecar's answer headers report the prefill leg
                self.router.observe_answer(booking, {"x-kvroute-prefill": "remote",
                                                     "x-kvroute-prefill-ms": f"{leg.prefill_s * 1000:.3f}"})
            self.router.first_token(booking)
        if self.pods[rec.pod or ""].seed is not None:  # seed: the decode is fixed once the first token is
            rec.output_tokens = req.max_tokens
            rec.e2e = rec.ttft + (req.max_tokens - 1) * self.cfg.spec.decode_s_per_token
            rec.status = 200
            self.end = max(self.end, rec.scheduled + rec.e2e)
            if booking is not None:
                self.push(rec.scheduled + rec.e2e, _END, booking)

    def finished(self, req: ModelRequest) -> None:
        leg: _Leg = req.tag
        if leg.kind == "prefill" or self.pods[leg.record.pod or ""].seed is not None:
            return
        rec = leg.record
        now = self.clock.now
        rec.e2e = now - rec.scheduled
        rec.output_tokens = req.num_output
        rec.status = 200
        if leg.booking is not None:
            self.router.ended(leg.booking)
        self.end = max(self.end, now)

    def read_done(self, pre: ModelRequest) -> None:
        """The decode pod has read the prompt's KV: the lease ends and the decode leg starts."""
        leg: _Leg = pre.tag
        prefill = self.pods[leg.prefill_pod or ""]
        prefill.pool.release(pre.block_ids)
        pre.block_ids = []
        dec = ModelRequest(pre.index, pre.prompt, pre.hashes[:len(pre.prompt) // self.cfg.spec.block_size],
                           leg.output_len, self.clock.now,
                           tag=_Leg(leg.record, leg.booking, "decode", prefill_s=leg.prefill_s))
        dec.remote_tokens = dec.n_prompt - 1  # the last prompt token is recomputed for its logits
        self.submit(self.pods[leg.decode_pod or ""], dec)
