"""The router's settings, its command line, and the pod-metrics parser."""

import re
import subprocess
import sys

import pytest

from kvcommon.settings import build_settings, load_settings
from router.config import PodConfig, RouterSettings, data_parallel_ranks
from router.dispatch import forwardable, upstream_headers
from router.pods import PodRegistry, parse_vllm_metrics
from tests.helpers import ROOT

VLLM_METRICS = """# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_gpu_blocks="2048",enable_prefix_caching="True"} 1.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0
"""  # noqa: E501 - vLLM's metric lines, verbatim


def test_parse_vllm_metrics_sums_engines_and_reads_the_deprecated_kv_name():
    m = parse_vllm_metrics(VLLM_METRICS)
    assert (m.waiting, m.running) == (5, 7)
    assert m.kv_usage == pytest.approx(0.375)
    assert (m.block_size, m.num_gpu_blocks) == (32, 2048)
    newer = parse_vllm_metrics('vllm:kv_cache_usage_perc{engine="0"} 0.9\nvllm:gpu_cache_usage_perc{engine="0"} 0.1\n')
    assert newer.kv_usage == pytest.approx(0.9)
    assert parse_vllm_metrics("garbage\nvllm:num_requests_waiting{x=\"1\"} notanumber\n").waiting == 0


def test_a_load_figure_that_is_not_a_finite_count_is_ignored_and_a_pods_figures_carry_their_age():
    """NaN, infinite or negative gauges carry no load (int(nan) raised in the scrape loop, every
    interval, and the pod kept its old figures); the age of what was last read is exported."""
    page = ("vllm:num_requests_waiting NaN\nvllm:num_requests_waiting 3\nvllm:num_requests_running +Inf\n"
            "vllm:kv_cache_usage_perc -1\nvllm:num_requests_waiting_by_reason{reason=\"deferred\"} nan\n")
    m = parse_vllm_metrics(page)
    assert (m.waiting, m.running, m.kv_usage, m.deferred) == (3, 0, None, None)
    now = [100.0]
    reg = PodRegistry([PodConfig(id="a", url="http://a")], clock=lambda: now[0])
    assert reg.scrape_age(reg.pods["a"]) is None           # never read: no age, no gauge
    reg.apply_metrics("a", m)
    now[0] = 142.5                                           # then its /metrics stopped answering
    assert (reg.pods["a"].waiting, reg.scrape_age(reg.pods["a"])) == (3, 42.5)


def test_one_engines_load_is_read_by_its_engine_label():
    assert (parse_vllm_metrics(VLLM_METRICS, "1").waiting, parse_vllm_metrics(VLLM_METRICS, "1").running) == (2, 0)
    m = parse_vllm_metrics(VLLM_METRICS, "0")
    assert (m.waiting, m.running, m.block_size) == (3, 7, 32)
    assert m.kv_usage == pytest.approx(0.5)
    assert parse_vllm_metrics(VLLM_METRICS, "7").waiting == 0


def test_a_data_parallel_pod_is_routed_as_one_pod_per_engine():
    events = [{"endpoint": f"tcp://10.0.0.5:{5557 + r}", "replay": f"tcp://10.0.0.5:{5565 + r}"} for r in range(4)]
    pod = PodConfig(id="p", url="http://10.0.0.5:8000", model="m", kv_events=events, lora_adapters=["a"])
    units = data_parallel_ranks(pod)
    assert [(u.id, u.dp_rank, u.url, u.model, u.lora_adapters) for u in units] == [
        (f"p#{r}", r, "http://10.0.0.5:8000", "m", ["a"]) for r in range(4)]
    assert [[e.endpoint for e in u.kv_events] for u in units] == [[f"tcp://10.0.0.5:{5557 + r}"] for r in range(4)]
    assert data_parallel_ranks(pod, steer=False) == [pod]
    assert data_parallel_ranks(PodConfig(id="q", url="http://h:1", kv_events=events[:1])) == \
        [PodConfig(id="q", url="http://h:1", kv_events=events[:1])]
    blind = data_parallel_ranks(PodConfig(id="b", url="http://h:1", data_parallel_size=2))  # no events: still ranks
    assert [(u.id, u.kv_events) for u in blind] == [("b#0", []), ("b#1", [])]
    with pytest.raises(ValueError, match="2 kv_events entries for data_parallel_size 4"):
        PodConfig(id="x", url="http://h:1", kv_events=events[:2], data_parallel_size=4)
    # the router's settings expand the static fleet (and discovery's pods, through FleetSync)
    settings = build_settings(RouterSettings, {"pods": [pod.model_dump()]})
    assert [u.id for p in settings.pods for u in data_parallel_ranks(p, settings.data_parallel_steering)] == \
        ["p#0", "p#1", "p#2", "p#3"]


