"""Settings of ``kvroute replay`` (YAML file < env ``KVROUTE_REPLAY_*`` < flags)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from replay.workloads import MAX_REQUESTS as COUNT_MAX
from replay.workloads import MAX_TOKENS


class ReplaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVROUTE_REPLAY_", env_nested_delimiter="__", extra="ignore")

    # Target
    target: str = Field("http://127.0.0.1:8000", description="Base URL of the router or pod to load; several, "
                        "comma-separated (router replicas without a load balancer), take the requests in turn")
    endpoint: Literal["completions", "chat"] = Field(
        "completions",
        description="completions: token-id prompts to /v1/completions; chat: text to /v1/chat/completions")
    model: str | None = Field(None, description="Model name to send; by default the first one /v1/models lists")
    headers: dict[str, str] = Field(default_factory=dict, description="Extra request headers as a JSON object")
    extra_body: dict = Field(default_factory=dict, description="Extra fields merged into every request body (JSON)")
    ignore_eos: bool = Field(True, description="Ask for exactly the workload's output length (ignore_eos, min_tokens)")

    # Workload
    workload: str = Field("multiturn", description="mooncake:PATH, azure:PATH, multiturn or shared-prefix")
    seed: int = Field(0, ge=0, description="Seed for prompts, session order and arrivals")
    block_size: int = Field(512, gt=0, le=MAX_TOKENS, description="Tokens per trace hash id (Mooncake uses 512)")
    vocab_size: int = Field(256, ge=2, description="Prompt token ids are drawn from 0..vocab-size-1")
    system_prompts: int = Field(20, gt=0, le=COUNT_MAX, description="multiturn: number of distinct system prompts")
    system_prompt_len: int = Field(2048, ge=0, le=MAX_TOKENS,
                                   description="multiturn/shared-prefix: tokens per system prompt")
    sessions: int = Field(400, gt=0, le=COUNT_MAX, description="multiturn: number of sessions")
    turns: int = Field(5, gt=0, le=COUNT_MAX, description="multiturn: turns per session")
    turn_tokens: int = Field(300, gt=0, le=MAX_TOKENS, description="multiturn: new tokens each turn appends")
    output_len: int = Field(100, gt=0, le=MAX_TOKENS, description="multiturn/shared-prefix: output tokens per request")
    num_groups: int = Field(10, gt=0, le=COUNT_MAX, description="shared-prefix: groups (distinct system prompts)")
    prompts_per_group: int = Field(10, gt=0, le=COUNT_MAX, description="shared-prefix: questions per group")
    question_len: int = Field(256, gt=0, le=MAX_TOKENS, description="shared-prefix: tokens per question")
    max_output_len: int | None = Field(None, gt=0, le=MAX_TOKENS, description="Cap every request's output length")

    # Arrivals
    arrival: Literal["auto", "trace", "poisson", "gamma", "constant"] = Field(
        "auto", description="Arrival process; auto = trace timestamps for traces, else poisson")
    rate: float | None = Field(None, gt=0, allow_inf_nan=False,
                               description="Requests per second for poisson, gamma and constant")
    burstiness: float = Field(1.0, gt=0, allow_inf_nan=False,
                              description="Gamma shape for --arrival gamma (1 = Poisson, <1 burstier)")
    time_scale: float = Field(1.0, gt=0, allow_inf_nan=False,
                              description="Trace arrivals: send time = trace time x this (0.1 = 10x faster)")

    # Limits
    duration: float | None = Field(None, description="Send only requests scheduled before this many seconds")
    max_requests: int | None = Field(None, description="Send at most this many requests")
    max_concurrency: int | None = Field(None, gt=0, description="At most this many requests in flight (the rest wait)")
    max_input_len: int | None = Field(None, gt=0, description="Longest prompt sent, in tokens")
    input_len_policy: Literal["truncate", "skip"] = Field(
        "truncate", description="Longer prompts are cut to --max-input-len (prefix kept) or skipped")
    request_timeout: float = Field(600.0, gt=0, allow_inf_nan=False,
                                   description="Seconds of silence on a stream before it counts as an error")
    drain_timeout: float | None = Field(None, ge=0, allow_inf_nan=False,
                                        description="After the last send, wait at most this long for streams")

    # SLO and measurement
    slo_ttft: float | None = Field(None, gt=0, allow_inf_nan=False,
                                   description="TTFT objective in seconds (for SLO attainment and goodput)")
    slo_tpot: float | None = Field(None, gt=0, allow_inf_nan=False, description="TPOT objective in seconds (optional)")
    send_slo_header: bool = Field(False, description="Send --slo-ttft to the router as header x-slo-ttft-ms")
    pod_metrics: list[str] = Field(
        default_factory=list,
        description="Pod URLs whose prefix-cache counters give the hit rate (several URLs or a JSON list)")
    lateness_warn_ms: float = Field(10.0, ge=0, allow_inf_nan=False,
                                    description="Warn when send lateness p99 exceeds this")

    # Outputs
    label: str | None = Field(None, description="Name of this run in reports and file names")
    result_dir: str = Field("results", description="Directory for the JSON result and plots")
    result_file: str | None = Field(None, description="JSON result file name (default: LABEL-WORKLOAD-TIME.json)")
    save_detailed: bool = Field(False, description="Include per-request records in the JSON")
    plots: bool = Field(True, description="Write PNG plots next to the JSON")
    progress: bool = Field(True, description="Print a progress line while the run goes")
