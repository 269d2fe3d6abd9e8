"""Every knob of the simulated pod, in one typed object (defaults < YAML < env ``KVROUTE_SIM_*`` < flags).

``kvroute sim --help`` is generated from these fields, so the description of each field is its
documentation. The cost-model defaults are round figures for a 7-8B model on one modern GPU
(about 20k prompt tokens/s of prefill, ~5 ms per engine step); they are meant to give realistic
shapes (queueing, prefix hits cutting TTFT, decode slowing with resident KV), not exact numbers.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class SimSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVROUTE_SIM_", extra="ignore")

    # --- serving -------------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="address the HTTP servers bind to")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port of pod 0; pod i listens on port+i")
    count: int = Field(1, ge=1, le=64, description="number of simulated pods run by this one process")
    model: str = Field("sim-model", description="served model name (the only model /v1/models lists)")
    pod_name: str = Field("", description="pod id used in the KV-event topic kv@<pod>@<model>; "
                                          "empty = <host>:<http port>; with --count N, '-<i>' is appended")
    engine_id: str = Field("", description="NIXL engine id; empty = sim-<http port>; with --count N, "
                                           "'-<i>' is appended")
    tokenizer: str = Field("byte", description="'byte' (one token per UTF-8 byte) or a path to a "
                                               "Hugging Face tokenizer.json (or its folder)")
    max_model_len: int = Field(32768, ge=16, description="longest prompt + completion in tokens")
    enable_prompt_tokens_details: bool = Field(False, description=(
        "as vLLM's --enable-prompt-tokens-details: usage carries prompt_tokens_details.cached_tokens (the "
        "prompt tokens served from the prefix cache); off, as vLLM's default, it is null"))
    default_max_tokens: int = Field(16, ge=1, description="where the simulated model stops ('stop') when a "
                                    "chat request sets no max_tokens, or a completion sets max_tokens null (a "
                                    "completion without the field gets vLLM's default of 16, 'length')")
    sse_keep_alive_interval: float = Field(0.0, ge=0, description=(
        "as vLLM's --sse-keep-alive-interval: a chat or completion stream sends ': keep-alive' comment "
        "events while no event has come for this many seconds (waiting, prefilling); 0, as vLLM's default, "
        "sends none"))
    responses_store: bool = Field(False, description=(
        "as vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1: /v1/responses keeps each response asked to be stored "
        "(store: true, the default) in memory, for GET /v1/responses/{id} and previous_response_id; off, as "
        "vLLM's default, store is ignored and every id is unknown (404)"))
    responses_store_size: int = Field(10000, ge=1, description=(
        "most responses the store keeps (the oldest is dropped first); vLLM's store has no bound"))

    # --- KV cache ---------------------------------------------------------------------------------
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    num_gpu_blocks: int = Field(4096, ge=1, description=(
        "KV blocks per engine (capacity = this x block size); a data-parallel pod's vllm:cache_config_info "
        "shows the sum over its engines, as vLLM's API server does"))
    data_parallel_size: int = Field(1, ge=1, le=64, description=(
        "engines behind this pod's one HTTP server, as vLLM's --data-parallel-size: each with its own cache, "
        "queue and KV-event ports (endpoint and replay + rank; with --kv-events-port P: events P..P+N-1, "
        "replay P+N..P+2N-1), batches carrying its rank, /metrics per engine label; a request goes to the "
        "rank its X-data-parallel-rank header names, else to the least loaded one (vLLM's balancer, which "
        "ignores the cache)"))
    lora_modules: list[str] = Field(default_factory=list, description=(
        "LoRA adapters served besides the base model, as vLLM's --lora-modules name=path: a request naming one "
        "as its model is answered, keyed with ('lora', name, path) in every block's hash and announced with "
        "lora_id/lora_name (ids 1, 2, ... in this order)"))

    @field_validator("lora_modules")
    @classmethod
    def _lora_modules(cls, v: list[str]) -> list[str]:
        names = []
        for item in v:
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"a LoRA module is name=path, got {item!r}")
            names.append(name.strip())
        if len(set(names)) != len(names):
            raise ValueError(f"LoRA module names repeat: {names}")
        return v

    prefix_caching_hash_algo: Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] = Field(
        "sha256", description="the block-hash function, as vLLM's --prefix-caching-hash-algo")
    hash_seed: str | None = Field(None, description="the seed of the chain's root, as vLLM's PYTHONHASHSEED "
                                  "(unset: PYTHONHASHSEED if set, else vLLM's fixed seed for sha256*, a random one "
                                  "for xxhash*)")
    hybrid_window_blocks: int = Field(0, ge=0, description="a hybrid model: besides its full-attention KV group "
                                      "(group_idx 0) a sliding-window group (group_idx 1, the same hashes) that "
                                      "keeps only a request's last N blocks: its BlockStored events mirror group "
                                      "0's and it removes the older blocks when the request finishes; 0 = off")

    # --- timing -----------------------------------------------------------------------------------
    timing: Literal["cost", "seed"] = Field(
        "cost", description="'cost': step-based engine (token budget, chunked prefill, decode) with a "
                            "cost model; 'seed': one FIFO prefill server at --prefill-tokens-per-s "
                            "computing only the uncached part, cache updated at admission")
    max_num_seqs: int = Field(256, ge=1, description="cost mode: most requests in the running batch")
    max_num_batched_tokens: int = Field(8192, ge=1, description="cost mode: token budget of one step "
                                                                "(chunked prefill splits longer prompts)")
    step_overhead_s: float = Field(0.004, ge=0, description="cost mode: fixed seconds per engine step")
    compute_s_per_token: float = Field(5e-5, ge=0, description="cost mode: seconds per token computed in "
                                                              "a step (prefill or decode); 5e-5 = 20k tok/s")
    kv_read_s_per_token: float = Field(2e-8, ge=0, description="cost mode: seconds per resident KV token "
                                                               "of the scheduled requests (attention reads)")
    prefill_tokens_per_s: float = Field(20000.0, gt=0, description="seed mode: prefill speed of the FIFO server")
    decode_s_per_token: float = Field(0.01, ge=0, description="seed mode: seconds between output tokens")

    # --- KV events ------------------------------------------------------------------------------
    kv_events_config: dict[str, Any] | None = Field(
        None, description="vLLM's KVEventsConfig as JSON (enable_kv_cache_events, publisher, endpoint, "
                          "replay_endpoint, buffer_steps, hwm, max_queue_size, topic); pod i adds 2i to "
                          "the port of a binding tcp endpoint and of the replay endpoint")
    kv_events_port: int | None = Field(
        None, ge=1, le=65535, description="shortcut: PUB on tcp://*:E, replay on E+1, topic kv@<pod>@<model> "
                                          "(pod i: E+2i and E+2i+1)")
    kv_events_format: Literal["map", "array"] = Field(
        "map", description="event encoding: 'map' (type-tagged maps, vLLM >= 0.24) or 'array' (legacy "
                           "tagged arrays, vLLM <= 0.23)")

    # --- NIXL prefill/decode --------------------------------------------------------------------
    kv_bytes_per_token: int = Field(131072, ge=1, description="KV bytes per token moved by a NIXL read "
                                                              "(131072 = Llama-3-8B in bf16)")
    nixl_bandwidth_bytes_per_s: float = Field(25e9, gt=0, description="simulated link bandwidth of a NIXL read")
    nixl_latency_s: float = Field(0.001, ge=0, description="simulated fixed latency of a NIXL read")
    nixl_lease_timeout_s: float = Field(480.0, gt=0, description="prefill side: seconds a lease on blocks "
                                                                 "waits for the decoder's read "
                                                                 "(VLLM_NIXL_ABORT_REQUEST_TIMEOUT)")
    nixl_side_channel_host: str = Field(
        "", description="prefill side: host advertised as remote_host for decoders to read from "
                        "(VLLM_NIXL_SIDE_CHANNEL_HOST); empty = --host, or 127.0.0.1 when --host is a "
                        "wildcard (0.0.0.0, ::)")
    nixl_allowed_hosts: list[str] = Field(
        default_factory=lambda: ["127.0.0.1", "localhost", "::1"],
        description="decode side: hosts a do_remote_prefill request may make this pod read from "
                    "('*' = any)")

    # --- faults (all off by default; also settable per request and at run time) ------------------
    fault_status: int | None = Field(None, ge=400, le=599, description="answer every generation "
                                                                       "request with this error status")
    fault_delay_s: float = Field(0.0, ge=0, description="extra delay before every generation request")
    fault_drop_after_chunks: int | None = Field(None, ge=0, description="drop the connection after this "
                                                                         "many response chunks")
    fault_events_stop: bool = Field(False, description="stop publishing KV events (the cache still changes)")
    fault_slowdown: float = Field(1.0, gt=0, description="multiply every step / prefill time by this factor")
    fault_eos_after: int | None = Field(None, ge=1, description="the Nth output token is EOS: requests without "
                                                                "ignore_eos stop there ('stop'; not before "
                                                                "min_tokens); a NIXL prefill that stops so still "
                                                                "leases its blocks and answers kv_transfer_params, "
                                                                "as vLLM 0.32 does")

    log_level: Literal["debug", "info", "warning", "error"] = Field("warning", description="log level")
    log_format: Literal["text", "json"] = Field("text", description="log lines: 'text' or 'json' (one object "
                                                "per line: ts, level, logger, pid, msg, exc)")

    @field_validator("nixl_allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [h.strip() for h in v.split(",") if h.strip()]
        return v

    @property
    def advertised_host(self) -> str:
        """The host a prefill pod names in remote_host: the side-channel host, else a concrete --host."""
        if self.nixl_side_channel_host:
            return self.nixl_side_channel_host
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "", "[::]") else self.host

    @model_validator(mode="after")
    def _check(self) -> SimSettings:
        if self.port and self.port + self.count - 1 > 65535:
            raise ValueError("--port + --count - 1 must be a valid port")
        if self.kv_events_config is not None and self.kv_events_port is not None:
            raise ValueError("give either --kv-events-config or --kv-events-port, not both")
        return self
