"""From settings to a concrete plan: the request specs and their send offsets."""

from __future__ import annotations

from dataclasses import replace

from replay import arrivals, workloads
from replay.settings import ReplaySettings
from replay.workloads import RequestSpec, TraceError


def build_workload(settings: ReplaySettings) -> list[RequestSpec]:
    """The workload named by ``settings.workload`` (``mooncake:PATH``, ``azure:PATH``, ...)."""
    spec = settings.workload.strip()
    kind, _, path = spec.partition(":")
    seed, vocab_size = settings.seed, settings.vocab_size
    if kind == "mooncake":
        if not path:
            raise TraceError("mooncake needs a path: mooncake:PATH")
        specs = workloads.mooncake(path, block_size=settings.block_size, seed=seed, vocab_size=vocab_size)
    elif kind == "azure":
        if not path:
            raise TraceError("azure needs a path: azure:PATH")
        specs = workloads.azure(path, block_size=settings.block_size, seed=seed, vocab_size=vocab_size)
    elif kind == "multiturn":
        specs = workloads.multiturn(system_prompts=settings.system_prompts,
                                    system_prompt_len=settings.system_prompt_len, sessions=settings.sessions,
                                    turns=settings.turns, turn_tokens=settings.turn_tokens,
                                    output_len=settings.output_len, seed=seed, vocab_size=vocab_size)
    elif kind in ("shared-prefix", "shared_prefix"):
        specs = workloads.shared_prefix(num_groups=settings.num_groups,
                                        prompts_per_group=settings.prompts_per_group,
                                        system_prompt_len=settings.system_prompt_len,
                                        question_len=settings.question_len, output_len=settings.output_len,
                                        seed=seed, vocab_size=vocab_size)
    else:
        raise TraceError(f"unknown workload {spec!r}; use mooncake:PATH, azure:PATH, multiturn or shared-prefix")
    specs = workloads.limit_input_len(specs, settings.max_input_len, settings.input_len_policy)
    if settings.max_output_len:
        specs = [replace(s, output_len=min(s.output_len, settings.max_output_len)) for s in specs]
    return specs


def arrival_kind(settings: ReplaySettings, specs: list[RequestSpec]) -> str:
    if settings.arrival != "auto":
        return settings.arrival
    has_times = bool(specs) and specs[0].timestamp is not None
    if has_times and settings.rate is None:
        return "trace"
    return "poisson"


def build_plan(settings: ReplaySettings) -> tuple[list[RequestSpec], list[float], str]:
    """(requests, send offsets in seconds, arrival process name), cut to the run's limits."""
    specs = build_workload(settings)
    kind = arrival_kind(settings, specs)
    offsets = arrivals.schedule(kind, len(specs), rate=settings.rate, burstiness=settings.burstiness,
                                seed=settings.seed, timestamps=[s.timestamp for s in specs],
                                time_scale=settings.time_scale)
    n = arrivals.cut(offsets, duration=settings.duration, max_requests=settings.max_requests)
    return specs[:n], offsets[:n], kind
