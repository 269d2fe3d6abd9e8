"""``kvroute replay`` end to end: table, JSON, plots, compare, settings layering and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from replay import cli
from replay.settings import ReplaySettings
from tests.helpers import ROOT, free_port, kvroute_process, stop_process, wait_http

TRACE = ROOT / "data" / "conversation_trace.jsonl"


@pytest.fixture(scope="module")
def backend_url():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "replay.fake_backend", "--port", str(port), "--ttft", "0.01"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/v1/models", proc=proc)
        yield url
    finally:
        stop_process(proc)


def test_mooncake_replay_writes_table_json_and_plots(backend_url, tmp_path, capsys):
    rc = cli.main(["--target", backend_url, f"mooncake:{TRACE}", "--max-requests", "12", "--time-scale", "0.01",
                   "--max-output-len", "4", "--max-input-len", "8192", "--slo-ttft", "2", "--label", "run-a",
                   "--pod-metrics", backend_url, "--result-dir", str(tmp_path), "--result-file", "a.json",
                   "--save-detailed", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Serving Benchmark Result" in out and "Mean TTFT (ms):" in out and "P99 ITL (ms):" in out
    assert "SLO attainment (all requests):" in out and "Definitions:" in out
    data = json.loads((tmp_path / "a.json").read_text())
    s = data["summary"]
    assert s["requests"] == 12 and s["completed"] == 12 and s["slo_attainment"] == 1.0
    assert 0 < s["hit_rate"] < 1  # every request shares block 0 of the trace
    assert data["config"]["label"] == "run-a" and data["config"]["arrival"] == "trace"
    assert len(data["records"]) == 12 and all(r["input_tokens"] <= 8192 for r in data["records"])
    for suffix in ("ttft-cdf", "ttft-time", "pods"):
        png = tmp_path / f"a-{suffix}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    rc = cli.main(["--target", backend_url, "multiturn", "--sessions", "4", "--turns", "2", "--system-prompts", "2",
                   "--system-prompt-len", "64", "--turn-tokens", "16", "--output-len", "3", "--rate", "200",
                   "--label", "run-b", "--result-dir", str(tmp_path), "--result-file", "b.json", "--no-plots",
                   "--no-progress"])
    assert rc == 0
    capsys.readouterr()
    assert cli.main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    cmp_out = capsys.readouterr().out
    assert "run-a" in cmp_out and "run-b" in cmp_out and "P99 TTFT (ms)" in cmp_out
    sent_row = next(line for line in cmp_out.splitlines() if line.startswith("Requests sent"))
    assert sent_row.split()[-2:] == ["12", "8"]


def test_comma_separated_targets_share_the_requests(backend_url, tmp_path, capsys):
    """Router replicas without a load balancer: ``--target a,b`` sends request i to the (i mod 2)-th."""
    port = free_port()
    second = subprocess.Popen([sys.executable, "-m", "replay.fake_backend", "--port", str(port), "--ttft", "0.01"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        other = f"http://127.0.0.1:{port}"
        wait_http(other + "/v1/models", proc=second)
        rc = cli.main(["--target", f"{backend_url}, {other}", "multiturn", "--sessions", "3", "--turns", "2",
                       "--system-prompts", "1", "--system-prompt-len", "32", "--turn-tokens", "8", "--output-len", "2",
                       "--rate", "200", "--result-dir", str(tmp_path), "--result-file", "r.json", "--no-plots",
                       "--no-progress", "--save-detailed"])
        assert rc == 0
        capsys.readouterr()
        data = json.loads((tmp_path / "r.json").read_text())
        assert data["summary"]["completed"] == 6
        assert data["config"]["target"] == [backend_url, other]
        # the second backend is fresh: it counted exactly the prompt tokens of requests 1, 3 and 5
        page = httpx.get(other + "/metrics", timeout=10).text
        queried = next(float(line.split()[-1]) for line in page.splitlines()
                       if line.startswith("vllm:prefix_cache_queries_total"))
        assert queried == sum(r["input_tokens"] for r in data["records"][1::2]) > 0
    finally:
        stop_process(second)


def test_bad_trace_line_is_a_clear_error_not_a_traceback(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
                     '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}\n')
    proc = subprocess.run([sys.executable, "-m", "router.cli", "replay", "--target", "http://127.0.0.1:9",
                           f"mooncake:{trace}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"{trace}:2:" in proc.stderr and "hash_ids" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unreachable_target_and_bad_compare_input(tmp_path, capsys):
    rc = cli.main(["--target", f"http://127.0.0.1:{free_port()}", "shared-prefix", "--rate", "10",
                   "--max-requests", "1", "--result-dir", str(tmp_path)])
    assert rc == 2 and "cannot list models" in capsys.readouterr().err
    bad = tmp_path / "x.json"
    bad.write_text("[]")
    assert cli.main(["compare", str(bad)]) == 2
    assert "not a replay result" in capsys.readouterr().err
    assert cli.main(["--target", "http://x", "zipf"]) == 2
    assert "unknown workload" in capsys.readouterr().err


def test_settings_layering(tmp_path, monkeypatch):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("rate: 3.5\nslo_ttft: 0.2\nlabel: from-file\n")
    monkeypatch.setenv("KVROUTE_REPLAY_SLO_TTFT", "0.4")
    parser = cli.build_parser()
    args = parser.parse_args(["--config", str(cfg), "--label", "from-flag", "azure:x.csv",
                              "--pod-metrics", "http://a:1", "http://b:2"])
    args.workload = args.workload_arg
    args.pod_metrics = cli._normalise_pod_metrics(args.pod_metrics)
    from kvcommon.settings import settings_from_args

    s = settings_from_args(ReplaySettings, args)
    assert (s.rate, s.slo_ttft, s.label, s.workload) == (3.5, 0.4, "from-flag", "azure:x.csv")
    assert s.pod_metrics == ["http://a:1", "http://b:2"]


def test_workload_after_pod_metrics_is_not_taken_for_a_url(backend_url, tmp_path, capsys):
    rc = cli.main(["--target", backend_url, "--max-requests", "2", "--rate", "50", "--no-plots", "--no-progress",
                   "--result-dir", str(tmp_path), "--result-file", "p.json", "--sessions", "2", "--turns", "1",
                   "--system-prompt-len", "32", "--turn-tokens", "8", "--output-len", "2",
                   "--pod-metrics", backend_url, "multiturn"])
    assert rc == 0
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["config"]["workload"] == "multiturn" and data["config"]["pod_metrics"] == [backend_url]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["--pod-metrics", "not-a-url", "multiturn"])
    assert "--pod-metrics takes http(s) URLs" in capsys.readouterr().err


def test_help_lists_every_setting():
    proc = subprocess.run([sys.executable, "-m", "router.cli", "replay", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0
    for name in ReplaySettings.model_fields:
        assert "--" + name.replace("_", "-") in proc.stdout
    assert "KVROUTE_REPLAY_" in proc.stdout


def test_mooncake_against_a_simulated_pod(tmp_path):
    """20 requests of the Mooncake trace against `kvroute sim`; the hit rate comes from its metrics."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with kvroute_process(["sim", "--enable-prompt-tokens-details", "--port", str(port)], ready_url=url + "/health",
                         timeout=30):
        out = tmp_path / "sim.json"
        proc = subprocess.run([sys.executable, "-m", "router.cli", "replay", "--target", url, f"mooncake:{TRACE}",
                               "--max-requests", "20", "--time-scale", "0.02", "--max-input-len", "4096",
                               "--max-output-len", "4", "--pod-metrics", url, "--result-file", str(out),
                               "--no-plots", "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        s = json.loads(out.read_text())["summary"]
        assert s["requests"] == 20 and s["completed"] == 20 and 20 <= s["total_output_tokens"] <= 80
        # every request starts with trace block 0, so later requests hit the pod's prefix cache
        assert s["hit_rate"] is not None and s["hit_rate"] > 0
        assert s["usage_hit_rate"] is not None and s["usage_hit_rate"] > 0


@pytest.mark.parametrize("flags, message", [
    (["--block-size", "0"], "block_size"),
    (["--output-len", "100000000000000000000"], "output_len"),
    (["--sessions", "1000000000000"], "sessions"),
    (["--request-timeout", "0"], "request_timeout"),
    (["--drain-timeout", "-1"], "drain_timeout"),
    (["--max-input-len", "-5"], "max_input_len"),
    (["--max-output-len", "-5"], "max_output_len"),
    (["--max-concurrency", "-1"], "max_concurrency"),
    (["--time-scale", "inf"], "time_scale"),
    (["--seed", "-1"], "seed"),
])
def test_out_of_range_settings_are_clear_errors(flags, message, capsys):
    """Before: a stack trace (ZeroDivisionError, TypeError, MemoryError), a silent empty prompt, or no timeout."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["--target", "http://127.0.0.1:9", "multiturn", *flags])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"error: {message}:" in err and "Traceback" not in err
