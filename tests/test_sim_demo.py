"""The prefix-cache part of ``kvroute demo``: simulated pods, a cold prompt and a follow-up sharing its prefix."""

from __future__ import annotations

import json

from fleet.demo import main, prefix_cache_demo
from simulator.testing import running_sims


def test_demo_shows_a_prefix_hit_on_the_same_pod_only():
    lines: list[str] = []
    with running_sims(2, ["--enable-prompt-tokens-details"]) as urls:   # as the demo starts them
        cold, warm, other = prefix_cache_demo(urls, document_sections=10, out=lines.append)
    assert cold.cached_tokens == 0 and other.cached_tokens == 0
    assert warm.cached_tokens >= warm.prompt_tokens - 2 * 16 and warm.pod == cold.pod != other.pod
    assert warm.ttft_s < cold.ttft_s  # the simulated gap is ~100 ms against ~5 ms
    assert lines[-1].startswith("prefix-cache hit:")



def test_demo_writes_its_table_as_json(tmp_path, capsys):
    """The policy comparison, cut short: the JSON summary has the printed table's rows, and the options."""
    args = ["--pods", "2", "--rate", "10", "--seconds", "2", "--sessions", "4", "--turn-tokens", "100", "--drain", "10",
            "--policies", "predicted-ttft", "--out", str(tmp_path / "demo"), "--json", str(tmp_path / "table.json")]
    assert main(args) == 0
    printed = capsys.readouterr().out
    got = json.loads((tmp_path / "table.json").read_text())
    assert got["options"]["rate"] == 10 and got["options"]["pods"] == 2 and got["objective_s"] == 2.0
    assert [r["router"] for r in got["rows"]] == ["predicted TTFT", "predicted TTFT + early rejection"]
    for r in got["rows"]:
        assert r["requests"] == 20 and 0 <= r["slo_attainment"] <= 1 and not r.get("error")
        assert f"| {r['router']} | {r['hit_rate'] * 100:.1f} % |" in printed  # the row as printed
    assert (tmp_path / "demo" / "demo-ttft-cdf.png").is_file()
    assert f"summary: {tmp_path / 'table.json'}" in printed
