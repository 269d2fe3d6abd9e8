"""The replay client against a real engine: a short Mooncake slice, its report's hit rate equal to
the engine's own prefix-cache counters."""

from __future__ import annotations

import json
import subprocess
import sys

from realvllm.engines import MODEL_NAME
from tests.helpers import ROOT
from tests.real_vllm.conftest import engine_metric


def test_mooncake_slice_report_matches_the_engines_counters(agg_engines, tmp_path):
    engine = agg_engines[0]
    before = {n: engine_metric(engine.url, n)
              for n in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")}
    out = tmp_path / "mooncake-real.json"
    cmd = [sys.executable, "-m", "router.cli", "replay", f"mooncake:{ROOT / 'data' / 'conversation_trace.jsonl'}",
           "--target", engine.url, "--model", MODEL_NAME, "--max-requests", "24", "--max-input-len", "3000",
           "--max-output-len", "4", "--arrival", "poisson", "--rate", "4", "--seed", "1", "--slo-ttft", "5",
           "--pod-metrics", engine.url, "--result-file", str(out), "--no-plots", "--no-progress"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    summary = json.loads(out.read_text())["summary"]
    hits = engine_metric(engine.url, "vllm:prefix_cache_hits_total") - before["vllm:prefix_cache_hits_total"]
    queries = engine_metric(engine.url, "vllm:prefix_cache_queries_total") - before["vllm:prefix_cache_queries_total"]
    print(run.stdout[-1500:])
    print(f"engine: {hits:.0f} hit of {queries:.0f} queried tokens; report: {summary['hit_rate']}")
    assert summary["requests"] == 24 and summary.get("errors", 0) == 0
    assert queries > 0 and hits > 0  # the Mooncake slice shares prefixes
    assert summary["prefix_cache_queries"] == queries and summary["prefix_cache_hits"] == hits
    assert abs(summary["hit_rate"] - hits / queries) < 1e-12
