"""The simulated pod's HTTP surface, driven with the official openai SDK and plain httpx."""

from __future__ import annotations

import httpx
import openai
import pytest

from simulator.testing import consecutive_free_ports
from tests.helpers import kvroute_process, metric


@pytest.fixture(scope="module")
def pods():
    p0 = consecutive_free_ports(2)
    # two pods in one process, on p0 and p0 + 1
    with kvroute_process(["sim", "--enable-prompt-tokens-details", "--port", str(p0), "--count", "2",
                          "--max-model-len", "4096"], ready_url=f"http://127.0.0.1:{p0 + 1}/health"):
        yield [f"http://127.0.0.1:{p0}", f"http://127.0.0.1:{p0 + 1}"]


def test_prompt_tokens_details_are_null_unless_enabled_as_in_vllm():
    """vLLM sends ``usage.prompt_tokens_details`` only with --enable-prompt-tokens-details (off by
    default) and null otherwise, in a whole answer and in a stream's usage chunk alike."""
    port = consecutive_free_ports(1)
    with kvroute_process(["sim", "--port", str(port)], ready_url=f"http://127.0.0.1:{port}/health"), \
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
        body = {"model": "sim-model", "prompt": list(range(40)), "max_tokens": 2}
        for _ in range(2):   # the second is a prefix hit: still no details
            use = c.post("/v1/completions", json=body).json()["usage"]
            assert "prompt_tokens_details" in use and use["prompt_tokens_details"] is None, use
        r = c.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
        last = [line for line in r.text.splitlines() if line.startswith("data: {")][-1]
        assert '"prompt_tokens_details":null' in last.replace(" ", ""), last


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=10)


def test_completions_text_and_token_ids(pods):
    c = client(pods[0])
    r = c.completions.create(model="sim-model", prompt="The capital of France is", max_tokens=5)
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(b"The capital of France is")
    assert r.usage.completion_tokens == 5
    assert len(r.choices[0].text) == 5  # byte tokenizer: one character per token
    r2 = c.completions.create(model="sim-model", prompt=list(range(40)), max_tokens=3)
    assert r2.usage.prompt_tokens == 40 and r2.usage.completion_tokens == 3
    # the sim reports prefix hits like vLLM's --enable-prompt-tokens-details
    r3 = c.completions.create(model="sim-model", prompt=list(range(40)), max_tokens=3)
    assert r3.usage.prompt_tokens_details.cached_tokens == 32  # two full blocks of 16


def test_chat_through_template(pods):
    c = client(pods[0])
    r = c.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hello"}],
                                  max_tokens=4)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 4
    tok = httpx.post(pods[0] + "/tokenize", json={"messages": [{"role": "user", "content": "hello"}]}).json()
    assert tok["count"] == r.usage.prompt_tokens
    assert "<|im_start|>user" in httpx.post(pods[0] + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]


def test_streaming_with_usage(pods):
    c = client(pods[1])
    chunks = list(c.completions.create(model="sim-model", prompt="stream me", max_tokens=6, stream=True,
                                       stream_options={"include_usage": True}))
    text_chunks = [ch for ch in chunks if ch.choices]
    assert len(text_chunks) == 6
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    # vLLM's StreamOptions default include_usage to false: options without it mean no usage chunk
    bare = list(c.completions.create(model="sim-model", prompt="stream me", max_tokens=2, stream=True,
                                     stream_options={"continuous_usage_stats": False}))
    assert all(ch.choices for ch in bare) and all(ch.usage is None for ch in bare)
    chat = list(c.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chat if ch.choices) != ""
    assert chat[-1].choices[0].finish_reason == "length"


