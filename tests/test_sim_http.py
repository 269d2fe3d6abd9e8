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
    default): null otherwise in a whole answer (``model_dump()``), and left out of a stream's usage
    chunk, which vLLM 0.32 dumps with ``exclude_none=True`` (completion/serving.py)."""
    port = consecutive_free_ports(1)
    with kvroute_process(["sim", "--port", str(port)], ready_url=f"http://127.0.0.1:{port}/health"), \
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
        body = {"model": "sim-model", "prompt": list(range(40)), "max_tokens": 2}
        for _ in range(2):   # the second is a prefix hit: still no details
            use = c.post("/v1/completions", json=body).json()["usage"]
            assert "prompt_tokens_details" in use and use["prompt_tokens_details"] is None, use
        r = c.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
        last = [line for line in r.text.splitlines() if line.startswith("data: {")][-1]
        assert '"usage":{"prompt_tokens":40,"total_tokens":42,"completion_tokens":2}' in last, last
        assert "null" not in last, last


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
        assert "cache-control" not in r.headers  # vLLM 0.32 sends none (the router adds its own)
        body = r.read().decode()
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert '"id":"cmpl-abc-123"' in events[0]


@pytest.mark.parametrize("body,param,err_type", [
    # what vLLM 0.32's pydantic request model refuses: FastAPI's handler types it "Bad Request" and
    # names the field as body.<loc> (serve/exception_handling/handlers/validation.py)
    (b'{"prompt": "x", "max_tokens": ', "body.30", "Bad Request"),  # malformed JSON: body.<offset>
    (b'[1, 2, 3]', "body", "Bad Request"),                         # not an object
    (b'', "body", "Bad Request"),                                  # no body
    (b'{"prompt": 42}', "body.prompt", "Bad Request"),             # wrong prompt type
    (b'{"prompt": "x", "max_tokens": "ten"}', "body.max_tokens", "Bad Request"),
    (b'{"prompt": "x", "stream": "yes"}', "body.stream", "Bad Request"),
    (b'{"prompt": "x", "stream_options": {"include_usage": true}}', "stream_options", "Bad Request"),
    (b'{"prompt": [1, -2, 3]}', "body.prompt.1", "Bad Request"),  # token ids are Field(ge=0)
    (b'{"prompt": ""}', "prompt", "Bad Request"),
    # what its serving code refuses (VLLMValidationError): "BadRequestError"
    (b'{"prompt": "' + b"a" * 5000 + b'"}', "input_tokens", "BadRequestError"),  # longer than max_model_len
    (b'{"prompt": "x", "max_tokens": 5000}', "max_tokens", "BadRequestError"),   # more than max_model_len
    (b'{"prompt": "x", "max_tokens": 0}', "max_tokens", "BadRequestError"),
    (b'{"prompt": [1, 2, 3], "max_tokens": 5, "min_tokens": 6}', None, "BadRequestError"),
])
def test_bad_input_gets_vllm_error_shape(pods, body, param, err_type):
    r = httpx.post(pods[0] + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == err_type and err["code"] == 400 and err["message"]
    assert err["param"] == param


def test_error_messages_are_vllms(pods):
    """vLLM 0.32's words for the refusals a client most often meets (max_model_len 4096 here)."""
    def err(body: dict, path: str = "/v1/completions") -> dict:
        r = httpx.post(pods[0] + path, json=body)
        assert r.status_code in (400, 404), r.text
        return r.json()["error"]

    # renderers/params.py TokenizeParams.__post_init__
    assert err({"prompt": "x", "max_tokens": 5000})["message"] == (
        "max_tokens=5000 cannot be greater than max_model_len=4096. Please request fewer output tokens.")
    chat = err({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000},
               "/v1/chat/completions")
    assert chat["param"] == "max_completion_tokens" and chat["message"].startswith("max_completion_tokens=5000 ")
    # renderers/params.py _token_len_check: a token-id prompt says its length; a text prompt was
    # tokenized with truncation to max_model_len + 1, so "at least" that
    assert err({"prompt": [1] * 4100})["message"] == (
        "This model's maximum context length is 4096 tokens. However, your prompt contains 4100 input tokens, "
        "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt.")
    assert "your prompt contains at least 4097 input tokens" in err({"prompt": "a" * 5000})["message"]
    # a prompt of exactly max_model_len leaves get_max_tokens 0: SamplingParams refuses it
    assert err({"prompt": [1] * 4096, "max_tokens": 1})["message"] == "max_tokens must be at least 1, got 0."
    assert err({"prompt": [1, 2], "max_tokens": 2, "min_tokens": 3})["message"] == (
        "min_tokens must be less than or equal to max_tokens=2, got 3.")
    # serve/engine/serving.py _check_model
    assert err({"model": "gpt-9", "prompt": "x"})["message"] == (
        "The model `gpt-9` does not exist. Valid aliases: sim-model.")
    bad = httpx.post(pods[0] + "/v1/completions", content=b'{"prompt": "x", "max_tokens": ',
                     headers={"content-type": "application/json"}).json()["error"]
    assert bad["message"] == ("1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.30', 'msg': 'JSON "
                              "decode error', 'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting value'}}")


