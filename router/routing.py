"""The router's state and its per-request decision, independent of HTTP.

``Router`` owns the pieces one decision reads (fleet registry, prefix index, booking ledger,
calibrator, the planners) and exposes the steps of a request (``router/lifecycle.py`` calls them):

1. ``plan``: tokenize, look up the prefix index, ``take_snapshot`` of the fleet, and let a planner
   decide (``scheduling/planners.py``: aggregated, or P/D when decode pods are up); the same call
   serves ``/debug/route`` with ``dry_run=True``;
2. ``book``: hold the chosen route in the ledger at once and credit the index speculatively;
3. ``first_token`` / ``finish``: release the booking (once) and feed the calibrator.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from indexer.index import DEFAULT_TIER
from indexer.keys import key_seed
from indexer.tokens import Tokenizer
from kvcommon.transfer import one_prefill_cannot_serve, wants_prompt_logprobs
from router.booking import Booking, Ledger
from router.config import PodConfig, RouterSettings
from router.costs import batch_rest_tokens
from router.disagg import params_from_settings, pd_metrics, sidecar_prefill_seconds
from router.errors import APIError
from router.metrics import RouterMetrics
from router.pods import PodRegistry, PodState
from router.predlog import PredictionLog
from router.prompts import prompt_block_keys, prompt_tokens, serve_chat_flags, text_encoder
from router.scheduling import (
    AggregatedPlanner,
    Calibrator,
    Candidate,
    Decision,
    FleetSnapshot,
    KVRoom,
    PDPlanner,
    Planner,
    PolicyState,
    RequestView,
    build_scoring,
    presets,
)
from router.scheduling.scorers import Scoring

log = logging.getLogger(__name__)
CREDIT_NOW_BLOCKS = 256  # a routed prompt's blocks credited in one piece (Router.speculate)
LONG_CREDIT_BLOCKS = 1024  # a credit of more blocks than this (16k tokens), local or another process's, ...
LONG_CREDIT_PIECE = 64  # ... is credited this many blocks a piece (Router._credit_piece)


def scoring_from_settings(settings: RouterSettings) -> Scoring:
    """The configured ``scorers`` list, or else the named ``policy`` preset."""
    if settings.scorers is not None:
        return build_scoring([s.model_dump() for s in settings.scorers])
    return build_scoring(presets(settings.work_weight, settings.affinity_bonus_ms)[settings.policy])


@dataclass
class Plan:
    """A decision plus what dispatch needs to carry it out."""

    kind: str
    model: str
    tokens: Sequence[int]  # a list, the prefix token cache's CachedTokens, or the tokenize process's PromptLength
    keys: list[int]
    request: RequestView
    decision: Decision
    snapshot: FleetSnapshot
    pods: dict[str, PodConfig]  # every healthy pod of the model: where to send, where to prefill
    routing_s: float = 0.0

    def url(self, pod_id: str, path: str) -> str:
        return self.pods[pod_id].url + path


def _priority_exempt(value: str | None, exempt_values: list[str]) -> bool:
    return value is not None and value.strip().lower() in exempt_values


def take_snapshot(model: str, pods: list[PodState], keys: list[int], tokens: Sequence[int], *, index: Any,
                  ledger: Ledger, calibrator: Calibrator, block_size: int, salts: Mapping[str, int]) -> FleetSnapshot:
    """The fleet as one decision sees it: per pod its scraped load, the router's bookings, its
    calibrated speed and the prefix index's answer for this prompt, plus decode pods' KV room."""
    matches = index.match(keys, pods=[p.id for p in pods]) if keys and pods else {}
    recency = getattr(index, "recency", None)
    now = recency.clock() if recency is not None else 0.0
    anchor = keys[-1] if keys else hash(tuple(tokens))
    bs = block_size
    cands, kv = [], {}
    calibrations = calibrator.pods
    for p in pods:
        pid, config = p.id, p.config
        cal = calibrations.get(pid) or calibrator.pod(pid)
        error = cal.error_model()
        inflight, queue = ledger.load(pid, cal.rate)
        m = matches.get(pid)
        if m is not None:
            blocks = int(m.blocks)
            by_tier = {str(t): int(b) * bs for t, b in m.by_tier.items()} if m.by_tier else {}
            effective = float(m.weighted) * bs
            evicting, check = 0, -1
            if recency is not None and blocks and (not by_tier or by_tier.keys() == {DEFAULT_TIER}):
                # blocks the pod should evict before this request would start there are counted as
                # work, in the share that such expectations have come true lately (indexer.recency)
                keep = recency.surviving(pid, keys, blocks, now + queue / max(cal.rate, 1e-9))
                if keep < blocks:
                    evicting, check = blocks - keep, (keep + blocks) // 2
                    lost = round(evicting * recency.precision())
                    if lost:
                        effective *= (blocks - lost) / blocks
                        blocks -= lost
                        by_tier = {DEFAULT_TIER: blocks * bs} if blocks else {}
            cached = blocks * bs
        else:
            cached, by_tier, effective, evicting, check = 0, {}, 0.0, 0, -1
        # positional, in Candidate's field order: twenty keyword arguments cost 1.5 us against 0.4 us
        # per pod per request (tests/test_scheduling.py holds each field to its source)
        cands.append(Candidate(
            pid, config.role, config.model,             # pod_id, role, model
            p.waiting, p.running, p.kv_usage,           # scraped
            inflight, queue,                            # inflight_requests, queue_tokens (booked)
            cal.rate, cal.overhead_s, cal.per_running_s,  # prefill_tokens_per_s, overhead_s, per_running_s
            error[0], error[1], cal.error_table(),      # log_error_mean, log_error_sd, error_by_size
            cached, by_tier, effective,                 # cached_tokens, cached_by_tier, effective_cached_tokens
            evicting * bs, check,                       # evicting_tokens, evicting_check
            ((anchor ^ salts.get(pid, 0)) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF,  # tiebreak
        ))
        if config.role == "decode":
            active, booked = ledger.kv_booked(pid)
            capacity = p.num_gpu_blocks * (p.block_size or bs) if p.num_gpu_blocks else None
            kv[pid] = KVRoom(capacity_tokens=capacity, booked_tokens=booked, active_requests=active)
    return FleetSnapshot(model=model, candidates=tuple(cands), kv=kv)


def cache_salt(body: Mapping[str, Any]) -> str | None:
    """The request's ``cache_salt`` (vLLM's per-tenant prefix-cache isolation), checked as vLLM checks it."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise APIError(400, "Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    return salt


