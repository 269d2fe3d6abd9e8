"""The router's own settings (``kvroute serve``): ``RouterSettings``, ``PodConfig``, ``EventEndpoint``, ``ApiKey``.

They are read by the shared loader in ``kvcommon/settings.py`` (defaults < a YAML file < env
``KVROUTE_*`` < CLI flags), as the sidecar's and the simulated pod's settings are.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvcommon.logs import LogFormat, check_level
from router.scheduling.pd import DECIDER_FUNCTIONS
from router.scheduling.scorers import build_scoring

PodRole = Literal["prefill", "decode", "both"]
DiscoveryMode = Literal["static", "dns", "kubernetes"]
PolicyName = Literal["random", "round-robin", "least-load", "cache-only", "predicted-ttft"]


class EventEndpoint(BaseModel):
    """One ZeroMQ KV-event publisher of a pod (one per data-parallel rank)."""

    model_config = {"extra": "forbid"}  # a misspelt field fails start-up rather than going unread

    endpoint: str = Field(description="PUB endpoint to subscribe to, e.g. tcp://10.0.0.5:5557")
    replay: str | None = Field(None, description="ROUTER replay endpoint for missed batches, e.g. tcp://10.0.0.5:5558")
    topic: str = Field("", description="topic prefix to subscribe to ('' = all)")


def _http_url(v: str, what: str) -> str:
    if not v.startswith(("http://", "https://")):
        scheme = v.split("://", 1)[0] if "://" in v else ""
        # not the url itself: it may carry a password (scheme://user:password@host)
        raise ValueError(f"{what} must start with http:// or https://" + (f", not {scheme[:16]}://" if scheme else ""))
    if not v.split("://", 1)[1].split("/", 1)[0] or any(c.isspace() for c in v):
        raise ValueError(f"{what} must name a host and hold no spaces")
    return v.rstrip("/")


class PodConfig(BaseModel):
    """A pod of the fleet: where it serves HTTP, what it serves, where it publishes KV events."""

    model_config = {"extra": "forbid"}  # `kv_event:` or `modle:` would otherwise be dropped without a word

    id: str = Field(description="unique pod id, used in metrics and the x-kvroute-pod header")
    url: str = Field(description="base URL of the pod's OpenAI server, e.g. http://10.0.0.5:8000")
    role: PodRole = Field("both", description="prefill, decode or both (aggregated)")
    model: str = Field("sim-model", description="served model name")
    lora_adapters: list[str] = Field(default_factory=list, description=(
        "LoRA adapters the pod serves (vLLM's --lora-modules names): a request whose model is one of them goes "
        "only to pods serving it, and its prefix is keyed apart from the base model's and other adapters'"))
    kv_events: list[EventEndpoint] = Field(default_factory=list,
                                           description="KV event publishers, one per DP rank")
    prefill_tokens_per_s: float | None = Field(None, gt=0, description="prior prefill rate for this pod "
                                               "(else the fleet default)")
    metrics_url: str | None = Field(None, description="base URL of the engine's own /metrics when it differs from "
                                    "url (a decode pod behind its sidecar); none = url")
    metrics_urls: list[str] = Field(default_factory=list, description=(
        "a data-parallel pod whose every rank has an API server of its own (vLLM's external-lb, behind a sidecar "
        "with --data-parallel-mode external-lb: the decoder's port + r): one /metrics base URL per rank, in rank "
        "order, each rank's load and KV capacity read from its own page; instead of metrics_url"))
    data_parallel_size: int | None = Field(None, ge=1, le=1024, description=(
        "engines behind url (vLLM's --data-parallel-size, or its local share on a multi-node deployment); "
        "none = one per kv_events entry"))
    data_parallel_start_rank: int = Field(0, ge=0, description=(
        "global rank of the first of them (vLLM's --data-parallel-start-rank on a later node): its engine label "
        "in /metrics and the rank in its event batches count from here"))
    dp_rank: int | None = Field(None, ge=0, description=(
        "set by the router on each rank it makes of a data-parallel pod (sent as X-data-parallel-rank); "
        "leave unset"))

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return _http_url(v, "pod url")

    @field_validator("metrics_urls")
    @classmethod
    def _metrics_urls(cls, v: list[str]) -> list[str]:
        return [_http_url(u, f"metrics_urls entry {r}") for r, u in enumerate(v)]

    @model_validator(mode="after")
    def _ranks(self) -> PodConfig:
        if self.data_parallel_size and self.kv_events and len(self.kv_events) != self.data_parallel_size:
            raise ValueError(f"pod {self.id}: {len(self.kv_events)} kv_events entries for data_parallel_size "
                             f"{self.data_parallel_size} (one per engine, in rank order)")
        if self.metrics_urls:
            n = self.data_parallel_size or len(self.kv_events)
            if self.metrics_url is not None:
                raise ValueError(f"pod {self.id}: metrics_url and metrics_urls exclude each other (metrics_urls: "
                                 "one page per data-parallel rank; metrics_url: one page for every engine)")
            if n < 2:
                raise ValueError(f"pod {self.id}: metrics_urls is for a data-parallel pod (one entry per engine): "
                                 "set data_parallel_size, or give one engine's page as metrics_url")
            if len(self.metrics_urls) != n:
                raise ValueError(f"pod {self.id}: {len(self.metrics_urls)} metrics_urls entries for {n} "
                                 "data-parallel engines (one per engine, in rank order)")
            first: dict[str, int] = {}
            for r, u in enumerate(self.metrics_urls):
                if u in first:
                    raise ValueError(f"pod {self.id}: metrics_urls entries {first[u]} and {r} are the same page "
                                     "(each rank's API server has its own)")
                first[u] = r
        return self

    @field_validator("kv_events", mode="before")
    @classmethod
    def _endpoints(cls, v: Any) -> Any:
        """Accept plain endpoint strings as shorthand for ``{endpoint: ...}``."""
        if isinstance(v, (str, dict)):
            v = [v]
        return [{"endpoint": e} if isinstance(e, str) else e for e in (v or [])]


# an API key's cache_salt: long enough not to be guessed (the derivation is public: a guessed salt
# would let a key without one send the derived value itself), short enough to be a setting
MIN_CACHE_SALT, MAX_CACHE_SALT = 16, 1024


class ApiKey(BaseModel):
    """One accepted API key, optionally named (the name, never the key, appears in logs and metrics)
    and with its own rate limits (else the fleet-wide ``rate_limit_*`` settings apply)."""

    # `request_per_s:` or `admn:` would otherwise load as a key without its limit or grant
    model_config = {"extra": "forbid"}

    key: str = Field(min_length=1, description="the secret the client sends as Authorization: Bearer <key>")
    name: str | None = Field(None, description="a label for logs and metrics (default: key-<n>)")
    requests_per_s: float | None = Field(None, gt=0, description="requests per second for this key")
    request_burst: float | None = Field(None, gt=0, description="request bucket size for this key")
    prompt_tokens_per_s: float | None = Field(None, gt=0, description="prompt tokens per second for this key")
    prompt_token_burst: float | None = Field(None, gt=0, description="prompt-token bucket size for this key")
    admin: bool = Field(False, description="may use introspection: POST /debug/route, GET /internal/prefill-pods "
                        "(the sidecars' allowlist source), and GET /metrics unless public_metrics")
    allow_priority: bool = Field(False, description="the priority header (x-priority) is honoured for this key "
                                 "(an exempt value skips early rejection); ignored for other keys")
    allow_objective: bool = Field(False, description="the objective header (x-slo-ttft-ms) may loosen this key's "
                                  "objective; other keys may only tighten it")
    models: list[str] | None = Field(None, description="the models and LoRA adapters this key may use and sees in "
                                     "/v1/models (another is answered as one that does not exist); none = all")
    cache_salt: str | None = Field(None, repr=False, description="a secret (16 to 1024 characters, no spaces): "
                                   "this key's prompts share vLLM's prefix cache only with keys of the same "
                                   "cache_salt (the router forwards a cache_salt derived from it; "
                                   "docs/reliability.md); none = the client's own cache_salt, if any")

    @field_validator("key")
    @classmethod
    def _key(cls, v: str) -> str:
        # a client's bearer value is read without surrounding spaces: such a key could never match
        if not v.strip() or any(c.isspace() for c in v):
            raise ValueError("an API key must be non-empty and hold no spaces")
        return v

    @field_validator("cache_salt")
    @classmethod
    def _cache_salt(cls, v: str | None) -> str | None:
        # a secret: the message names the rule, never the value (pydantic's own would echo it)
        if v is not None and (not MIN_CACHE_SALT <= len(v) <= MAX_CACHE_SALT or any(c.isspace() for c in v)):
            raise ValueError(f"an API key's cache_salt must be {MIN_CACHE_SALT} to {MAX_CACHE_SALT} characters "
                             "without spaces (a secret: e.g. `openssl rand -hex 16`)")
        return v


class ScorerConfig(BaseModel):
    """One scorer of a custom policy (``router/scheduling/scorers.py``)."""

    model_config = {"extra": "forbid"}

    type: str
    weight: float = 1.0
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known(self) -> ScorerConfig:
        build_scoring([{"type": self.type, "weight": self.weight or 1.0, "params": self.params}])
        return self


def data_parallel_ranks(pod: PodConfig, steer: bool = True) -> list[PodConfig]:
    """The routable units of ``pod``: itself, or with ``steer`` and several data-parallel engines one
    pod per engine, ``<id>#<rank>``, each with its own event endpoint and ``dp_rank`` (the rank the
    pod's HTTP server is told in X-data-parallel-rank: its index among the engines behind ``url``).
    Each keeps the pod's ``metrics_urls``: the scraper reads rank r's load from entry r
    (``router.pods.PodRegistry.scrape``)."""
    n = pod.data_parallel_size or len(pod.kv_events)
    if not steer or n <= 1 or pod.dp_rank is not None:
        return [pod]
    return [pod.model_copy(update={"id": f"{pod.id}#{r}", "dp_rank": r,
                                   "kv_events": [pod.kv_events[r]] if pod.kv_events else []}) for r in range(n)]


class RouterSettings(BaseSettings):
    """Everything ``kvroute serve`` can be told: the fleet, the policy, the objective, the limits."""

    model_config = SettingsConfigDict(env_prefix="KVROUTE_", env_nested_delimiter="__", extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    pods: list[PodConfig] = Field(default_factory=list, description="the fleet: list of pods (see docs/router.md)")
    policy: PolicyName = Field("predicted-ttft", description="routing policy: a named preset of scorers "
                               "(see docs/router.md)")
    scorers: list[ScorerConfig] | None = Field(None, description="the policy as weighted scorers, "
                                               "[{type, weight, params}]; replaces `policy` when set")
    ttft_objective_ms: float | None = Field(None, gt=0,
                                            description="TTFT objective; requests whose best predicted TTFT "
                                            "misses it are rejected with 429 (none = no objective)")
    admission: bool = Field(True, description="reject early (429) when the best prediction misses the objective")
    admission_slack: float = Field(1.0, gt=0, description="reject when predicted TTFT > objective x this factor")
    admission_miss_probability: float | None = Field(0.1, gt=0, lt=1, description="reject when on every pod the "
                                                     "probability of missing objective x slack is above this (the "
                                                     "pods' learnt error model); none = compare the point estimate")
    ttft_error_prior_sd: float = Field(0.25, ge=0, description="spread of ln(observed/predicted TTFT) assumed for a "
                                       "pod before it has been observed")
    ttft_error_by_size: bool = Field(True, description="learn each pod's error model per size of prediction (one "
                                     "bucket per doubling, shrunk towards the pod's pooled one) rather than pooled")
    ttft_interval_level: float = Field(0.9, gt=0, lt=1, description="level of the predicted TTFT interval that "
                                       "/debug/route shows and kvroute_ttft_interval_total checks")
    prediction_log_path: str | None = Field(None, description="write one JSON line per timed first token (what "
                                            "was predicted, the work and batch behind it, what was observed) to "
                                            "this file (router/predlog.py); workers append .<pid>; none = off")
    prediction_log_max_bytes: int = Field(64 * 1024 * 1024, gt=0, description="stop the prediction log after "
                                          "this many bytes")
    slo_header: str = Field("x-slo-ttft-ms", description="request header carrying a per-request TTFT objective (ms)")
    priority_header: str = Field("x-priority", description="request header marking critical traffic")
    priority_exempt_values: list[str] = Field(default_factory=lambda: ["critical", "high"],
                                              description="values of the priority header that skip admission")
    retry_after_s: int = Field(1, ge=0, description="Retry-After seconds on 429")
    api_keys: list[str | ApiKey] = Field(default_factory=list, description="accepted API keys (Authorization: Bearer): "
                                         "strings, or {key, name, requests_per_s, ...} objects; empty = open; "
                                         "re-read from the YAML on SIGHUP (docs/reliability.md)")
    rate_limit_requests_per_s: float | None = Field(None, gt=0, description="per API key: requests per second (token "
                                                    "bucket; none = unlimited); 429 + Retry-After beyond it")
    rate_limit_request_burst: float | None = Field(None, gt=0, description="per API key: request bucket size (none = "
                                                   "one second's worth)")
    rate_limit_prompt_tokens_per_s: float | None = Field(None, gt=0, description="per API key: prompt tokens per "
                                                         "second (token bucket; none = unlimited)")
    rate_limit_prompt_token_burst: float | None = Field(None, gt=0, description="per API key: prompt-token bucket size "
                                                        "(none = one second's worth)")
    slo_header_max_ms: float = Field(600_000.0, gt=0, description="largest objective the objective header may ask "
                                     "for (400 above it)")
    public_metrics: bool = Field(False, description="with api_keys: GET /metrics answers anyone (else admin keys "
                                 "only); without api_keys it is always open")
    estimate_chars_per_token: float | None = Field(None, gt=0, description="characters per token of the cheap "
                                                   "prompt estimate charged before tokenizing (none = 1 for the "
                                                   "byte tokenizer, 4 otherwise)")
    header_timeout_s: float = Field(10.0, gt=0, description="a connection must send a request's complete headers "
                                    "within this long (from connecting, or from its first byte); closed after")
    max_header_bytes: int = Field(64 * 1024, ge=1024, description="largest request line plus headers (431 above)")
    keep_alive_s: float = Field(30.0, gt=0, description="an idle keep-alive connection is closed after this long")
    shutdown_timeout_s: float | None = Field(None, ge=0, description="on SIGTERM the router stops accepting and lets "
                                             "requests in flight (streams) finish for at most this long, then cuts "
                                             "them and exits cleanly; none = until they end (a supervisor's SIGKILL "
                                             "cuts them without the clean exit)")
    ssl_certfile: str | None = Field(None, description="TLS certificate for the listener (enables HTTPS)")
    ssl_keyfile: str | None = Field(None, description="TLS private key for the listener")
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0, description="largest request body accepted")
    body_timeout_s: float | None = Field(30.0, gt=0, description="a request body must arrive within this many seconds "
                                         "(408 after; bounds slow clients); none = no limit")
    tokenizer: str = Field("byte", description="'byte', a path to a Hugging Face tokenizer.json (must match the pods), "
                           "or 'remote' (ask a healthy pod of the model: POST /tokenize, cached)")
    default_chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="the pods' vLLM --default-chat-template-kwargs (JSON): merged under each chat request's "
        "chat_template_kwargs as vLLM merges them, so the router renders the prompt the pods render; none = unset")
    exclude_tools_when_tool_choice_none: bool = Field(
        False, description="the pods' vLLM --exclude-tools-when-tool-choice-none: a chat request with tool_choice "
        "\"none\" is rendered without its tools, as those pods render it")
    chat_template: str | None = Field(
        None, description="the pods' vLLM --chat-template: a template file's path, or the template itself (a value "
        "holding {, } or a newline that names no file), read and compiled at start; it replaces the tokenizer's "
        "template as it does on those pods; none = unset")
    chat_template_content_format: Literal["auto", "string", "openai"] = Field(
        "auto", description="the pods' vLLM --chat-template-content-format: message content handed to the template "
        "as one string or as a list of parts; auto = detected from the template, as vLLM detects it")
    remote_tokenize_timeout_s: float = Field(0.5, gt=0, description="tokenizer remote: deadline of a pod's /tokenize; "
                                             "past it the request is routed on load alone")
    remote_tokenize_cache_size: int = Field(4096, ge=1, description="tokenizer remote: prompts remembered per pod "
                                            "(LRU)")
    tokenize_cache_tokens: int = Field(4_000_000, ge=0, description="Hugging Face tokenizer: tokens of text prefixes "
                                       "kept so a follow-up tokenizes only its new part (0: off; ~4 bytes each)")
    tokenize_cache_share: bool = Field(True, description="workers and replicas on the booking bus send each other "
                                       "the chunks they tokenize, so a follow-up that lands on another process "
                                       "does not tokenize the whole conversation again")
    tokenize_tiktoken: bool = Field(True, description="Hugging Face byte-level BPE tokenizer: tokenize with "
                                    "tiktoken's BPE on the same vocabulary where it gives the same ids (about a "
                                    "third of the cost; checked at start and on a sample of prompts, dropped on "
                                    "a difference: indexer/fast_bpe.py)")
    tokenize_threads: int = Field(2, ge=1, description="threads that tokenize large prompts off the event loop "
                                  "when the tokenize process cannot")
    tokenize_process: bool = Field(True, description="Hugging Face tokenizer: large prompts are tokenized in a "
                                   "child process, whose Python work then never holds the router's GIL "
                                   "(router/tokenize_proc.py); off: in the tokenize threads")
    tokenize_process_timeout_s: float = Field(10.0, gt=0, description="a prompt the tokenize process has not "
                                              "answered by then goes to the threads, and the process is restarted")
    tokenize_offload_bytes: int = Field(16384, ge=0, description="request bodies at least this large are tokenized "
                                        "in the tokenize process (else the threads), so they do not delay small "
                                        "requests; but see tokenize_inline_chars")
    tokenize_crowded_bytes: int = Field(2048, ge=0, description="on a crowded event loop, request bodies at least "
                                        "this large are tokenized in the tokenize process too, whose core would "
                                        "idle otherwise (router/prompts.py LoopLoad)")
    tokenize_crowded_share: float = Field(0.5, ge=0, le=1, description="the event loop is crowded when another "
                                          "request is being handled, its thread was busy for this share of the "
                                          "last 100 ms, and there is a core for each worker's tokenize process")
    tokenize_inline_chars: int = Field(4096, ge=0, description="a large body is tokenized on the event loop "
                                       "when the loop is not crowded and at most this many characters "
                                       "of its prompt are past what the prefix token cache holds (a follow-up "
                                       "turn): it then pays no round trip to the tokenize process (0: never)")
    gil_switch_interval_ms: float = Field(0.5, gt=0, description="how long a Python thread (a tokenize thread "
                                          "hashing a big prompt) may hold the GIL before the event loop gets it "
                                          "(sys.setswitchinterval; Python's default is 5 ms)")
    block_size: int | None = Field(None, ge=1, description="KV block size in tokens (none = read from the pods' "
                                   "vllm:cache_config_info, else 16)")
    prefill_tokens_per_s: float = Field(20000.0, gt=0, description="prior prefill rate per pod before calibration")
    overhead_ms: float = Field(5.0, ge=0, description="prior fixed per-request overhead before calibration")
    calibrate: bool = Field(True, description="learn each pod's prefill rate and overhead from observed TTFTs")
    calibration_halflife: float = Field(200.0, gt=0, description="calibration memory, in observations")
    calibration_fit: Literal["seconds", "relative"] = Field("seconds", description="what the calibration's least "
                                                            "squares minimise: the error in seconds, or relative to "
                                                            "the observed TTFT (robust to a slow tail; see "
                                                            "docs/router.md)")
    unknown_request_tokens: int = Field(512, ge=0, description="prefill tokens assumed per queued request the router "
                                        "did not send itself (seen only in vllm:num_requests_waiting)")
    affinity_bonus_ms: float = Field(0.0, description="predicted-ttft: credit for the pod holding the longest prefix")
    work_weight: float = Field(3.0, ge=0,
                               description="predicted-ttft: also count this x the request's own prefill time "
                               "(the work it adds to a pod), favouring pods that hold its prefix")
    scrape_interval_s: float = Field(0.25, gt=0, description="period of each pod's /metrics scrape")
    health_interval_s: float = Field(1.0, gt=0, description="period of each pod's /health check")
    health_timeout_s: float = Field(1.0, gt=0, description="timeout of a health check or scrape")
    unhealthy_after: int = Field(2, ge=1, description="consecutive failed checks before a pod leaves the candidate set")
    forget_after_s: float = Field(30.0, ge=0,
                                  description="an unhealthy pod's index entries are dropped after this long")
    connect_timeout_s: float = Field(3.0, gt=0, description="upstream connect timeout")
    read_timeout_s: float | None = Field(None, gt=0,
                                         description="upstream read timeout between chunks (none = no limit)")
    max_connections: int = Field(0, ge=0, description="upstream connection limit (0 = unlimited)")
    max_connections_per_pod: int = Field(0, ge=0, description="upstream connection limit per pod (0 = unlimited)")
    retries: int = Field(1, ge=0,
                         description="retries on the next-best pod after a connection failure or 5xx before the "
                         "first byte")
    index_max_blocks_per_pod: int = Field(1_000_000, ge=1, description="bound on indexed blocks per pod")
    tier_weights: dict[str, float] = Field(default_factory=lambda: {"GPU": 1.0, "CPU": 0.8},
                                           description="how much a cached block in each tier is worth (1 = free)")
    speculative_ttl_s: float = Field(5.0, ge=0, description="how long a routed prompt counts as cached before events "
                                     "confirm it")
    kv_event_max_frame_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="largest KV-event frame accepted "
                                          "(ZeroMQ MAXMSGSIZE: a bigger one drops that connection)")
    kv_event_max_replay_batches: int = Field(20_000, ge=1, description="a replay answer without its end marker "
                                             "after this many batches counts as failed")
    kv_event_max_replay_bytes: int = Field(256 * 1024 * 1024, ge=1024, description="... or after this many bytes")
    kv_event_curve_server_key: str | None = Field(None, description="CURVE: the event publishers' public key (Z85); "
                                                  "set with the two below to authenticate and encrypt KV events")
    kv_event_curve_public_key: str | None = Field(None, description="CURVE: the router's public key (Z85)")
    kv_event_curve_secret_key: str | None = Field(None, description="CURVE: the router's secret key (Z85)")
    event_silence_s: float = Field(30.0, ge=0, description="drop a pod's index entries when its KV events stop this "
                                   "long while it keeps serving requests (0 = never)")
    kv_events_check_interval_s: float = Field(60.0, ge=0, description="compare each pod's KV-event publishers (vLLM's "
                                              "GET /kv_event_sources) with its kv_events this often, and say when "
                                              "they disagree (kvroute_pod_kv_events_mismatch; 0 = never)")
    adapters_check_interval_s: float = Field(15.0, ge=0, description="read each pod's LoRA adapters from its "
                                             "GET /v1/models this often: an adapter vLLM loads at run time is "
                                             "routed to once listed, one it unloads no longer (0 = the pods' "
                                             "lora_adapters only)")
    discovery: DiscoveryMode = Field("static", description="where the fleet comes from: 'static' (the pods list), "
                                     "'dns' (a headless Service re-resolved) or 'kubernetes' (list and watch pods)")
    discovery_label_selector: str = Field("kvroute.io/pool=default", description="kubernetes: label selector of the "
                                          "model pods (role, model and ports from their labels and annotations)")
    discovery_namespace: str | None = Field(None, description="kubernetes: namespace to watch (none = the router's "
                                            "own, from the service account)")
    discovery_api_server: str | None = Field(None, description="kubernetes: API server base URL (none = "
                                             "https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT)")
    discovery_token_file: str = Field("/var/run/secrets/kubernetes.io/serviceaccount/token",
                                      description="kubernetes: bearer token file (re-read on every request)")
    discovery_ca_file: str = Field("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
                                   description="kubernetes: CA bundle that signs the API server's certificate")
    discovery_relist_s: float = Field(60.0, gt=0,
                                      description="kubernetes: full re-list period, so a missed DELETE cannot "
                                      "leave a dead pod routable")
    discovery_watch_timeout_s: int = Field(290, ge=1,
                                           description="kubernetes: server-side timeout of one watch request")
    discovery_dns_name: str = Field("", description="dns: name whose A/AAAA records are the pods (a headless Service)")
    discovery_dns_server: str | None = Field(None, description="dns: 'host:port' of a DNS server to ask over UDP "
                                             "(none = the system resolver)")
    discovery_interval_s: float = Field(5.0, gt=0, description="dns: re-resolve period")
    discovery_role: PodRole = Field("both", description="dns: role of every resolved pod")
    discovery_model: str = Field("sim-model", description="dns: model every resolved pod serves")
    discovery_http_port: int = Field(8000, ge=1, le=65535, description="dns: pods' HTTP port")
    discovery_engine_port: int | None = Field(None, description="dns: pods' engine port for /metrics "
                                              "(none = http port)")
    discovery_kv_events_port: int | None = Field(5557, description="dns: KV-event PUB port of rank 0 (rank r: + r; "
                                                 "none = no events)")
    discovery_kv_events_replay_port: int | None = Field(5558, description="dns: KV-event replay port of rank 0 "
                                                        "(rank r: + r; none = no replay)")
    discovery_data_parallel_size: int = Field(1, ge=1, description="dns: event streams (DP ranks) per pod")
    discovery_data_parallel_mode: Literal["internal-lb", "external-lb"] = Field(
        "internal-lb", description="dns: how a pod's ranks are served (the sidecar's --data-parallel-mode): "
        "'internal-lb', one vLLM API server for all, its /metrics labelled per engine; 'external-lb', one per "
        "rank on the engine port + r, each rank's load read from its own /metrics")
    data_parallel_steering: bool = Field(True, description=(
        "a pod with several data-parallel engines is routed as one candidate per engine: each with its own "
        "prefix index, load, bookings and calibration, and the request carries vLLM's X-data-parallel-rank "
        "(aggregated routes; P/D legs are left to vLLM's balancer); off: one candidate per pod, vLLM balances"))
    pd_decider: str = Field(
        "predicted", description="P/D: when to prefill on a prefill pod: 'predicted' (when its predicted TTFT, "
        "KV transfer included, beats prefilling on the decode pod), 'prefix' (llm-d's rule), 'always', 'never', "
        "or a decider registered in router/scheduling/pd.py")
    pd_non_cached_tokens: int = Field(512, ge=0, description="P/D prefix decider: remote prefill when the decode pod "
                                      "lacks at least this many of the prompt's tokens (0 = never, as llm-d)")
    pd_prompt_tokens: int = Field(1024, ge=0,
                                  description="P/D prefix decider: and the prompt has at least this many tokens")
    pd_expected_output_tokens: int = Field(256, ge=0,
                                           description="P/D: output tokens assumed for KV room when a request "
                                           "sets no max_tokens")
    pd_decode_step_ms: float = Field(4.0, ge=0, description="P/D: decode step time of an idle decode pod (TPOT model)")
    pd_tpot_tolerance: float = Field(0.1, ge=0,
                                     description="P/D: decode pods within this fraction of the best predicted "
                                     "TPOT are ranked by predicted TTFT")
    pd_remote_margin_ms: float = Field(0.0, ge=0,
                                       description="P/D predicted decider: remote prefill must win by this much")
    kv_bytes_per_token: float = Field(131072.0, gt=0,
                                      description="P/D: KV bytes per token moved from prefill to decode "
                                      "(131072 = Llama-3-8B bf16)")
    kv_link_bandwidth_bytes_per_s: float = Field(25e9, gt=0, description="P/D: prefill-to-decode KV link bandwidth")
    kv_link_latency_ms: float = Field(1.0, ge=0, description="P/D: fixed latency of one KV transfer")
    strip_client_kv_transfer_params: bool = Field(True, description="drop a client's kv_transfer_params from the "
                                                  "body (its remote_host would steer a NIXL read)")
    seed: int = Field(0, description="seed of the random policy")
    workers: int = Field(1, ge=1, description="router processes sharing the port; each keeps its own index and event "
                         "subscriber, and they share bookings over the booking bus (see docs/router.md)")
    booking_bus: bool = Field(True, description="share bookings between router processes over ZeroMQ: the workers "
                              "of one kvroute serve (on 127.0.0.1), and replicas with booking_bus_bind/_peers")
    booking_bus_bind: str | None = Field(None, description="replicas: where this router publishes its bookings, "
                                         "e.g. tcp://*:5570 (none = not to other replicas)")
    booking_bus_peers: list[str] = Field(default_factory=list, description="replicas: the other routers' "
                                         "booking_bus_bind endpoints, e.g. [tcp://10.0.0.7:5570]")
    booking_bus_peers_dns: str = Field("", description="replicas: a name whose A/AAAA records are the routers (a "
                                       "headless Service), re-resolved; each is reached at booking_bus_port")
    booking_bus_port: int = Field(5570, description="replicas: booking-bus port of the routers booking_bus_peers_dns "
                                  "resolves to")
    booking_bus_peers_interval_s: float = Field(5.0, gt=0, description="replicas: re-resolve period of "
                                                "booking_bus_peers_dns")
    booking_bus_snapshot_s: float = Field(0.5, gt=0, description="period of each router's full snapshot of its open "
                                          "bookings (repairs lost messages; also its heartbeat)")
    booking_bus_peer_timeout_s: float = Field(3.0, gt=0, description="a router silent this long has its bookings "
                                              "dropped")
    booking_bus_min_interval_s: float = Field(0.005, ge=0, le=1.0, description="least time between two messages "
                                              "of a router's books and releases: changes wait at most this long "
                                              "and go together (0: one message per event-loop turn)")
    booking_bus_credits: bool = Field(True, description="the router processes on the booking bus send each other "
                                      "the block keys they credit to a pod when they route a prompt, so a "
                                      "follow-up or sibling routed by another process finds that pod")
    booking_bus_curve_secret_key: str | None = Field(None, description="CURVE on the booking bus: one secret key "
                                                     "(Z85, 40 characters) shared by every router process; only "
                                                     "holders can publish or read bookings (docs/router.md)")
    booking_bus_hwm: int = Field(10_000, ge=1, description="ZeroMQ high-water mark of the bus sockets (messages)")
    booking_bus_max_bookings: int = Field(50_000, ge=1, description="largest number of bookings held for one other "
                                          "router (beyond: dropped and counted)")
    log_level: str = Field("warning", description="log level: debug, info, warning or error (upper case "
                           "accepted)")
    log_format: LogFormat = Field("text", description="log lines: 'text' (time level logger: message) or 'json' "
                                  "(one object per line: ts, level, logger, pid, msg, exc; docs/router.md)")
    access_log: bool = Field(False, description="log every request (costs throughput); behind a proxy in "
                             "FORWARDED_ALLOW_IPS (127.0.0.1 by default) the address logged is "
                             "X-Forwarded-For's")

    @model_validator(mode="after")
    def _dns_ports(self) -> RouterSettings:
        # rank r of a dns-discovered pod is on each port + r (the engine port's only with external-lb)
        last = self.discovery_data_parallel_size - 1
        ports = {"discovery_http_port": 0, "discovery_engine_port": last if self.discovery_data_parallel_mode
                 == "external-lb" else 0, "discovery_kv_events_port": last, "discovery_kv_events_replay_port": last}
        for name, extra in ports.items():
            port = getattr(self, name)
            if port is not None and not 1 <= port <= 65535 - extra:
                raise ValueError(f"{name} must be 1 to {65535 - extra}" + (
                    f" (its {extra + 1} data-parallel ranks take it + 0..{extra})" if extra else ""))
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> RouterSettings:
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("ssl_certfile and ssl_keyfile go together")
        return self

    @model_validator(mode="after")
    def _curve_keys(self) -> RouterSettings:
        keys = (self.kv_event_curve_server_key, self.kv_event_curve_public_key, self.kv_event_curve_secret_key)
        if any(keys) and not all(k and len(k) == 40 for k in keys):
            raise ValueError("kv_event_curve_server_key, _public_key and _secret_key go together, "
                             "40 Z85 characters each")
        return self

    @model_validator(mode="after")
    def _bus_key(self) -> RouterSettings:
        if self.booking_bus_curve_secret_key is not None:
            from router.bookbus import BusKey

            BusKey.from_secret(self.booking_bus_curve_secret_key)  # a ValueError names the problem, not the key
        return self

    @model_validator(mode="after")
    def _bus_peers(self) -> RouterSettings:
        for ep in [*self.booking_bus_peers, *([self.booking_bus_bind] if self.booking_bus_bind else [])]:
            if not ep.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"booking bus endpoint {ep!r} must start with tcp://, ipc:// or inproc://")
        return self

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level(cls, value: Any) -> str:
        return check_level(value)  # "verbose" or 7: a clear error, not a traceback from logging at start

    @field_validator("slo_header", "priority_header")
    @classmethod
    def _header_name(cls, value: str) -> str:
        return value.lower()  # header names are case-insensitive; requests' arrive lower-cased

    @field_validator("chat_template")
    @classmethod
    def _chat_template_loads(cls, value: str | None) -> str | None:
        if value is not None:
            from indexer.tokens import ChatTemplateError, load_chat_template

            try:
                load_chat_template(value)
            except ChatTemplateError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("pd_decider")
    @classmethod
    def _known_decider(cls, value: str) -> str:
        if value not in DECIDER_FUNCTIONS:
            raise ValueError(f"unknown P/D decider {value!r}; known: {', '.join(DECIDER_FUNCTIONS)}")
        return value

    @model_validator(mode="after")
    def _api_keys_usable(self) -> RouterSettings:
        """Every key can log in and means one thing; errors name an entry's place, never its key."""
        seen: dict[str, int] = {}
        for i, entry in enumerate(self.api_keys, 1):
            key = entry.key if isinstance(entry, ApiKey) else entry
            if not key.strip() or any(c.isspace() for c in key):
                raise ValueError(f"api_keys entry {i}: an API key must be non-empty and hold no spaces")
            if key in seen:
                raise ValueError(f"api_keys entries {seen[key]} and {i} are the same key (which limits and "
                                 "grants would it get?)")
            seen[key] = i
        return self

    @model_validator(mode="after")
    def _unique_ids(self) -> RouterSettings:
        ids = [p.id for p in self.pods]
        if len(ids) != len(set(ids)):
            raise ValueError("pod ids must be unique")
        return self