def test_a_decode_request_waiting_for_its_kv_is_not_queued_prefill_work():
    # vLLM 0.32 counts a request waiting for its NIXL read in vllm:num_requests_waiting, and again under
    # vllm:num_requests_waiting_by_reason{reason="deferred"}: it needs no prefill capacity on the pod
    text = VLLM_METRICS + (
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 1.0\n'
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="deferred"} 2.0\n'
        'vllm:num_requests_waiting_by_reason{engine="1",model_name="m",reason="capacity"} 0.0\n'
        'vllm:num_requests_waiting_by_reason{engine="1",model_name="m",reason="deferred"} 2.0\n')
    m = parse_vllm_metrics(text)
    assert (m.waiting, m.deferred) == (5, 4)
    reg = PodRegistry(build_settings(RouterSettings, {"pods": [{"id": "a", "url": "http://127.0.0.1:1"}]}).pods)
    reg.apply_metrics("a", m)
    assert (reg.pods["a"].waiting, reg.pods["a"].waiting_deferred) == (1, 4)
    reg.apply_metrics("a", parse_vllm_metrics(VLLM_METRICS))   # an older vLLM without the reasons
    assert (reg.pods["a"].waiting, reg.pods["a"].waiting_deferred) == (5, 0)


def test_registry_marks_pods_unhealthy_after_n_failures_and_forgets_later():
    now = [0.0]
    forgotten = []
    s = build_settings(RouterSettings, {"pods": [{"id": "a", "url": "http://127.0.0.1:1"}]})
    reg = PodRegistry(s.pods, unhealthy_after=2, forget_after_s=10, on_forget=forgotten.append, clock=lambda: now[0])
    reg.mark("a", True)
    assert [p.id for p in reg.healthy()] == ["a"]
    reg.mark("a", False)
    assert reg.healthy()  # one failure is not enough
    reg.mark("a", False)
    assert not reg.healthy() and forgotten == []
    now[0] = 11.0
    reg.mark("a", False)
    assert forgotten == ["a"]
    reg.mark("a", True)
    assert reg.healthy() and not reg.pods["a"].forgotten


def test_pod_config_validation_and_shorthands():
    s = build_settings(RouterSettings, {"pods": [{"id": "a", "url": "http://h:1/", "kv_events": "tcp://h:5557"}]})
    assert s.pods[0].url == "http://h:1" and s.pods[0].kv_events[0].endpoint == "tcp://h:5557"
    assert s.pods[0].role == "both" and s.policy == "predicted-ttft"
    with pytest.raises(ValueError):
        build_settings(RouterSettings, {"pods": [{"id": "a", "url": "h:1"}]})
    with pytest.raises(ValueError):
        build_settings(RouterSettings, {"pods": [{"id": "a", "url": "http://h:1"}, {"id": "a", "url": "http://h:2"}]})
    with pytest.raises(ValueError):
        build_settings(RouterSettings, {"pods": [{"id": "a", "url": "http://h:1", "role": "boss"}]})
    with pytest.raises(ValueError):
        build_settings(RouterSettings, {"policy": "fastest"})


def test_scorer_lists_are_validated_when_the_settings_load():
    ok = build_settings(RouterSettings, {"scorers": [{"type": "predicted-ttft"},
                                                     {"type": "cache-affinity", "params": {"bonus_ms": 20}}]})
    assert [s.type for s in ok.scorers] == ["predicted-ttft", "cache-affinity"]
    with pytest.raises(ValueError, match="unknown scorer 'fastest'; known: cache, cache-affinity"):
        build_settings(RouterSettings, {"scorers": [{"type": "fastest"}]})
    with pytest.raises(ValueError, match="bad params"):
        build_settings(RouterSettings, {"scorers": [{"type": "cache-affinity", "params": {"bonus": 1}}]})
    with pytest.raises(ValueError):
        build_settings(RouterSettings, {"scorers": [{"type": "load", "wieght": 2}]})