# how long after twice a request's predicted TTFT its prefill may still announce the blocks it computed
CHECK_GRACE_S = 1.0


class Router:
    def __init__(self, settings: RouterSettings, registry: PodRegistry, index: Any, tokenizer: Tokenizer,
                 metrics: RouterMetrics, *, ledger: Ledger | None = None, calibrator: Calibrator | None = None,
                 block_size: int = 16, subscriber: Any = None, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.registry = registry
        self.index = index
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.ledger = ledger or Ledger(clock)
        self.calibrator = calibrator or Calibrator(settings.prefill_tokens_per_s, settings.overhead_ms / 1000.0,
                                                   settings.calibration_halflife, settings.calibrate,
                                                   prior_sd=settings.ttft_error_prior_sd,
                                                   relative=settings.calibration_fit == "relative",
                                                   by_size=settings.ttft_error_by_size)
        self.block_size = block_size
        self.subscriber = subscriber
        self.policy = settings.policy if settings.scorers is None else "custom"
        state = PolicyState()
        state.rng.seed(settings.seed)
        tolerance = settings.admission_miss_probability
        self.planner = AggregatedPlanner(scoring_from_settings(settings), state, settings.admission,
                                         settings.admission_slack, tolerance)
        self.pd_planner = PDPlanner(params_from_settings(settings), settings.admission, settings.admission_slack,
                                    tolerance)
        self.pd_metrics = pd_metrics(metrics.registry)
        self._clock = clock
        self._seeds: dict[str, int] = {}
        self.event_sources: dict[str, int] = {}  # per pod: answered requests that stored new blocks
        self._salts = {pid: zlib.crc32(pid.encode()) for pid in registry.pods}
        self._exempt = [v.lower() for v in settings.priority_exempt_values]
        self._with_events = {pid for pid, p in registry.pods.items() if p.config.kv_events}
        self.chat_flags = serve_chat_flags(settings)  # the pods' chat-rendering serve flags (None: unset)
        self.chars_per_token = settings.estimate_chars_per_token or (1.0 if settings.tokenizer == "byte" else 4.0)
        self.prediction_log: PredictionLog | None = None
        # told of each credit ``book`` makes (pod, the prompt's block keys): the booking bus, which
        # hands it to the other router processes' ``credit_foreign``
        self.on_credit: Callable[[str, list[int]], None] | None = None
        # told of each credit ``withdraw`` takes back (pod, keys): the booking bus, which hands it to
        # the other router processes' ``withdraw_foreign``
        self.on_withdraw: Callable[[str, list[int]], None] | None = None
        # per pod, its credits going in a piece a loop turn (``_credit_in_pieces``), in their order: a
        # foreign withdrawal puts them all in first (``withdraw_foreign``)
        self._in_pieces: dict[str, dict[Iterator[None], None]] = {}
        if settings.prediction_log_path:
            path = settings.prediction_log_path + (f".{os.getpid()}" if settings.workers > 1 else "")
            self.prediction_log = PredictionLog(path, settings.prediction_log_max_bytes)
        for pid, p in registry.pods.items():
            self.calibrator.pod(pid, p.config.prefill_tokens_per_s)

    def track_pod(self, pod: PodState) -> None:
        """A pod joined the fleet at run time (discovery): give it what the constructor gives each pod."""
        self._salts[pod.id] = zlib.crc32(pod.id.encode())
        if pod.config.kv_events:
            self._with_events.add(pod.id)
        else:
            self._with_events.discard(pod.id)
        self.calibrator.pod(pod.id, pod.config.prefill_tokens_per_s)

    def untrack_pod(self, pod_id: str) -> None:
        """A pod left the fleet: drop its bookings (their work went with it)."""
        self._with_events.discard(pod_id)
        self._salts.pop(pod_id, None)
        self.ledger.forget(pod_id)
        self.calibrator.pods.pop(pod_id, None)
        self.event_sources.pop(pod_id, None)

    # ---- the decision ----------------------------------------------------------------------
    def resolve_model(self, body: Mapping[str, Any]) -> str:
        """The model the request names: a base model or a LoRA adapter some pod serves (as vLLM, which
        takes an adapter's name as the ``model``)."""
        model = body.get("model")
        if model is None:
            models = self.registry.models()
            if not models:
                raise APIError(503, "no pods are configured")
            return models[0]
        if not isinstance(model, str):
            raise APIError(400, "'model' must be a string", param="model")
        if not self.registry.serves_model(model) and model not in self.registry.adapters():
            raise APIError(404, f"The model `{model}` does not exist.", param="model")
        return model

    def target(self, model: str) -> tuple[str, str | None]:
        """``(base model, adapter)`` for a name ``resolve_model`` returned (adapter None for a base model)."""
        if self.registry.serves_model(model):
            return model, None
        base = self.registry.adapters().get(model)
        return (base, model) if base is not None else (model, None)

    def objective_s(self, headers: Mapping[str, str], may_loosen: bool = True) -> float | None:
        """The request's TTFT objective: the objective header, bounded by ``slo_header_max_ms``, else
        the configured one. A caller without the objective grant may only tighten the configured
        objective with the header, never loosen it."""
        default = self.settings.ttft_objective_ms / 1000.0 if self.settings.ttft_objective_ms is not None else None
        raw = headers.get(self.settings.slo_header)
        if raw is not None:
            name, most = self.settings.slo_header, self.settings.slo_header_max_ms
            try:
                ms = float(raw)
            except ValueError:
                raise APIError(400, f"header {name} must be a number of milliseconds") from None
            if not (0 < ms <= most):
                raise APIError(400, f"header {name} must be a number of milliseconds above 0 and at most {most:g}")
            asked = ms / 1000.0
            return asked if may_loosen or default is None else min(asked, default)
        return default

    def output_tokens(self, body: Mapping[str, Any]) -> int:
        """The request's expected output: its ``max_tokens``, else ``pd_expected_output_tokens``."""
        value = body.get("max_completion_tokens", body.get("max_tokens"))
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        return self.settings.pd_expected_output_tokens

    def keys_for(self, model: str, tokens: Sequence[int], salt: str | None = None) -> list[int]:
        """The prompt's block keys for ``model`` (``router.prompts.prompt_block_keys``)."""
        return prompt_block_keys(tokens, self.block_size, self.key_seed(model), self.target(model)[1], salt)

    def key_seed(self, model: str) -> int:
        """The block-key chain's seed for ``model`` (its base model and adapter), computed once."""
        seed = self._seeds.get(model)
        if seed is None:
            seed = self._seeds[model] = key_seed(*self.target(model))
        return seed

    def snapshot(self, model: str, keys: list[int], tokens: Sequence[int], pods: list[PodState]) -> FleetSnapshot:
        """The fleet for one decision: ``pods``, those serving ``model`` (``plan`` looks them up once)."""
        return take_snapshot(model, pods, keys, tokens, index=self.index, ledger=self.ledger,
                             calibrator=self.calibrator, block_size=self.block_size, salts=self._salts)

    def prompt(self, kind: str, body: Mapping[str, Any], max_new_chars: int | None = None) -> tuple[Sequence[int], int]:
        """The prompt's token ids with the local tokenizer, and the tokens of the other prompts of a
        completion batch. Touches no routing state, so it may run in a tokenize thread (see
        ``prompt_and_keys``). ``max_new_chars``: ``router.prompts.prompt_tokens``'s bound."""
        tokens = prompt_tokens(kind, body, self.tokenizer, max_new_chars, self.chat_flags)  # type: ignore[arg-type]
        # the other prompts of a batch: seeded by the request's salt as the first is (router/prompts.py)
        rest = batch_rest_tokens(body, text_encoder(self.tokenizer, body),  # type: ignore[arg-type]
                                 self.chars_per_token) if kind == "completion" else 0
        return tokens, rest

    def prompt_and_keys(self, kind: str, body: Mapping[str, Any],
                        max_new_chars: int | None = None) -> tuple[Sequence[int], int, list[int]]:
        """``prompt`` and the prompt's block keys: the CPU-heavy part of ``plan``, for a tokenize thread
        (or, bounded by ``max_new_chars``, on the event loop: router/api.py)."""
        tokens, rest = self.prompt(kind, body, max_new_chars)
        return tokens, rest, self.keys_for(self.resolve_model(body), tokens, cache_salt(body))

    def plan(self, kind: str, body: Mapping[str, Any], headers: Mapping[str, str], dry_run: bool = False,
             tokens: Sequence[int] | None = None, exact: bool = True, grants: Any = None,
             rest: int | None = None, keys: list[int] | None = None,
             only: Callable[[PodState], bool] | None = None, more: int = 0) -> Plan:
        """Tokenize, look up, snapshot the fleet and decide; nothing is booked (``book`` does that).

        ``tokens`` given: the prompt was tokenized already (by ``prompt`` in a tokenize thread, with
        ``rest``, or by a pod's /tokenize); ``exact=False`` when they only stand in for its length,
        so no prefix is looked up. ``grants`` (router.auth) say whether the caller's priority and
        objective headers count (None: they do).

        A batch of prompts is routed by its first prompt (its prefix is looked up) and counted as all
        of them (``prompt_tokens``: the other prompts' tokens, assumed uncached); ``more``: prompt
        tokens the request carries besides those (a chat batch's other conversations, estimated:
        router/chat_batch.py), counted the same way. ``only``: the pods of the model the request may
        go to (None: all)."""
        started = time.perf_counter()
        model = self.resolve_model(body)
        objective = self.objective_s(headers, may_loosen=grants is None or grants.objective)
        if tokens is None:
            tokens, rest = self.prompt(kind, body)
        elif rest is None:  # a pod tokenized the first prompt: estimate the others
            rest = batch_rest_tokens(body, None, self.chars_per_token) if kind == "completion" else 0  # type: ignore[arg-type]
        salt = cache_salt(body)
        if keys is None:
            keys = self.keys_for(model, tokens, salt) if exact else []
        exempt = (grants is None or grants.priority) and \
            _priority_exempt(headers.get(self.settings.priority_header), self._exempt)
        serving = self.registry.serving(*self.target(model))
        if only is not None:  # the pods this request may go to (a Responses request: router/responses.py)
            serving = [p for p in serving if only(p)]
        path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
        lookup = keys
        # a request for prompt logprobs reads no cached KV on vLLM (skip_reading_prefix_cache): no
        # pod is credited its prefix, though its blocks are still booked to the pod that computes them
        # (two key tests first: the call is ~1,000 instructions a request that most never need)
        if ("prompt_logprobs" in body or "echo" in body) and wants_prompt_logprobs(body, path):
            lookup = []
        snap = self.snapshot(model, lookup, tokens, serving)
        disaggregated = snap.disaggregated
        single = not disaggregated or one_prefill_cannot_serve(body, path) is None
        request = RequestView(prompt_tokens=len(tokens) + rest + more, objective_s=objective, exempt=exempt,
                              unknown_request_tokens=self.settings.unknown_request_tokens,
                              output_tokens=self.output_tokens(body), single_prefill=single)
        planner: Planner = self.pd_planner if disaggregated else self.planner
        decision = planner.decide(snap, request, dry_run)
        elapsed = time.perf_counter() - started
        if not dry_run:
            self.metrics.routing_seconds.observe(elapsed)
            if decision.pd is not None:
                chosen = decision.pd.chosen
                self.pd_metrics.decisions.labels(decision.pd.decider, chosen.mode if chosen else "rejected").inc()
        pods = {p.id: p.config for p in serving}
        return Plan(kind=kind, model=model, tokens=tokens, keys=keys, request=request, decision=decision,
                    snapshot=snap, pods=pods, routing_s=elapsed)

    # ---- accounting ------------------------------------------------------------------------
    def speculate(self, pod_id: str, keys: list[int]) -> None:
        """Credit ``keys`` to ``pod_id`` in the index until its events confirm (or record the route).

        On the event loop a longer prompt's blocks go a piece at a time (``_credit_piece``), the
        first piece at once and one more in each loop turn after: a cold 32k-token prompt's 2,000 new
        blocks took 2-5 ms of dict work in one piece, and every request that arrived meanwhile waited
        for it. A request routed between the pieces sees the first ones credited. Without a running
        loop (``kvroute simulate``) it is all credited at once, as is a prompt of one piece anyway
        (most of them): no generator and no loop lookup for it."""
        if len(keys) <= CREDIT_NOW_BLOCKS:
            self._credit_now(pod_id, keys)
            return
        self._credit_in_pieces(pod_id, keys, self._credit_piece(len(keys)))

    @staticmethod
    def _credit_piece(blocks: int) -> int:
        """Blocks a loop turn for a credit of ``blocks``: ``CREDIT_NOW_BLOCKS``, and for one of more
        than ``LONG_CREDIT_BLOCKS`` (a cold prompt of over 16k tokens) ``LONG_CREDIT_PIECE``. Each piece
        of 256 blocks holds the loop ~0.35 ms, and a small request beside a cold 32k-token prompt
        waited behind one in each of the turns its answer took: with pieces of 64 for the long ones, its
        p99 beside them fell from 3.62 to 2.84 ms and 3.45 to 3.19 ms in one process, and from 4.53 to
        2.80 ms with two workers for the other worker's credits (docs/router.md, "What another
        worker's prompts cost"). Shorter credits keep the larger pieces: at 8k tokens, smaller ones
        cost two workers about 3 % of their throughput."""
        return LONG_CREDIT_PIECE if blocks > LONG_CREDIT_BLOCKS else CREDIT_NOW_BLOCKS

    def credit_foreign(self, pod_id: str, keys: list[int]) -> None:
        """Another router process (a worker or replica, over the booking bus) routed a prompt with
        these block keys to ``pod_id`` and credited them there: the same credit here, so this
        process's siblings and follow-ups of that prompt find the pod as that process's do. Without
        it a pod that publishes no KV events is known to hold a conversation only by the process
        that routed its last turn. A pod this process does not know is skipped. On the event loop it
        goes in pieces as a local credit does (``speculate``)."""
        if pod_id not in self.registry.pods:
            return
        self.speculate(pod_id, keys)

    def withdraw(self, pod_id: str, keys: list[int]) -> int:
        """Take back this process's credit of ``keys`` on ``pod_id`` (``PrefixIndex.withdraw``: only
        credits, never what the pod's events stored): the request it was made for never reached the
        pod's cache (``Lifecycle._unserved``). ``book`` shared the credit with the other router
        processes (``on_credit``), so they are told too (``on_withdraw``, the booking bus) and take
        back theirs (``withdraw_foreign``). Returns how many of ``keys`` were credits here. The pod's
        credits still going in pieces are put in whole first (``_put_in_whole``), as for a foreign
        withdrawal, so that the pieces of the withdrawn credit still to come do not undo it."""
        self._put_in_whole(pod_id)
        withdrawn = self.index.withdraw(pod_id, keys)
        if self.on_withdraw is not None and keys:
            self.on_withdraw(pod_id, keys)
        return int(withdrawn)

    def withdraw_foreign(self, pod_id: str, keys: list[int]) -> None:
        """Another router process took back its credit of ``keys`` on ``pod_id`` (``withdraw``), a
        credit it had shared with this one (``credit_foreign``): take back the same credit here, never
        what the pod's events stored. A pod this process does not know is skipped. The credit may
        still be coming in a piece a loop turn (``speculate``: the withdrawal can arrive in the
        receive pass that brought the credit): so the pod's credits going in pieces now are put in
        whole first, and the withdrawal follows them, once. Withdrawing again as each was all in
        took a newer credit of the same keys with it (the bus keeps a credit, its withdrawal and a
        new credit in their order), and cost a withdrawal per credit under way per withdrawal."""
        if pod_id not in self.registry.pods:
            return
        self._put_in_whole(pod_id)
        try:
            self.index.withdraw(pod_id, keys)
        except Exception:
            log.exception("withdrawing another router's credit failed")

    def _put_in_whole(self, pod_id: str) -> None:
        """The pod's credits going in a piece a loop turn (``_credit_in_pieces``), all put in now: the
        loop's pending step of each then finds it done."""
        for steps in self._in_pieces.pop(pod_id, {}):
            try:
                for _ in steps:
                    pass
            except Exception:  # the index is advisory; never fail over it
                log.exception("crediting a route to the index failed")

    def _credit_now(self, pod_id: str, keys: list[int]) -> None:
        try:
            if pod_id in self._with_events:
                self.index.speculate(pod_id, keys)
            else:
                self.index.record_route(pod_id, keys, self._kv_blocks(pod_id))
        except Exception:  # the index is advisory; never fail a request over it
            log.exception("crediting a route to the index failed")

    def _credit_in_pieces(self, pod_id: str, keys: list[int], piece: int) -> None:
        """``keys`` credited ``piece`` at a time, the first piece now and one more in each loop turn
        after; all at once without a running loop."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None:
            piece = 0
        if pod_id in self._with_events:
            steps: Iterator[None] = self._speculate_steps(pod_id, keys, piece)
        else:  # no events: credited until the TTL, at most the pod's KV blocks once scraped
            steps = self.index.credit_steps(pod_id, keys, self._kv_blocks(pod_id), piece)
        if loop is not None:
            self._in_pieces.setdefault(pod_id, {})[steps] = None
        self._credit_step(loop, steps, pod_id)

    def _speculate_steps(self, pod_id: str, keys: list[int], piece: int) -> Iterator[None]:
        step = piece if piece > 0 else max(1, len(keys))
        for i in range(0, len(keys), step):
            if i:
                yield
            self.index.speculate(pod_id, keys[i:i + step])

    def _credit_step(self, loop: asyncio.AbstractEventLoop | None, steps: Iterator[None], pod_id: str) -> None:
        try:
            next(steps)
        except StopIteration:
            self._credited(pod_id, steps)
            return
        except Exception:  # the index is advisory; never fail a request over it
            log.exception("crediting a route to the index failed")
            self._credited(pod_id, steps)
            return
        if loop is not None:
            loop.call_soon(self._credit_step, loop, steps, pod_id)

    def _credited(self, pod_id: str, steps: Iterator[None]) -> None:
        """A credit that went in pieces is all in (or was put in whole by ``withdraw_foreign``)."""
        under_way = self._in_pieces.get(pod_id)
        if under_way is None:
            return
        under_way.pop(steps, None)
        if not under_way:
            del self._in_pieces[pod_id]

    def _kv_blocks(self, pod_id: str) -> int | None:
        """The pod's KV cache in the index's blocks (its ``num_gpu_blocks`` are of its own block size)."""
        state = self.registry.pods.get(pod_id)
        if state is None or not state.num_gpu_blocks:
            return None
        return state.num_gpu_blocks * (state.block_size or self.block_size) // self.block_size

    def book(self, plan: Plan, cand: Candidate) -> Booking:
        """Hold the route through ``cand`` in the ledger (prefill work where the prompt is computed,
        KV room on a decode pod) and credit the prompt's blocks to the pods that will store them."""
        route = plan.decision.routes[cand.pod_id]
        pred = route.prediction
        prefilling = cand if route.prefill_pod == cand.pod_id else plan.snapshot.candidate(route.prefill_pod)
        rate = prefilling.prefill_tokens_per_s
        ticket = self.ledger.book(route.prefill_pod, pred.uncached_tokens)
        kv_ticket = self.ledger.book_kv(route.pod_id, route.kv_tokens) if route.kv_tokens else None
        held: tuple[str, ...] = (route.prefill_pod,)
        if route.pod_id != route.prefill_pod:
            held = (route.prefill_pod, route.pod_id)  # the decode pod stores the blocks it reads
        for pod_id in held:
            self.speculate(pod_id, plan.keys)
            if self.on_credit is not None and plan.keys:
                self.on_credit(pod_id, plan.keys)
        recency = getattr(self.index, "recency", None)
        # only a pod that publishes KV events reports its evictions: elsewhere the last-use times
        # would never be read, so they are not kept
        held = tuple(pod_id for pod_id in held if pod_id in self._with_events)
        if recency is not None:
            check = prefilling.evicting_check
            if 0 <= check < len(plan.keys):
                recency.expect_evicted(route.prefill_pod, plan.keys[check], 2.0 * route.ttft_s + CHECK_GRACE_S)
            for pod_id in held:
                recency.hold(pod_id, plan.keys)
        self.metrics.prompt_tokens.inc(plan.request.prompt_tokens)
        self.metrics.estimated_cached_tokens.inc(route.cached_tokens)
        self.metrics.predicted_ttft.observe(route.ttft_s)
        if route.mode == "remote":
            self.pd_metrics.transfer_predicted.observe(route.transfer_s)
            self.pd_metrics.transfer_tokens.inc(route.transfer_tokens)
        bs = self.block_size
        new_blocks = max(0, plan.request.prompt_tokens // bs - route.cached_tokens // bs) \
            if route.mode == "aggregated" else 0
        low, high = pred.interval(self.settings.ttft_interval_level, route.ttft_s)
        # positionally, in the field order of Booking (router/booking.py): one a request, and keyword
        # arguments cost a dataclass's __init__ about three times as much (see take_snapshot)
        return Booking(route.pod_id,                                     # pod_id
                       route.prefill_pod,                                # prefill_pod
                       ticket,                                           # prefill_ticket
                       pred.queue_s * rate + pred.uncached_tokens,       # work_tokens
                       route.ttft_s,                                     # predicted_ttft_s
                       route.cached_tokens,                              # cached_tokens
                       route.mode,                                       # mode
                       kv_ticket,                                        # kv_ticket
                       self._clock(),                                    # sent_at
                       new_blocks,                                       # new_blocks
                       prefilling.running,                               # running
                       pred.model_ttft_s if route.mode != "remote" else route.ttft_s,  # model_ttft_s
                       low,                                              # ttft_low_s
                       high,                                             # ttft_high_s
                       plan.keys if recency is not None else (),         # keys
                       held)                                             # held

    def first_token(self, booking: Booking, observe: bool = True) -> None:
        """The pod produced its first token: release the booking and learn from the TTFT."""
        if not booking.release(self.ledger):
            return
        self._count_event_source(booking)
        if observe:
            ttft = self._clock() - booking.sent_at
            self.metrics.observed_ttft.observe(ttft)
            self.metrics.prediction_error.observe(abs(ttft - booking.predicted_ttft_s))
            if ttft > 0:
                self.metrics.prediction_relative_error.observe(abs(ttft - booking.predicted_ttft_s) / ttft)
            where = "below" if ttft < booking.ttft_low_s else ("above" if ttft > booking.ttft_high_s else "inside")
            self.metrics.ttft_interval.labels(where).inc()
            if self.prediction_log is not None:
                self.prediction_log.write(booking, ttft)
            # remote: learnt from the sidecar's report (observe_answer); a pod that left the fleet
            # meanwhile is not learnt again (its calibration would come back and stay)
            if not booking.remote and booking.prefill_pod in self.registry.pods:
                self.calibrator.observe(booking.prefill_pod, booking.work_tokens, ttft, booking.model_ttft_s,
                                        booking.running)

    def finish(self, booking: Booking) -> None:
        """The request ended without a usable first-token time (error, non-streaming, cancelled)."""
        if booking.release(self.ledger):
            self._count_event_source(booking)

    def ended(self, booking: Booking) -> None:
        """The request is over (answered, failed or cancelled): release its booking if the first
        token has not, and date its blocks' last use on the pods that held them."""
        self.finish(booking)
        if booking.keys:
            recency = self.index.recency
            for pod_id in booking.held:
                recency.release(pod_id, booking.keys)

    def observe_answer(self, booking: Booking, headers: Mapping[str, str]) -> None:
        """A decode pod's sidecar answered: learn the prefill pod's speed from its prefill-leg report."""
        if booking.mode == "aggregated":
            return
        seconds = sidecar_prefill_seconds(headers, self.pd_metrics, booking.remote)
        if seconds is not None and booking.prefill_pod in self.registry.pods:
            self.calibrator.observe(booking.prefill_pod, booking.work_tokens, seconds)

    def _count_event_source(self, booking: Booking) -> None:
        """A pod that computed new full blocks has announced them (vLLM publishes BlockStored in the
        step that fills a block, before the first token): the event watchdog counts these requests,
        not all requests, since one answered wholly from cache publishes nothing."""
        if booking.new_blocks > 0 and booking.pod_id in self.registry.pods:
            self.event_sources[booking.pod_id] = self.event_sources.get(booking.pod_id, 0) + 1

    # ---- introspection ---------------------------------------------------------------------
    def pod_snapshot(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        sub_stats: dict[str, Any] = {}
        if self.subscriber is not None:
            try:
                sub_stats = self.subscriber.stats() or {}
            except Exception:
                sub_stats = {}
        for pid, p in self.registry.pods.items():
            cal = self.calibrator.pod(pid)
            n, tokens = self.ledger.inflight(pid), self.ledger.queued_tokens(pid, cal.rate)
            row: dict[str, Any] = {
                "healthy": 1.0 if p.healthy else 0.0, "waiting": p.waiting, "running": p.running,
                "waiting_deferred": p.waiting_deferred,
                "kv_usage": p.kv_usage, "scrape_age_seconds": self.registry.scrape_age(p),
                "booked_requests": n, "booked_tokens": tokens,
                "prefill_tokens_per_s": cal.rate, "overhead_seconds": cal.overhead_s,
                "per_running_seconds": cal.per_running_s,
                "mean_abs_prediction_error_seconds": (cal.abs_error_sum / cal.samples) if cal.samples else None,
            }
            try:
                ps = self.index.pod_stats(pid) or {}
                row["index_blocks"] = ps.get("blocks") if isinstance(ps, dict) else getattr(ps, "blocks", None)
            except Exception:
                pass
            lags = [s for key, s in _stats_for_pod(sub_stats, pid)]
            if lags:
                lag: list[float] = [s["lag_s"] for s in lags if isinstance(s, dict) and s.get("lag_s") is not None]
                age: list[float] = [s["last_event_age_s"] for s in lags
                                    if isinstance(s, dict) and s.get("last_event_age_s") is not None]
                row["event_lag_seconds"] = max(lag) if lag else None
                row["event_age_seconds"] = min(age) if age else None
            out[pid] = row
        return out


def _stats_for_pod(stats: Any, pod_id: str) -> list[tuple[Any, Any]]:
    """Subscriber stats entries that belong to ``pod_id`` (keyed by pod, or by (pod, endpoint))."""
    if not isinstance(stats, dict):
        return []
    found: list[tuple[Any, Any]] = []
    for key, value in stats.items():
        if key == pod_id or (isinstance(key, tuple) and key and key[0] == pod_id) or \
                (isinstance(key, str) and key.startswith(pod_id + "|")) or \
                (isinstance(value, dict) and value.get("pod_id") == pod_id):
            if isinstance(value, dict) and "endpoints" in value and isinstance(value["endpoints"], dict):
                found.extend((k, v) for k, v in value["endpoints"].items())
            elif isinstance(value, list):
                found.extend((key, v) for v in value)
            else:
                found.append((key, value))
    return found
