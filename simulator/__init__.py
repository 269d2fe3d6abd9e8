"""A vLLM-compatible simulated pod: same HTTP surface, KV events, NIXL parameters and metric names, no GPU."""
