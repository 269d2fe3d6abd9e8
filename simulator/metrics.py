"""Prometheus metrics of one simulated pod, under vLLM's names and labels.

vLLM's V1 names (``vllm:*``, labels ``model_name`` and ``engine``) for what vLLM reports; the
simulator's own extras use the ``kvsim_`` prefix so nobody mistakes them for vLLM's. Each pod has
its own registry, so several pods can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
# vLLM's NIXL connector histograms (nixl/stats.py): bytes 2 KiB .. 8 GiB in powers of 4, transfer seconds
NIXL_BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
NIXL_XFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


class PodMetrics:
    def __init__(self, model: str, engine: str = "0", cache_info: dict[str, str] | None = None):
        r = self.registry = CollectorRegistry(auto_describe=False)
        lab = ("model_name", "engine")
        v = (model, engine)

        def gauge(name, doc):
            return Gauge(name, doc, lab, registry=r).labels(*v)

        def counter(name, doc):
            return Counter(name, doc, lab, registry=r).labels(*v)

        def hist(name, doc, buckets):
            return Histogram(name, doc, lab, buckets=buckets, registry=r).labels(*v)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        by_reason = Gauge("vllm:num_requests_waiting_by_reason",
                          "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
                          "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
                          "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
                          [*lab, "reason"], registry=r)
        self.waiting_capacity = by_reason.labels(*v, "capacity")
        self.waiting_deferred = by_reason.labels(*v, "deferred")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.")
        self.external_queries = counter("vllm:external_prefix_cache_queries",
                                        "External prefix cache queries from KV connector, in tokens.")
        self.external_hits = counter("vllm:external_prefix_cache_hits",
                                     "External prefix cache hits from KV connector, in tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        by_source = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                            lab + ("source",), registry=r)
        # where each prompt token's KV came from, counted once per request when it is first scheduled:
        # computed here, this pod's prefix cache, or a NIXL read (the whole rest of the prompt: vLLM
        # counts the last token, recomputed for its logits, as transferred)
        self.prompt_by_source = {src: by_source.labels(*v, src) for src in PROMPT_SOURCES}
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          lab + ("finished_reason",), registry=r)
        self.success = {reason: success.labels(*v, reason) for reason in ("stop", "length", "abort")}
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        LATENCY_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", LATENCY_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", LATENCY_BUCKETS)
        self.prompt_len = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                               TOKEN_BUCKETS)
        self.generation_len = hist("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                   TOKEN_BUCKETS)
        # NIXL, decode side (vLLM's names: one observation per read)
        self.nixl_bytes = hist("vllm:nixl_bytes_transferred",
                               "Histogram of bytes transferred per NIXL KV Cache transfers.", NIXL_BYTES_BUCKETS)
        self.nixl_xfer_time = hist("vllm:nixl_xfer_time_seconds",
                                   "Histogram of transfer duration for NIXL KV Cache transfers.", NIXL_XFER_BUCKETS)
        self.nixl_failed = counter("vllm:nixl_num_failed_transfers",
                                   "Number of failed NIXL KV Cache transfers, including handshake and "
                                   "notification failures.")
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     tuple(sorted({**(cache_info or {}), "engine": engine})), registry=r)
        info.labels(**{**(cache_info or {}), "engine": engine}).set(1)
        # simulator-only
        self.leased_blocks = Gauge("kvsim_nixl_leased_blocks",
                                   "KV blocks held for a remote decoder's NIXL read (prefill side).",
                                   registry=r)
        self.leases = Gauge("kvsim_nixl_leases", "NIXL leases waiting for the decoder's read.", registry=r)
        self.lease_timeouts = Counter("kvsim_nixl_lease_timeouts", "Leases ended by the timeout, not a read.",
                                      registry=r)
        self.nixl_reads = Counter("kvsim_nixl_reads", "NIXL reads served to decoders (prefill side).",
                                  registry=r)
        self.nixl_transfers = Counter("kvsim_nixl_transfers", "NIXL reads made by this pod (decode side), "
                                      "by outcome.", ("outcome",), registry=r)
        self.event_batches = Counter("kvsim_kv_event_batches", "KV-event batches published.", registry=r)
        self.events_dropped = Counter("kvsim_kv_event_batches_dropped",
                                      "KV-event batches not sent (socket at high-water mark or events stopped).",
                                      registry=r)
        self.faults = Counter("kvsim_faults_injected", "Faults injected, by kind.", ("kind",), registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def merge_expositions(texts: list[bytes]) -> bytes:
    """Several engines' Prometheus text pages as one, as vLLM's API server shows its data-parallel
    engines: each family's ``# HELP``/``# TYPE`` once, then every engine's samples (told apart by
    their ``engine`` label)."""
    families: dict[str, list[str]] = {}   # family name -> its HELP/TYPE lines, then samples
    order: list[str] = []
    for text in texts:
        current = ""
        for line in text.decode("utf-8").splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                current = line.split(" ", 3)[2]
                if current not in families:
                    families[current] = []
                    order.append(current)
                if line not in families[current]:
                    families[current].append(line)
            elif line:
                families.setdefault(current, []).append(line)
    return ("\n".join(line for name in order for line in families[name]) + "\n").encode("utf-8")
