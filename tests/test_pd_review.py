"""P/D review: what a client may put in a body that reaches a NIXL engine, and which requests one
prefill leg cannot serve (vLLM 0.32's behaviour, read in its source and seen on real engines)."""

from __future__ import annotations

import orjson
import pytest
from prometheus_client import CollectorRegistry

from router.disagg import PDMetrics, sanitize_body


def _strip(body: dict, strip: bool = True) -> tuple[bytes, PDMetrics]:
    metrics = PDMetrics(CollectorRegistry())
    raw = orjson.dumps(body)
    return sanitize_body(raw, body, strip, metrics), metrics


@pytest.mark.parametrize("value", [[], "", 0, ["10.9.9.9"], {"remote_host": "10.9.9.9"}])
def test_kv_transfer_params_inside_vllm_xargs_are_stripped(value):
    # vLLM's protocol: extra_args = vllm_xargs, then kv_transfer_params put over it only when the
    # top-level field is truthy. With a NIXL connector, vllm_xargs {"kv_transfer_params": []} stopped
    # vLLM 0.32's engine core (500 "EngineCore encountered an issue", then /health refused)
    body = {"model": "m", "prompt": "p", "vllm_xargs": {"kv_transfer_params": value, "mine": 1}}
    out, metrics = _strip(body)
    assert orjson.loads(out) == {"model": "m", "prompt": "p", "vllm_xargs": {"mine": 1}}
    assert metrics.stripped._value.get() == 1


def test_encoder_cache_params_inside_vllm_xargs_are_stripped_too():
    # vLLM reads ec_transfer_params from the same extra_args and hands them to an encoder-cache
    # connector (vllm/v1/request.py): a client must not steer that transfer either
    body = {"prompt": "p", "vllm_xargs": {"ec_transfer_params": {"remote_host": "10.0.0.9"}, "mine": 1}}
    out, metrics = _strip(body)
    assert orjson.loads(out) == {"prompt": "p", "vllm_xargs": {"mine": 1}}
    assert metrics.stripped._value.get() == 1


def test_both_spellings_go_in_one_rewrite_and_clean_bodies_pass_as_they_are():
    body = {"prompt": "p", "kv_transfer_params": {"remote_host": "h"}, "vllm_xargs": {"kv_transfer_params": ""}}
    out, metrics = _strip(body)
    assert orjson.loads(out) == {"prompt": "p", "vllm_xargs": {}}
    assert metrics.stripped._value.get() == 1
    for clean in ({"prompt": "p"}, {"prompt": "p", "vllm_xargs": {"a": "b"}}, {"prompt": "p", "vllm_xargs": None},
                  {"prompt": "p", "vllm_xargs": ["kv_transfer_params"]}):
        raw = orjson.dumps(clean)
        assert sanitize_body(raw, dict(clean), True, PDMetrics(CollectorRegistry())) is raw
    # strip off: a trusted proxy's params pass
    body = {"prompt": "p", "vllm_xargs": {"kv_transfer_params": []}}
    out, metrics = _strip(body, strip=False)
    assert orjson.loads(out) == body and metrics.stripped._value.get() == 0


# ---- requests whose decode engine computes the whole prompt whatever the prefill did ----------

