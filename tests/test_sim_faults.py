"""Faults on demand: per-request header, run-time POST /sim/faults, and start-up flags."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from simulator.testing import consecutive_free_ports
from tests.helpers import kvroute_process


@pytest.fixture(scope="module")
def pod():
    port = consecutive_free_ports(1)
    with kvroute_process(["sim", "--port", str(port)], ready_url=f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(autouse=True)
def _clear(pod):
    yield
    httpx.post(pod + "/sim/faults", json={"status": None, "delay_s": 0, "drop_after_chunks": None,
                                          "slowdown": 1.0, "events_stop": False})


def test_error_status_from_header_and_at_run_time(pod):
    r = httpx.post(pod + "/v1/completions", headers={"x-sim-fault": "status=503", "x-request-id": "f1"},
                   json={"prompt": "x"})
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "ServiceUnavailableError" and r.json()["error"]["code"] == 503
    assert r.headers["x-request-id"] == "f1"
    assert httpx.post(pod + "/sim/faults", json={"status": 429}).json()["status"] == 429
    with pytest.raises(openai.RateLimitError):
        openai.OpenAI(base_url=pod + "/v1", api_key="x", max_retries=0).completions.create(
            model="sim-model", prompt="x", max_tokens=1)
    httpx.post(pod + "/sim/faults", json={"status": None})
    assert httpx.post(pod + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("path, body", [
    ("/v1/messages", {"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}),
    ("/inference/v1/generate", {"model": "sim-model", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1}}),
])
def test_a_status_fault_on_the_other_generation_routes_is_in_the_routes_shape(pod, path, body):
    r = httpx.post(pod + path, headers={"x-sim-fault": "status=503", "x-request-id": "f2"}, json=body)
    assert r.status_code == 503 and r.headers["x-request-id"] == "f2"
    if path == "/v1/messages":   # the Messages API's errors are Anthropic's shape
        assert r.json()["type"] == "error" and r.json()["error"]["message"] == "simulated fault: status 503"
    else:
        assert r.json()["error"]["code"] == 503 and r.json()["error"]["message"] == "simulated fault: status 503"


def test_delay(pod):
    t0 = time.monotonic()
    r = httpx.post(pod + "/v1/completions", headers={"x-sim-fault": "delay=0.3"}, json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 200
    assert time.monotonic() - t0 >= 0.3
    assert float(r.headers["x-sim-ttft-s"]) >= 0.3


def test_connection_dropped_mid_stream(pod):
    got = []
    with pytest.raises(httpx.HTTPError):
        with httpx.stream("POST", pod + "/v1/completions", headers={"x-sim-fault": "drop=2"},
                          json={"prompt": "x", "max_tokens": 10, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line:
                    got.append(line)
    assert len(got) == 2 and "[DONE]" not in got[-1]
    # non-streaming: the body is cut short
    with pytest.raises(httpx.HTTPError):
        httpx.post(pod + "/v1/completions", headers={"x-sim-fault": "drop=1"}, json={"prompt": "x", "max_tokens": 3})
    # the pod is still fine
    assert httpx.post(pod + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_slowdown_multiplies_step_time(pod):
    prompt = list(range(50000, 54000))
    base = httpx.post(pod + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    httpx.post(pod + "/reset_prefix_cache")
    httpx.post(pod + "/sim/faults", json={"slowdown": 3})
    slow = httpx.post(pod + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    ratio = float(slow.headers["x-sim-prefill-compute-s"]) / float(base.headers["x-sim-prefill-compute-s"])
    assert ratio == pytest.approx(3, rel=0.05)


def test_bad_fault_requests_are_400(pod):
    r = httpx.post(pod + "/sim/faults", json={"status": 200})
    assert r.status_code == 400 and "status" in r.json()["error"]["message"]
    r = httpx.post(pod + "/sim/faults", json={"nonsense": 1})
    assert r.status_code == 400
    r = httpx.post(pod + "/v1/completions", headers={"x-sim-fault": "explode=1"}, json={"prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    assert httpx.get(pod + "/sim/faults").json()["status"] is None


def test_fault_flags_at_start():
    port = consecutive_free_ports(1)
    with kvroute_process(["sim", "--port", str(port), "--fault-status", "500"],
                         ready_url=f"http://127.0.0.1:{port}/health"):
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
