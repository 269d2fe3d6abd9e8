"""The prefix-cache part of ``kvroute demo``: simulated pods, a cold prompt and a follow-up sharing its prefix."""

from __future__ import annotations

from fleet.demo import prefix_cache_demo
from simulator.testing import running_sims


def test_demo_shows_a_prefix_hit_on_the_same_pod_only():
    lines: list[str] = []
    with running_sims(2, ["--enable-prompt-tokens-details"]) as urls:   # as the demo starts them
        cold, warm, other = prefix_cache_demo(urls, document_sections=10, out=lines.append)
    assert cold.cached_tokens == 0 and other.cached_tokens == 0
    assert warm.cached_tokens >= warm.prompt_tokens - 2 * 16 and warm.pod == cold.pod != other.pod
    assert warm.ttft_s < cold.ttft_s  # the simulated gap is ~100 ms against ~5 ms
    assert lines[-1].startswith("prefix-cache hit:")