@pytest.mark.parametrize(("body", "path", "reason"), [
    ({"prompt": "p", "prompt_logprobs": 0}, "/v1/completions", "prompt_logprobs"),
    ({"prompt": "p", "prompt_logprobs": 1}, "/v1/completions", "prompt_logprobs"),
    ({"prompt": "p", "echo": True, "logprobs": 0}, "/v1/completions", "prompt_logprobs"),
    ({"prompt": "p", "echo": "yes", "logprobs": 1}, "/v1/completions", "prompt_logprobs"),
    ({"prompt": "p", "echo": True}, "/v1/completions", None),            # prompt_logprobs = logprobs = None
    ({"prompt": "p", "echo": False, "logprobs": 2}, "/v1/completions", None),
    ({"prompt": "p", "prompt_logprobs": None}, "/v1/completions", None),
    ({"messages": [], "prompt_logprobs": 1}, "/v1/chat/completions", "prompt_logprobs"),
    ({"messages": [], "echo": True}, "/v1/chat/completions", "prompt_logprobs"),  # top_logprobs defaults to 0
    ({"messages": [], "echo": 1, "top_logprobs": None}, "/v1/chat/completions", "prompt_logprobs"),
    ({"messages": [], "echo": "false"}, "/v1/chat/completions", None),
    ({"messages": [], "logprobs": True, "top_logprobs": 5}, "/v1/chat/completions", None),
    ({"input": "p", "prompt_logprobs": 1}, "/v1/responses", None),
    ({"prompt": "p", "n": 2, "prompt_logprobs": 1}, "/v1/completions", "several_choices"),
])
def test_a_request_for_prompt_logprobs_is_one_a_prefill_leg_cannot_serve(body, path, reason):
    # vLLM 0.32 sets skip_reading_prefix_cache for prompt logprobs, and its scheduler then takes no
    # external tokens from the connector: on real engines the decode leg of such a request read
    # nothing over NIXL and computed the whole prompt (completion prompt_logprobs 1: local_compute
    # 1,506, external_kv_transfer 0; echo + logprobs: 1,508 and 0; chat echo: 1,557 and 0; the same
    # requests without them: external_kv_transfer 1,451 and 1,521, local_compute 0)
    from kvcommon.transfer import one_prefill_cannot_serve
    assert one_prefill_cannot_serve(body, path) == reason


def test_the_planner_keeps_a_prompt_logprobs_request_on_the_decode_pod():
    from router.scheduling.pd import DecodeView, PDParams, decide_pd
    from router.scheduling.snapshot import Candidate, RequestView

    decode = DecodeView(candidate=Candidate(pod_id="d", prefill_tokens_per_s=1000.0))
    prefill = Candidate(pod_id="p", prefill_tokens_per_s=100_000.0)
    for single, mode in ((True, "remote"), (False, "local")):
        request = RequestView(prompt_tokens=4000, single_prefill=single)
        chosen = decide_pd([decode], [prefill], request, 16, PDParams(decider="always")).chosen
        assert chosen is not None and chosen.mode == mode, chosen
    assert "prompt logprobs" in chosen.reason


# ---- through the router, to recording pods --------------------------------------------------

@pytest.mark.e2e
async def test_the_router_sends_neither_spelling_of_client_params_and_no_prefill_leg_for_prompt_logprobs():
    import httpx

    from kvcommon.settings import build_settings
    from router.config import RouterSettings
    from tests.helpers import free_port
    from tests.test_router_api import Pod, running_router

    prefill, decode = Pod("prefill-0", free_port()), Pod("decode-0", free_port())
    for pod in (prefill, decode):
        await pod.start()
    try:
        settings = build_settings(RouterSettings, {
            "port": free_port(), "health_interval_s": 0.2, "scrape_interval_s": 0.1, "pd_decider": "always",
            "pods": [{"id": "prefill-0", "url": prefill.url, "model": "m", "role": "prefill"},
                     {"id": "decode-0", "url": decode.url, "model": "m", "role": "decode"}]})
        async with running_router(settings) as (base, _), httpx.AsyncClient(base_url=base, timeout=20) as c:
            prompt = "a long prompt " * 200
            sent = [
                {"model": "m", "prompt": prompt, "max_tokens": 2},
                {"model": "m", "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 1},
                {"model": "m", "prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 1},
                {"model": "m", "prompt": prompt, "max_tokens": 2, "vllm_xargs": {"kv_transfer_params": [], "k": "v"}},
            ]
            for body in sent:
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "decode-0", r.text
            r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [
                {"role": "user", "content": prompt}], "max_tokens": 2, "echo": True})
            assert r.status_code == 200, r.text
            metric = (await c.get("/metrics")).text
        prefill_headers = [s["headers"].get("x-prefiller-host-port") for s in decode.seen]
        assert prefill_headers == [f"127.0.0.1:{prefill.port}", None, None, f"127.0.0.1:{prefill.port}", None]
        assert orjson.loads(decode.seen[3]["raw"])["vllm_xargs"] == {"k": "v"}
        assert "kvroute_client_kv_transfer_params_stripped_total 1.0" in metric
    finally:
        for pod in (prefill, decode):
            await pod.stop()
