"""Prefill/decode disaggregation: which decode pod, whether to prefill remotely, and where.

Pure functions over immutable views, so a decision can be replayed, explained (``/debug/route``)
and tested on hand-built fleets. The decision has three parts:

1. **Decode pod.** It must have KV room for the prompt plus the expected output (free KV from its
   own ``vllm:kv_cache_usage_perc``, less what the router has sent there and not yet seen
   start). Among the pods with room, those whose predicted time per output token is within
   ``tpot_tolerance`` of the best are equally good for decoding; they are then ranked by the
   request's predicted TTFT through them (so a pod holding the conversation wins), pods meeting
   the objective first.
2. **The decider** for that decode pod: ``never`` (prefill locally), ``always`` (remote whenever a
   prefill pod is up), ``prefix`` (llm-d's rule: remote when the part of the prompt the decode pod
   lacks is at least ``non_cached_tokens`` and the prompt at least ``prompt_tokens``), and
   ``predicted``: remote only when the predicted TTFT through the best prefill pod, KV transfer
   included, beats prefilling on the decode pod itself.
3. **Prefill pod**, by predicted TTFT including the transfer of the blocks the decode pod lacks
   (``tokens x kv_bytes_per_token / link bandwidth + link latency``).

Prefill-side and local predictions reuse ``predictor.predict`` (each pod one FIFO prefill server).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .admission import Verdict, admit, likely_to_meet, objective_limit
from .predictor import predict
from .snapshot import Candidate, Prediction, RequestView


@dataclass(frozen=True, slots=True)
class PDParams:
    """The knobs of P/D scheduling (from the router's settings)."""

    decider: str = "predicted"
    non_cached_tokens: int = 512          # prefix decider: least uncached tokens for a remote prefill (0: off)
    prompt_tokens: int = 1024             # prefix decider: least prompt tokens for a remote prefill
    kv_bytes_per_token: float = 131072.0  # KV bytes one token occupies (all layers)
    link_bandwidth_bytes_per_s: float = 25e9
    link_latency_s: float = 0.001
    decode_step_s: float = 0.004          # one decode step of an idle decode pod
    step_s_per_seq: float = 0.00005       # added per sequence in the batch
    step_s_per_kv_token: float = 2e-8     # added per resident KV token (attention reads)
    tpot_tolerance: float = 0.10          # decode pods within this fraction of the best TPOT tie
    work_weight: float = 0.0              # prefill-pod ranking: weight of the request's own prefill time
    remote_margin_s: float = 0.0          # predicted: remote must win by at least this


@dataclass(frozen=True, slots=True)
class DecodeView:
    """A decode pod: the candidate (for its prefix match and local-prefill queue) and its KV state."""

    candidate: Candidate
    kv_capacity_tokens: int | None = None  # num_gpu_blocks x block_size, if the pod reports it
    kv_booked_tokens: float = 0.0          # KV the router sent there that the pod's usage may not show yet
    active_requests: int = 0               # requests the router has in flight there

    @property
    def pod_id(self) -> str:
        return self.candidate.pod_id


@dataclass(frozen=True, slots=True)
class RemoteChoice:
    """Prefilling on one prefill pod for one decode pod."""

    prefill_pod: str
    prediction: Prediction
    transfer_tokens: int
    transfer_s: float
    ttft_s: float


@dataclass(frozen=True, slots=True)
class Option:
    """How the request would be served through one decode pod."""

    decode_pod: str
    mode: str                        # "remote" or "local"
    reason: str                      # the decider's reasoning, in words
    ttft_s: float                    # predicted TTFT of the chosen mode
    local: Prediction                # local prefill on the decode pod
    remote: RemoteChoice | None      # best remote prefill, if any prefill pod is up
    remote_ranking: tuple[RemoteChoice, ...]
    tpot_s: float
    kv_free_tokens: float | None     # None: capacity unknown
    kv_needed_tokens: int
    has_room: bool
    uncached_on_decode: int

    @property
    def prefill_pod(self) -> str | None:
        return self.remote.prefill_pod if self.mode == "remote" and self.remote else None


@dataclass(frozen=True, slots=True)
class PDDecision:
    ranked: list[Option]            # decode pods, best first; the router tries them in this order
    verdict: Verdict
    decider: str
    best_tpot_s: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def chosen(self) -> Option | None:
        return self.ranked[0] if self.ranked and self.verdict.admitted else None

    @property
    def best_ttft_s(self) -> float | None:
        return min((o.ttft_s for o in self.ranked if o.has_room), default=None)


def transfer_seconds(tokens: int, params: PDParams) -> float:
    """Time to move ``tokens`` tokens of KV from a prefill pod to a decode pod."""
    if tokens <= 0:
        return 0.0
    bw = max(params.link_bandwidth_bytes_per_s, 1.0)
    return params.link_latency_s + tokens * params.kv_bytes_per_token / bw


def kv_free_tokens(view: DecodeView) -> float | None:
    """Free KV tokens on the decode pod: its own usage, less the router's not-yet-visible bookings."""
    if not view.kv_capacity_tokens:
        return None
    usage = min(max(view.candidate.kv_usage, 0.0), 1.0)
    return view.kv_capacity_tokens * (1.0 - usage) - view.kv_booked_tokens


def predicted_tpot(view: DecodeView, request_tokens: int, params: PDParams) -> float:
    """Seconds per output token once the request joins the pod's batch.

    A decode step costs a fixed part, a part per sequence and a part per resident KV token (the
    attention reads), which is how the batch and the KV usage slow every sequence on the pod.
    """
    c = view.candidate
    batch = max(c.running, view.active_requests) + 1
    resident = float(request_tokens)
    if view.kv_capacity_tokens:
        resident += min(max(c.kv_usage, 0.0), 1.0) * view.kv_capacity_tokens + view.kv_booked_tokens
    return params.decode_step_s + params.step_s_per_seq * batch + params.step_s_per_kv_token * resident


def remote_choices(decode: DecodeView, prefills: Sequence[Candidate], request: RequestView,
                   params: PDParams, limit_s: float | None = None,
                   miss_tolerance: float | None = None) -> list[RemoteChoice]:
    """Every prefill pod for this decode pod, best first: likely to meet ``limit_s`` (admission's
    test, ``admission.likely_to_meet``), then cost, then TTFT."""
    lacking = max(0, request.prompt_tokens - int(decode.candidate.effective_cached_tokens))
    moved = transfer_seconds(lacking, params)
    # after the read the request joins the decode pod's waiting queue, behind the prefill work
    # already booked there (what is left of it by then), and then takes one step to compute the
    # last prompt token and its first output token
    decode_queue_s = predict(decode.candidate, request).queue_s
    tail = params.decode_step_s + decode.candidate.overhead_s
    out = []
    for p in prefills:
        pred = predict(p, request)
        arrival = pred.ttft_s + moved
        out.append(RemoteChoice(prefill_pod=p.pod_id, prediction=pred, transfer_tokens=lacking,
                                transfer_s=moved, ttft_s=max(arrival, decode_queue_s) + tail))
    tiebreak = {p.pod_id: (p.load, p.tiebreak) for p in prefills}

    def key(r: RemoteChoice) -> tuple[bool, float, int, int]:
        misses = not likely_to_meet(r.prediction, limit_s, miss_tolerance, r.ttft_s)
        cost = r.ttft_s + params.work_weight * r.prediction.prefill_s
        return (misses, round(r.ttft_s if misses else cost, 6)) + tiebreak[r.prefill_pod]

    return sorted(out, key=key)


# ---- deciders: local or remote prefill for one decode pod --------------------------------------
# A decider is a function (local, best remote or None, uncached tokens on the decode pod, request,
# params) -> ("remote" | "local", the reasoning in words), registered by name with ``@decider``;
# ``pd_decider`` in the settings names one. Adding one is one function here (or in any module
# imported before the settings load) with the decorator.

Decider = Callable[[Prediction, RemoteChoice | None, int, RequestView, PDParams], tuple[str, str]]
DECIDER_FUNCTIONS: dict[str, Decider] = {}


def decider(name: str) -> Callable[[Decider], Decider]:
    def add(fn: Decider) -> Decider:
        if name in DECIDER_FUNCTIONS:
            raise ValueError(f"P/D decider {name!r} is already registered")
        DECIDER_FUNCTIONS[name] = fn
        return fn
    return add


@decider("never")
def _never(local: Prediction, remote: RemoteChoice | None, uncached: int, request: RequestView,
           params: PDParams) -> tuple[str, str]:
    return "local", "decider 'never'"


@decider("always")
def _always(local: Prediction, remote: RemoteChoice | None, uncached: int, request: RequestView,
            params: PDParams) -> tuple[str, str]:
    return "remote", "decider 'always'"


@decider("prefix")
def _prefix(local: Prediction, remote: RemoteChoice | None, uncached: int, request: RequestView,
            params: PDParams) -> tuple[str, str]:
    """llm-d's rule: remote when the decode pod lacks at least ``non_cached_tokens`` of the prompt
    and the prompt has at least ``prompt_tokens``."""
    if params.non_cached_tokens <= 0:  # llm-d: 0 disables the decider
        return "local", "prefix decider disabled (non_cached_tokens 0)"
    if uncached < params.non_cached_tokens:
        return "local", f"{uncached} uncached tokens on the decode pod < non_cached_tokens {params.non_cached_tokens}"
    if request.prompt_tokens < params.prompt_tokens:
        return "local", f"prompt of {request.prompt_tokens} tokens < prompt_tokens {params.prompt_tokens}"
    return "remote", (f"{uncached} uncached tokens >= {params.non_cached_tokens} and prompt "
                      f"{request.prompt_tokens} >= {params.prompt_tokens}")


@decider("predicted")
def _predicted(local: Prediction, remote: RemoteChoice | None, uncached: int, request: RequestView,
               params: PDParams) -> tuple[str, str]:
    """Remote only when the predicted TTFT through the best prefill pod, transfer included, beats a
    local prefill by ``remote_margin_s``."""
    assert remote is not None
    local_ms, remote_ms = local.ttft_s * 1000, remote.ttft_s * 1000
    if remote.ttft_s + params.remote_margin_s < local.ttft_s:
        return "remote", (f"remote via {remote.prefill_pod} {remote_ms:.1f} ms (transfer "
                          f"{remote.transfer_s * 1000:.1f} ms) beats local {local_ms:.1f} ms")
    return "local", (f"local {local_ms:.1f} ms beats remote via {remote.prefill_pod} {remote_ms:.1f} ms "
                     f"(transfer {remote.transfer_s * 1000:.1f} ms)")


def decide_mode(name: str, local: Prediction, remote: RemoteChoice | None, uncached_on_decode: int,
                request: RequestView, params: PDParams) -> tuple[str, str]:
    """("remote" | "local", the reasoning) for one decode pod; local whenever no prefill pod is up,
    and for a request one prefill leg cannot serve (``kvcommon.transfer.one_prefill_cannot_serve``:
    the sidecar prefills it on the decode pod)."""
    if not request.single_prefill:
        return "local", ("several prompts or choices, or prompt logprobs: one prefill's kv_transfer_params "
                         "cannot serve them")
    if remote is None:
        return "local", "no prefill pod is available"
    return DECIDER_FUNCTIONS[name](local, remote, uncached_on_decode, request, params)


def option_for(decode: DecodeView, prefills: Sequence[Candidate], request: RequestView, output_tokens: int,
               params: PDParams, limit_s: float | None = None, miss_tolerance: float | None = None) -> Option:
    local = predict(decode.candidate, request)
    ranking = remote_choices(decode, prefills, request, params, limit_s, miss_tolerance) if prefills else []
    best_remote = ranking[0] if ranking else None
    uncached = max(0, request.prompt_tokens - int(decode.candidate.effective_cached_tokens))
    mode, reason = decide_mode(params.decider, local, best_remote, uncached, request, params)
    if params.decider == "predicted" and limit_s is not None and best_remote is not None and request.single_prefill:
        # the decider compares medians; admission asks each path's risk: a path likely to meet the
        # objective beats one that is not, or the request is refused while this pod could serve it
        remote_path = mode == "remote"
        if not likely_to_meet(best_remote.prediction if remote_path else local, limit_s, miss_tolerance,
                              best_remote.ttft_s if remote_path else None) and \
                likely_to_meet(local if remote_path else best_remote.prediction, limit_s, miss_tolerance,
                               None if remote_path else best_remote.ttft_s):
            mode = "local" if remote_path else "remote"
            reason = f"{reason}; but only {mode} is likely to meet the objective"
    need = request.prompt_tokens + max(output_tokens, 0)
    free = kv_free_tokens(decode)
    ttft = best_remote.ttft_s if mode == "remote" and best_remote else local.ttft_s
    return Option(decode_pod=decode.pod_id, mode=mode, reason=reason, ttft_s=ttft, local=local,
                  remote=best_remote, remote_ranking=tuple(ranking), tpot_s=predicted_tpot(decode, need, params),
                  kv_free_tokens=free, kv_needed_tokens=need, has_room=free is None or free >= need,
                  uncached_on_decode=uncached)


def path_prediction(o: Option) -> Prediction:
    """The prediction of the pod that prefills an option's request (its error model judges the path)."""
    return o.remote.prediction if o.mode == "remote" and o.remote else o.local


def decide_pd(decodes: Sequence[DecodeView], prefills: Sequence[Candidate], request: RequestView,
              output_tokens: int, params: PDParams, admission: bool = True, slack: float = 1.0,
              miss_tolerance: float | None = None) -> PDDecision:
    """Rank the decode pods (each with its prefill plan) and admit or reject the request."""
    if params.decider not in DECIDER_FUNCTIONS:
        raise ValueError(f"unknown P/D decider {params.decider!r}; expected one of {', '.join(DECIDER_FUNCTIONS)}")
    limit = objective_limit(request, slack)
    options = [option_for(d, prefills, request, output_tokens, params, limit, miss_tolerance) for d in decodes]
    if not options:
        return PDDecision(ranked=[], verdict=Verdict(False, "no-pods"), decider=params.decider)
    roomy = [o for o in options if o.has_room]
    best_tpot = min((o.tpot_s for o in roomy), default=None)
    tiebreak = {d.pod_id: (d.candidate.load, d.candidate.tiebreak) for d in decodes}
    # the work a path adds to the fleet: the prefill, and for a remote one the transfer too (it holds
    # the link and both pods' blocks, and copies the context to another decode pod)
    own_work = {o.decode_pod: (o.remote.prediction.prefill_s + o.remote.transfer_s if o.mode == "remote" and o.remote
                               else o.local.prefill_s) for o in options}

    def key(o: Option) -> tuple[int, bool | int, bool | int, float, int, int]:
        if not o.has_room:  # least short of room first, for requests that may not be refused
            short = o.kv_needed_tokens - (o.kv_free_tokens or 0.0)
            return (1, 0, 0, short) + tiebreak[o.decode_pod]
        misses = not likely_to_meet(path_prediction(o), limit, miss_tolerance, o.ttft_s)
        slow = best_tpot is not None and o.tpot_s > best_tpot * (1.0 + params.tpot_tolerance) + 1e-12
        cost = o.ttft_s if misses else o.ttft_s + params.work_weight * own_work[o.decode_pod]
        return (0, misses, slow, round(cost, 6)) + tiebreak[o.decode_pod]

    ranked = sorted(options, key=key)
    notes = []
    if not roomy:
        notes.append("no decode pod has KV room for the prompt and the expected output")
        verdict = Verdict(True, "exempt") if (request.exempt and admission) else \
            (Verdict(True, "no-objective") if not admission else Verdict(False, "kv"))
    else:  # each path's TTFT with the error model of the pod that prefills it
        verdict = admit([path_prediction(o) for o in roomy], request, admission, slack, miss_tolerance,
                        ttfts=[o.ttft_s for o in roomy])
    return PDDecision(ranked=ranked, verdict=verdict, decider=params.decider, best_tpot_s=best_tpot, notes=notes)