def test_a_body_not_declared_as_json_is_refused_as_vllm_refuses_it(pods):
    """vLLM's JSON routes depend on ``validate_json_request`` (serve/utils/api_utils.py): any media type
    but application/json is a 400 (the declared type, not the body, decides); FastAPI decodes a body
    declared as JSON, or not declared, first, so bad JSON is reported before the type."""
    body = b'{"prompt": "hi", "max_tokens": 2}'
    refused = "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
    for path in ("/v1/completions", "/tokenize"):
        for declared in ("text/plain", "application/x-www-form-urlencoded", None, "application/vnd.api+json"):
            r = httpx.post(pods[0] + path, content=body, headers={"content-type": declared} if declared else {})
            assert r.status_code == 400, (path, declared, r.text)
            assert r.json()["error"] == {"message": refused, "type": "Bad Request", "param": None, "code": 400}
        ok = httpx.post(pods[0] + path, content=body, headers={"content-type": "Application/JSON; charset=utf-8"})
        assert ok.status_code == 200, ok.text
    bad_json = httpx.post(pods[0] + "/v1/completions", content=b"{", headers={})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["param"] == "body.1"


def test_max_tokens_past_the_context_is_clamped_not_refused(pods):
    """vLLM 0.32's ``get_max_tokens`` clamps max_tokens to max_model_len - prompt length (it no longer
    refuses the request): the answer stops there with 'length'. A completion without max_tokens gets
    CompletionRequest's default of 16 ('length' at 16)."""
    r = httpx.post(pods[0] + "/v1/completions", json={"prompt": [7] * 4090, "max_tokens": 200})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] == 6 and out["choices"][0]["finish_reason"] == "length"
    d = httpx.post(pods[0] + "/v1/completions", json={"prompt": "hi", "stream": False}).json()
    assert d["usage"]["completion_tokens"] == 16 and d["choices"][0]["finish_reason"] == "length"