def test_settings_layers_yaml_env_flags(tmp_path, monkeypatch):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("policy: cache-only\nport: 9100\npods:\n  - {id: a, url: 'http://127.0.0.1:9}'}\n")
    s = load_settings(RouterSettings, ["--config", str(cfg)], "t", "d")
    assert (s.policy, s.port, s.pods[0].id) == ("cache-only", 9100, "a")
    monkeypatch.setenv("KVROUTE_POLICY", "least-load")
    monkeypatch.setenv("KVROUTE_TTFT_OBJECTIVE_MS", "1500")
    s = load_settings(RouterSettings, ["--config", str(cfg)], "t", "d")
    assert s.policy == "least-load" and s.ttft_objective_ms == 1500
    s = load_settings(RouterSettings, ["--config", str(cfg), "--policy", "random", "--no-admission",
                                       "--api-keys", '["k"]'], "t", "d")
    assert (s.policy, s.admission, s.api_keys) == ("random", False, ["k"])


def test_serve_cli_documents_every_knob_and_refuses_an_empty_fleet():
    out = subprocess.run([sys.executable, "-m", "router.cli", "serve", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    for flag in RouterSettings.model_fields:
        assert "--" + flag.replace("_", "-") in out.stdout
    out = subprocess.run([sys.executable, "-m", "router.cli", "serve"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "no pods configured" in out.stderr
    out = subprocess.run([sys.executable, "-m", "router.cli", "serve", "--pods", '[{"id": "a", "url": "ftp://x"}]'],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "http://" in out.stderr and "Traceback" not in out.stderr


SECRET = "sk-live-TOPSECRET-9f8e7d"


def _serve_error(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "router.cli", "serve", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    return out.stderr


def test_a_bad_setting_stops_start_up_without_echoing_a_secret(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"api_keys:\n  - {{key: {SECRET}, name: a\n  - x\n")   # a flow mapping never closed
    err = _serve_error("--config", str(bad))
    assert "not valid YAML at line" in err and SECRET not in err
    err = _serve_error("--api-keys", f'["{SECRET}",]')
    assert "expected JSON" in err and SECRET not in err
    err = _serve_error("--pods", '[{"id": "a", "url": "ftp://svc:TOPSECRETPW@10.0.0.5"}]')
    assert "http://" in err and "TOPSECRETPW" not in err
    err = _serve_error("--pods", '[{"id": "a", "url": "http://x"}]', "--api-keys", f'["{SECRET}", "{SECRET}"]')
    assert "entries 1 and 2 are the same key" in err and SECRET not in err


@pytest.mark.parametrize("override", [
    {"prefill_tokens_per_s": 0}, {"max_body_bytes": -1}, {"retry_after_s": -1}, {"retries": -3},
    {"connect_timeout_s": -1}, {"scrape_interval_s": 0}, {"health_interval_s": 0}, {"workers": 0}, {"port": -1},
    {"ttft_objective_ms": -5}, {"admission_slack": -1}, {"max_connections": -1}, {"unhealthy_after": 0},
    {"pods": [{"id": "a", "url": "http://"}]}, {"pods": [{"id": "a", "url": "http://127.0.0.1:1 evil"}]},
    {"pods": [{"id": "a", "url": "http://x", "modle": "m"}]},                      # a misspelt field
    {"pods": [{"id": "a", "url": "http://x", "kv_events": [{"endpoint": "tcp://x:1", "topik": ""}]}]},
    {"api_keys": [{"key": "k", "request_per_s": 1, "admn": True}]},              # loaded with no limit before
    {"api_keys": [" sk-padded-555 "]}, {"api_keys": [""]}, {"api_keys": [{"key": "a b"}]},
], ids=lambda o: next(iter(o)) + ":" + str(next(iter(o.values())))[:40])
def test_settings_that_cannot_work_are_refused_when_they_load(override):
    # each of these loaded before: a ZeroDivisionError at start, every request a 413, a key never matching
    # or loaded without its limit, a Retry-After of -1
    base = {"pods": [{"id": "a", "url": "http://x"}]}
    with pytest.raises(ValueError):
        build_settings(RouterSettings, {**base, **override})


def test_header_filter_drops_hop_by_hop_and_internal_headers():
    dropped = ["connection", "transfer-encoding", "x-prefiller-host-port", "x-prefiller-url", "x-kvroute-pod",
               "x-kvroute-anything", "host", "content-length", "te", "upgrade", "x-llm-d-prefiller-host-port",
               "x-llm-d-encoder-hosts-ports", "x-kv-cache-source-host-port", "expect", "keep-alive",
               "x-data-parallel-rank"]
    kept = ["content-type", "accept", "x-slo-ttft-ms", "user-agent", "x-custom"]
    for name in dropped:
        assert not forwardable(name)
    for name in kept:
        assert forwardable(name)
    # upstream_headers applies the same filter (written out there, on the hot path), and says itself
    # what the body it forwards is: JSON, whatever the client declared (vLLM refuses any other type)
    sent = [(name.upper().encode(), b"v") for name in dropped + kept]
    assert upstream_headers(sent, "rid", drop_credentials=True) == {
        **dict.fromkeys(kept, "v"), "x-request-id": "rid", "content-type": "application/json"}
    raw = [(b"Authorization", b"Bearer k"), (b"X-Api-Key", b"k2"), (b"X-Request-Id", b"client"), (b"Accept", b"a"),
           (b"accept", b"b")]
    assert upstream_headers(raw, "rid", drop_credentials=True) == {
        "accept": "a, b", "x-request-id": "rid", "content-type": "application/json"}
    kept_open = upstream_headers(raw, "rid", drop_credentials=False)   # an open router: the pods' own business
    assert kept_open["authorization"] == "Bearer k" and kept_open["x-api-key"] == "k2"


def test_the_request_header_map_answers_as_starlette_headers_do_and_header_settings_are_lower_cased():
    from starlette.datastructures import Headers

    from router.api import header_map

    raw = [(b"authorization", b"Bearer first"), (b"x-priority", b"high"), (b"authorization", b"Bearer second"),
           (b"x-caf\xe9", b"caf\xe9"), (b"x-slo-ttft-ms", b"")]
    mapped, starlette = header_map(raw), Headers(raw=raw)
    for name in ("authorization", "x-priority", "x-caf\xe9", "x-slo-ttft-ms", "x-request-id", "accept"):
        assert mapped.get(name) == starlette.get(name), name
    assert mapped["authorization"] == "Bearer first"  # a repeated header: the first, never the last
    settings = build_settings(RouterSettings, {"pods": [{"id": "p", "url": "http://127.0.0.1:1"}],
                                               "slo_header": "X-SLO-TTFT-MS", "priority_header": "X-Priority"})
    assert (settings.slo_header, settings.priority_header) == ("x-slo-ttft-ms", "x-priority")


def test_the_prediction_log_writes_a_line_per_timed_request_and_stops_at_its_cap(tmp_path):
    import orjson

    from router.booking import Booking
    from router.predlog import PredictionLog

    path = tmp_path / "p.jsonl"
    plog = PredictionLog(str(path), max_bytes=700)
    b = Booking(pod_id="d0", prefill_pod="p0", prefill_ticket=1, work_tokens=1234.4, predicted_ttft_s=0.25,
                cached_tokens=512, mode="remote", new_blocks=3, running=2, model_ttft_s=0.2, ttft_low_s=0.1)
    for observed in (0.3, 0.31, 0.32, 0.33, 0.34):
        plog.write(b, observed)
    lines = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    assert 1 < len(lines) < 5 and plog.written <= 700      # the cap stopped it
    assert lines[0] == {"t": lines[0]["t"], "pod": "d0", "prefill_pod": "p0", "mode": "remote", "work_tokens": 1234,
                        "cached_tokens": 512, "new_blocks": 3, "running": 2, "predicted_s": 0.25, "model_s": 0.2,
                        "low_s": 0.1, "high_s": None, "observed_s": 0.3}
    plog.write(b, 1.0)                                     # closed: nothing more
    assert len(path.read_bytes().splitlines()) == len(lines)


@pytest.mark.unit
@pytest.mark.parametrize("settings,message", [
    ({"discovery_kv_events_port": 65535, "discovery_data_parallel_size": 2},
     "discovery_kv_events_port must be 1 to 65534 (its 2 data-parallel ranks take it + 0..1)"),
    ({"discovery_kv_events_replay_port": 0}, "discovery_kv_events_replay_port must be 1 to 65535"),
    ({"discovery_engine_port": 70000}, "discovery_engine_port must be 1 to 65535"),
    ({"discovery_engine_port": 65534, "discovery_data_parallel_size": 4, "discovery_data_parallel_mode": "external-lb"},
     "discovery_engine_port must be 1 to 65532 (its 4 data-parallel ranks take it + 0..3)"),
])
def test_dns_discovery_ports_leave_room_for_every_rank(settings, message):
    """A dns-discovered pod's rank r listens on each port + r: a port that leaves no room for the last
    rank (or none at all) is refused at load, not turned into a URL with port 65536 at discovery."""
    with pytest.raises(ValueError, match=re.escape(message)):
        build_settings(RouterSettings, settings)
    ok = {**settings, "discovery_kv_events_port": 5557, "discovery_kv_events_replay_port": 5558,
          "discovery_engine_port": 8001}
    assert build_settings(RouterSettings, ok).discovery_engine_port == 8001