def test_raw_sse_framing_and_request_id(pods):
    with httpx.stream("POST", pods[0] + "/v1/completions", headers={"x-request-id": "abc-123"},
                      json={"prompt": "hi", "max_tokens": 2, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"] == "abc-123"
        body = r.read().decode()
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert '"id":"cmpl-abc-123"' in events[0]


@pytest.mark.parametrize("body,param", [
    (b'{"prompt": "x", "max_tokens": ', None),                      # malformed JSON
    (b'[1, 2, 3]', None),                                           # not an object
    (b'{"prompt": 42}', "prompt"),                                  # wrong prompt type
    (b'{"prompt": "x", "max_tokens": "ten"}', "max_tokens"),        # wrong type
    (b'{"prompt": "x", "stream": "yes"}', "stream"),                # wrong type
    (b'{"prompt": "x", "stream_options": {"include_usage": true}}', "stream_options"),
    (b'{"prompt": [1, -2, 3]}', "prompt"),                          # bad token id
    (b'{"prompt": "' + b"a" * 5000 + b'"}', "prompt"),              # longer than max_model_len
    (b'{"prompt": "' + b"a" * 4000 + b'", "max_tokens": 200}', "max_tokens"),
])
def test_bad_input_gets_vllm_error_shape(pods, body, param):
    r = httpx.post(pods[0] + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["message"]
    assert err["param"] == param


def test_unknown_model_is_404_and_sdk_raises(pods):
    r = httpx.post(pods[0] + "/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The model `gpt-9` does not exist."
    with pytest.raises(openai.BadRequestError):
        client(pods[0]).completions.create(model="sim-model", prompt="x" * 5000)


def test_models_health_tokenize_metrics(pods):
    models = httpx.get(pods[1] + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "sim-model"
    assert models["data"][0]["max_model_len"] == 4096 and models["data"][0]["owned_by"] == "vllm"
    h = httpx.get(pods[1] + "/health")
    assert h.status_code == 200 and h.content == b""
    tok = httpx.post(pods[1] + "/tokenize", json={"prompt": "abc", "return_token_strs": True}).json()
    assert tok == {"count": 3, "max_model_len": 4096, "tokens": [97, 98, 99], "token_strs": ["a", "b", "c"]}
    text = httpx.get(pods[1] + "/metrics").text
    for name in ("vllm:num_requests_running{", "vllm:num_requests_waiting{", "vllm:kv_cache_usage_perc{",
                 "vllm:prefix_cache_queries_total{", "vllm:prefix_cache_hits_total{",
                 "vllm:time_to_first_token_seconds_bucket{", "vllm:request_success_total{",
                 "vllm:generation_tokens_total{"):
        assert name in text, name
    assert 'model_name="sim-model"' in text and 'engine="0"' in text
    assert 'vllm:cache_config_info{block_size="16"' in text
    assert 'num_gpu_blocks="4096"' in text


def test_reset_prefix_cache_drops_hits(pods):
    prompt = list(range(1000, 1064))
    httpx.post(pods[1] + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    hit = httpx.post(pods[1] + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 48  # (64 - 1) // 16 blocks
    assert httpx.post(pods[1] + "/reset_prefix_cache").status_code == 200
    cold = httpx.post(pods[1] + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_pods_in_one_process_have_separate_caches(pods):
    prompt = list(range(2000, 2100))
    httpx.post(pods[0] + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    other = httpx.post(pods[1] + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    same = httpx.post(pods[0] + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] == 96


def test_prompt_tokens_total_counts_the_whole_prompt_cached_or_not(pods):
    """vLLM's ``vllm:prompt_tokens`` adds each request's whole prompt once (its PrefillStats'
    num_prompt_tokens), prefix hits included; ``..._by_source`` splits the same total."""
    prompt = list(range(3000, 3100))
    before = metric(pods[0], "vllm:prompt_tokens_total")
    sources = metric(pods[0], "vllm:prompt_tokens_by_source_total")
    hits = metric(pods[0], "vllm:prefix_cache_hits_total")
    for _ in range(2):
        assert httpx.post(pods[0] + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 200
    assert metric(pods[0], "vllm:prefix_cache_hits_total") == hits + 96  # the second: (100 - 1) // 16 blocks
    assert metric(pods[0], "vllm:prompt_tokens_total") == before + 200
    assert metric(pods[0], "vllm:prompt_tokens_by_source_total") == sources + 200


def test_port_runs_picked_before_anything_binds_them_never_overlap():
    # A test picks a fleet's HTTP ports and its event ports before either process binds them; two runs
    # "free a moment ago" must still not share a port (a ZeroMQ publisher once took a pod's HTTP port).
    runs = [consecutive_free_ports(n) for n in (6, 2, 8, 1, 4) * 40]
    sizes = (6, 2, 8, 1, 4) * 40
    taken = [p for base, n in zip(runs, sizes) for p in range(base, base + n)]
    assert len(taken) == len(set(taken))