def test_unknown_model_is_404_and_sdk_raises(pods):
    r = httpx.post(pods[0] + "/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The model `gpt-9` does not exist. Valid aliases: sim-model."
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


@pytest.mark.parametrize("extra", [{"prompt_logprobs": 1}, {"echo": True, "logprobs": 1}],
                         ids=["prompt_logprobs", "echo+logprobs"])
def test_a_request_for_prompt_logprobs_reads_no_cached_prefix_as_in_vllm(pods, extra):
    """vLLM skips its prefix cache for a request that asks for prompt logprobs (its sampling params'
    ``skip_reading_prefix_cache``): no hit though the pod holds the prompt, no prefix-cache query
    counted, the whole prompt computed (seen on vLLM 0.32: tests/real_vllm/test_engine_cache.py)."""
    prompt = list(range(4000 + 200 * len(extra), 4100 + 200 * len(extra)))
    body = {"prompt": prompt, "max_tokens": 1}
    assert httpx.post(pods[0] + "/v1/completions", json=body).status_code == 200
    queries = metric(pods[0], "vllm:prefix_cache_queries_total")
    computed = metric(pods[0], "vllm:prompt_tokens_by_source_total", source="local_compute")
    skipped = httpx.post(pods[0] + "/v1/completions", json={**body, **extra}).json()
    assert skipped["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert metric(pods[0], "vllm:prefix_cache_queries_total") == queries
    assert metric(pods[0], "vllm:prompt_tokens_by_source_total", source="local_compute") == computed + 100
    again = httpx.post(pods[0] + "/v1/completions", json=body).json()  # the blocks are still held
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96


def test_port_runs_picked_before_anything_binds_them_never_overlap():
    # A test picks a fleet's HTTP ports and its event ports before either process binds them; two runs
    # "free a moment ago" must still not share a port (a ZeroMQ publisher once took a pod's HTTP port).
    runs = [consecutive_free_ports(n) for n in (6, 2, 8, 1, 4) * 40]
    sizes = (6, 2, 8, 1, 4) * 40
    taken = [p for base, n in zip(runs, sizes) for p in range(base, base + n)]
    assert len(taken) == len(set(taken))


def _sse(base: str, path: str, body: dict) -> list[dict]:
    import json
    r = httpx.post(base + path, json=body, timeout=10)
    lines = [line for line in r.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_continuous_usage_counts_the_output_so_far_as_vllm(pods):
    """vLLM 0.32 (completion/serving.py, chat_completion/serving.py): with continuous_usage_stats each
    chunk's usage has the output tokens so far (this chunk's included), only the fields it sets
    (exclude_unset: no prompt_tokens_details), and the chat role chunk carries usage with 0."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _sse(pods[0], "/v1/completions", {"prompt": [5] * 20, "max_tokens": 4, "stream": True,
                                               "stream_options": opts})
    assert [c["usage"] for c in chunks[:-1]] == [
        {"prompt_tokens": 20, "total_tokens": 20 + k, "completion_tokens": k} for k in (1, 2, 3, 4)]
    chat = _sse(pods[0], "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                                                  "stream": True, "stream_options": opts})
    n = chat[0]["usage"]["prompt_tokens"]
    assert chat[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["usage"]["completion_tokens"] for c in chat[:-1]] == [0, 1, 2, 3]
    assert chat[1]["usage"] == {"prompt_tokens": n, "total_tokens": n + 1, "completion_tokens": 1,
                                "completion_tokens_details": None}


def test_stream_chunks_have_vllms_fields(pods):
    """The keys vLLM 0.32 sets on each chunk (dumped with exclude_unset), the system_fingerprint on the
    terminal chunk (no usage chunk) or on the usage chunk, whose nulls are all dropped."""
    c = _sse(pods[0], "/v1/completions", {"prompt": [5] * 20, "max_tokens": 2, "stream": True})
    assert c[0]["choices"][0] == {"index": 0, "text": c[0]["choices"][0]["text"], "logprobs": None,
                                  "finish_reason": None, "stop_reason": None, "prompt_token_ids": None,
                                  "token_ids": None}
    assert "system_fingerprint" not in c[0] and c[-1]["system_fingerprint"].startswith("vllm-")
    chat = _sse(pods[0], "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                                  "stream": True, "stream_options": {"include_usage": True}})
    assert set(chat[0]) == {"id", "object", "created", "model", "choices", "prompt_token_ids", "prompt_text"}
    assert chat[1]["choices"][0] == {"index": 0, "delta": {"content": chat[1]["choices"][0]["delta"]["content"]},
                                     "logprobs": None, "finish_reason": None, "token_ids": None}
    assert chat[2]["choices"][0]["finish_reason"] == "length" and chat[2]["choices"][0]["stop_reason"] is None
    assert "system_fingerprint" not in chat[2]   # a usage chunk follows: it carries the fingerprint
    last = chat[-1]
    assert last["choices"] == [] and last["system_fingerprint"].startswith("vllm-")
    details = last["usage"].pop("prompt_tokens_details")
    assert set(details) == {"cached_tokens", "created_cache_tokens"}   # multimodal_tokens: null, dropped
    assert set(last["usage"]) == {"prompt_tokens", "total_tokens", "completion_tokens"}
    # return_token_ids: the prompt's ids on the first chunk, each chunk's own ids
    ids = _sse(pods[0], "/v1/completions", {"prompt": [5] * 20, "max_tokens": 2, "stream": True,
                                            "return_token_ids": True})
    assert ids[0]["choices"][0]["prompt_token_ids"] == [5] * 20 and ids[1]["choices"][0]["prompt_token_ids"] is None
    assert all(len(x["choices"][0]["token_ids"]) == 1 for x in ids)


def test_whole_answers_have_vllms_fields(pods):
    """``model_dump()`` of vLLM 0.32's responses: every field, the chat message without an empty
    ``tool_calls`` and with ``reasoning`` (not ``reasoning_content``), a system_fingerprint."""
    out = httpx.post(pods[0] + "/v1/completions", json={"prompt": [5] * 20, "max_tokens": 2}).json()
    assert set(out) == {"id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
                        "usage", "kv_transfer_params", "ec_transfer_params", "metrics"}
    assert set(out["choices"][0]) == {"index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
                                      "prompt_logprobs", "prompt_token_ids", "routed_experts"}
    assert out["usage"]["completion_tokens_details"] is None
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": out["usage"]["prompt_tokens_details"]
                                                     ["cached_tokens"], "created_cache_tokens": None,
                                                     "multimodal_tokens": None}
    assert out["system_fingerprint"].startswith("vllm-")
    chat = httpx.post(pods[0] + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}).json()
    assert set(chat) == {"id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
                         "usage", "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
                         "ec_transfer_params", "metrics"}
    assert set(chat["choices"][0]["message"]) == {"role", "content", "refusal", "annotations", "audio",
                                                  "function_call", "reasoning"}
    assert set(chat["choices"][0]) == {"index", "message", "logprobs", "finish_reason", "stop_reason",
                                       "token_ids", "routed_experts"}
    assert isinstance(chat["usage"]["prompt_tokens_details"]["created_cache_tokens"], int)
    ids = httpx.post(pods[0] + "/v1/completions",
                     json={"prompt": [5] * 20, "max_tokens": 2, "return_token_ids": True}).json()["choices"][0]
    assert ids["prompt_token_ids"] == [5] * 20 and len(ids["token_ids"]) == 2


def test_chat_role_chunk_waits_for_the_first_token():
    """vLLM sends a chat stream's first chunk (the role) with the first output, not at once: a client
    timing the first chunk measures the time to the first token."""
    import time
    port = consecutive_free_ports(1)
    with kvroute_process(["sim", "--port", str(port), "--step-overhead-s", "0.4"],
                         ready_url=f"http://127.0.0.1:{port}/health"):
        t0 = time.monotonic()
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", timeout=10,
                          json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                                "stream": True}) as r:
            first = next(r.iter_lines())
            waited = time.monotonic() - t0
        assert '"role":"assistant"' in first and waited >= 0.35, (first, waited)


def test_cache_salt_is_checked_as_vllm_checks_it(pods):
    """validate_cache_salt (vllm/entrypoints/generate/base/protocol.py, a model validator): non-empty,
    at most 128 characters, no '@', '/', '\\\\' or NUL; the error names param cache_salt."""
    for salt in ("", 7, "a/b", "tenant@x", "x" * 129):
        r = httpx.post(pods[0] + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "cache_salt": salt})
        assert r.status_code == 400, salt
        assert r.json()["error"]["param"] == "cache_salt" and r.json()["error"]["type"] == "Bad Request"
    ok = httpx.post(pods[0] + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "cache_salt": "x" * 128})
    assert ok.status_code == 200
