"""The simulated pod's ``POST /inference/v1/generate`` (vLLM 0.32's token-in generation:
vllm/entrypoints/scale_out/token_in_token_out/, ``GenerateRequest`` and ``ServingTokens.serve_tokens``):
token ids in, run as they are (prefix cache included), one whole JSON answer or an SSE stream ended by
``data: [DONE]``, and vLLM's refusals word for word (the pydantic ones as vLLM 0.32's FastAPI app and
exception handlers answered them for ``GenerateRequest``)."""

from __future__ import annotations

import json
import random
import re
import time

import httpx
import pytest

from simulator.testing import consecutive_free_ports
from tests.helpers import kvroute_process, metric

MAX_MODEL_LEN = 256
BLOCK = 16
PATH = "/inference/v1/generate"

# vLLM 0.32's fields, in its order: GenerateTokensResponse, a GenerateTokensChoice
ANSWER_FIELDS = ["request_id", "model", "created", "usage", "prompt_logprobs", "prompt_token_id_logprobs",
                 "prompt_token_ids", "mm_placeholders", "metrics", "kv_transfer_params", "ec_transfer_params",
                 "output_mode", "choices"]
CHOICE_FIELDS = ["index", "finish_reason", "stop_reason", "token_ids", "routed_experts", "sampling_mask",
                 "weight_versions", "logprobs"]


@pytest.fixture(scope="module")
def pod():
    port = consecutive_free_ports(1)
    with kvroute_process(["sim", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN),
                          "--enable-prompt-tokens-details"], ready_url=f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


def fresh_ids(n: int) -> list[int]:
    """``n`` token ids no other request of the module sends (so nothing of them is cached yet)."""
    return [random.randrange(1000, 50000) for _ in range(n)]


def post(base: str, body: object, **kw) -> httpx.Response:
    return httpx.post(base + PATH, json=body, timeout=30, **kw)


def events(raw: str) -> list[str]:
    """The ``data:`` payloads of a stream, in order; every event is one ``data:`` line."""
    blocks = [b for b in raw.split("\n\n") if b]
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), raw
    return [b[len("data: "):] for b in blocks]


def details(prompt: int, completion: int, cached: int) -> dict:
    """``usage`` of a whole answer on a pod with --enable-prompt-tokens-details."""
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached, "created_cache_tokens": None,
                                      "multimodal_tokens": None},
            "completion_tokens_details": None}


@pytest.mark.e2e
def test_the_whole_answer_is_a_generate_tokens_response(pod):
    ids = fresh_ids(20)
    r = post(pod, {"token_ids": ids, "sampling_params": {"max_tokens": 5, "temperature": 0},
                   "request_id": "body-id", "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json" and r.headers["x-request-id"] == "body-id"
    body = r.json()
    assert list(body) == ANSWER_FIELDS
    assert body["request_id"] == "generate-tokens-body-id"   # the body's request_id, prefixed
    assert body["model"] == "sim-model" and body["output_mode"] == "tokens" and abs(body["created"] - time.time()) < 60
    assert body["prompt_token_ids"] == ids
    assert body["usage"] == details(20, 5, 0)
    assert all(body[k] is None for k in ("prompt_logprobs", "prompt_token_id_logprobs", "mm_placeholders", "metrics",
                                         "kv_transfer_params", "ec_transfer_params"))
    [choice] = body["choices"]
    assert list(choice) == CHOICE_FIELDS
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert len(choice["token_ids"]) == 5 and all(isinstance(t, int) for t in choice["token_ids"])

    # the X-Request-Id header wins over the body's; none at all: vLLM's random_uuid, 16 hex digits
    r = post(pod, {"token_ids": fresh_ids(3), "sampling_params": {"max_tokens": 1}, "request_id": "b"},
             headers={"x-request-id": "hdr"})
    assert r.json()["request_id"] == "generate-tokens-hdr" and r.json()["prompt_token_ids"] is None
    r = post(pod, {"token_ids": fresh_ids(3), "sampling_params": {"max_tokens": 1}})
    assert re.fullmatch(r"generate-tokens-[0-9a-f]{16}", r.json()["request_id"]), r.text

    # kv_transfer_params reach the engine's connector: a prefill leg answers the blocks it leases
    r = post(pod, {"token_ids": fresh_ids(40), "sampling_params": {"max_tokens": 1},
                   "kv_transfer_params": {"do_remote_decode": True}}, headers={"x-request-id": "p1"})
    kv = r.json()["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["remote_num_tokens"] == 40, r.text
    assert kv["remote_request_id"].startswith("generate-tokens-p1-") and len(kv["remote_block_ids"][0]) == 3


@pytest.mark.e2e
def test_the_budget_is_vllms(pod):
    """No ``max_tokens``: the server's default (what fits), not SamplingParams' 16, so the simulated model
    stops on its own ('stop' after --default-max-tokens, 16); a budget past what fits, even past
    max_model_len (no output-budget check on this route: its TokenizeParams' max_output_tokens is 0),
    ends at max_model_len ('length'); output_mode "text" adds the text (one byte per token here)."""
    r = post(pod, {"token_ids": fresh_ids(4), "sampling_params": {}})
    [choice] = r.json()["choices"]
    assert (choice["finish_reason"], len(choice["token_ids"])) == ("stop", 16), r.text
    r = post(pod, {"token_ids": fresh_ids(MAX_MODEL_LEN - 3), "sampling_params": {"max_tokens": 4 * MAX_MODEL_LEN}})
    [choice] = r.json()["choices"]
    assert (choice["finish_reason"], len(choice["token_ids"])) == ("length", 3), r.text
    r = post(pod, {"token_ids": fresh_ids(4), "sampling_params": {"max_tokens": 6}, "output_mode": "text"})
    body = r.json()
    assert body["output_mode"] == "text" and list(body["choices"][0]) == [*CHOICE_FIELDS[:-1], "text", "logprobs"]
    assert body["choices"][0]["text"] == bytes(body["choices"][0]["token_ids"]).decode()
    assert len(body["choices"][0]["text"]) == 6


@pytest.mark.e2e
def test_the_stream_is_a_chunk_per_token_then_usage_then_done(pod):
    ids = fresh_ids(10)
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 4}, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    r = post(pod, body, headers={"x-request-id": "s1"})
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream; charset=utf-8"
    data = events(r.text)
    assert data[-1] == "[DONE]" and len(data) == 6
    chunks = [json.loads(d) for d in data[:-1]]
    for i, chunk in enumerate(chunks[:4]):
        # the prompt's ids on the first chunk only; usage null without continuous usage stats
        assert list(chunk) == (["request_id", "usage", "prompt_token_ids", "output_mode", "choices"] if i == 0
                               else ["request_id", "usage", "output_mode", "choices"])
        assert chunk["request_id"] == "generate-tokens-s1" and chunk["usage"] is None
        [choice] = chunk["choices"]
        assert list(choice) == CHOICE_FIELDS and len(choice["token_ids"]) == 1
        assert choice["finish_reason"] == ("length" if i == 3 else None)
    assert chunks[0]["prompt_token_ids"] == ids
    # the usage chunk: no choices, nulls left out
    assert chunks[4] == {"request_id": "generate-tokens-s1", "output_mode": "tokens", "choices": [],
                         "usage": {"prompt_tokens": 10, "total_tokens": 14, "completion_tokens": 4,
                                   "prompt_tokens_details": {"cached_tokens": 0}}}

    # no stream_options: no usage chunk; continuous usage: each chunk counts the tokens so far
    r = post(pod, {"token_ids": fresh_ids(3), "sampling_params": {"max_tokens": 2}, "stream": True})
    data = events(r.text)
    assert len(data) == 3 and data[-1] == "[DONE]" and "prompt_token_ids" not in json.loads(data[0])
    r = post(pod, {"token_ids": fresh_ids(3), "sampling_params": {"max_tokens": 2}, "stream": True,
                   "output_mode": "text", "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = [json.loads(d) for d in events(r.text)[:-1]]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 2]
    assert chunks[0]["usage"] == {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1,
                                  "prompt_tokens_details": None, "completion_tokens_details": None}
    assert all(c["output_mode"] == "text" for c in chunks) and all(len(c["choices"][0]["text"]) == 1
                                                                  for c in chunks[:2])


def validation(param: str, *errors: str) -> dict:
    """vLLM's body for a request its pydantic model refuses."""
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "\n".join(f"  {e}" for e in errors)
    return {"error": {"message": message, "type": "Bad Request", "param": param, "code": 400}}


def bad_request(message: str, param: str | None = None) -> dict:
    """vLLM's body for a VLLMValidationError or ValueError its handlers get as it is."""
    return {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}


NOT_SAMPLING_PARAMS = ("{'type': 'is_instance_of', 'loc': 'body.sampling_params', 'msg': 'Input should be an "
                       "instance of SamplingParams', 'input': '%s', 'ctx': {'class': 'SamplingParams'}}")


@pytest.mark.e2e
@pytest.mark.parametrize("body,expected", [
    # what vLLM 0.32's app answered for these bodies, word for word
    ({"token_ids": [1, 2, 3]}, validation(
        "body.sampling_params", "{'type': 'missing', 'loc': 'body.sampling_params', 'msg': 'Field required', "
                                "'input': '<dict of 1 items>'}")),
    ({}, validation(
        "body.token_ids", "{'type': 'missing', 'loc': 'body.token_ids', 'msg': 'Field required', "
                          "'input': '<dict of 0 items>'}",
        "{'type': 'missing', 'loc': 'body.sampling_params', 'msg': 'Field required', 'input': '<dict of 0 items>'}")),
    ({"token_ids": [1, -2, 3], "sampling_params": {}}, validation(
        "body.token_ids", "{'type': 'value_error', 'loc': 'body.token_ids', 'msg': 'Value error, token_ids must not "
                          "contain negative values', 'input': '<list of 3 items>', 'ctx': {'error': "
                          "ValueError('token_ids must not contain negative values')}}")),
    ({"token_ids": [], "sampling_params": {}}, validation(
        "body.token_ids", "{'type': 'too_short', 'loc': 'body.token_ids', 'msg': 'List should have at least 1 item "
                          "after validation, not 0', 'input': '<list of 0 items>', 'ctx': {'field_type': 'List', "
                          "'min_length': 1, 'actual_length': 0}}")),
    ({"token_ids": [1, 2.5], "sampling_params": {}}, validation(
        "body.token_ids.1", "{'type': 'int_from_float', 'loc': 'body.token_ids.1', 'msg': 'Input should be a valid "
                            "integer, got a number with a fractional part', 'input': '2.5'}")),
    ({"token_ids": [1], "sampling_params": [1]}, validation(
        "body.sampling_params", NOT_SAMPLING_PARAMS % "<list of 1 items>",
        "{'type': 'dict_type', 'loc': 'body.sampling_params', 'msg': 'Input should be a valid dictionary', "
        "'input': '<list of 1 items>'}")),
    ({"token_ids": [1], "sampling_params": {"max_tokens": "x", "min_tokens": 1.5, "n": None}}, validation(
        "body.sampling_params", NOT_SAMPLING_PARAMS % "<dict of 3 items>",
        "{'type': 'int_type', 'loc': 'body.sampling_params.n', 'msg': 'Input should be a valid integer', "
        "'input': 'None'}",
        "{'type': 'int_parsing', 'loc': 'body.sampling_params.max_tokens', 'msg': 'Input should be a valid integer, "
        "unable to parse string as an integer', 'input': 'x'}",
        "{'type': 'int_from_float', 'loc': 'body.sampling_params.min_tokens', 'msg': 'Input should be a valid "
        "integer, got a number with a fractional part', 'input': '1.5'}")),
    ({"token_ids": [1], "sampling_params": {}, "output_mode": "json"}, validation(
        "body.output_mode", "{'type': 'literal_error', 'loc': 'body.output_mode', 'msg': \"Input should be 'tokens' "
                            "or 'text'\", 'input': 'json', 'ctx': {'expected': \"'tokens' or 'text'\"}}")),
    ({"token_ids": [1], "sampling_params": {"detokenize": False}, "output_mode": "text"}, validation(
        "body", "{'type': 'value_error', 'loc': 'body', 'msg': \"Value error, output_mode='text' requires "
                "sampling_params.detokenize to be true\", 'input': '<dict of 3 items>', 'ctx': {'error': "
                "ValueError(\"output_mode='text' requires sampling_params.detokenize to be true\")}}")),
    ([1, 2], validation(
        "body", "{'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid dictionary or "
                "object to extract fields from', 'input': '<list of 2 items>'}")),
    # SamplingParams' own checks escape pydantic as they are, before the other fields' errors
    ({"token_ids": [-1], "sampling_params": {"max_tokens": 0}}, bad_request(
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", "max_tokens")),
    ({"token_ids": [1], "sampling_params": {"min_tokens": 20}}, bad_request(   # against its default of 16
        "min_tokens must be less than or equal to max_tokens=16, got 20.")),
    # validate_cache_salt, a "before" validator: first of all
    ({"cache_salt": "a/b"}, bad_request(
        "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL. "
        "(parameter=cache_salt)", "cache_salt")),
    # serve_tokens: the model, then get_max_tokens when no max_tokens is given
    ({"token_ids": [1], "sampling_params": {}, "model": "other"}, {"error": {
        "message": "The model `other` does not exist. Valid aliases: sim-model.", "type": "NotFoundError",
        "param": "model", "code": 404}}),
    ({"token_ids": [1] * (MAX_MODEL_LEN + 1), "sampling_params": {}, "stream": True}, bad_request(
        f"Input length ({MAX_MODEL_LEN + 1}) exceeds model's maximum context length ({MAX_MODEL_LEN}).")),
])
def test_refusals_are_vllms(pod, body, expected):
    r = post(pod, body)
    assert r.status_code == expected["error"]["code"], r.text
    assert r.json() == expected


LONGER = (f"The decoder prompt (length {MAX_MODEL_LEN + 1}) is longer than the maximum model length of "
          f"{MAX_MODEL_LEN}. Make sure that `max_model_len` is no smaller than the number of text tokens.")
FULL = (f"The decoder prompt (length {MAX_MODEL_LEN}) plus the number of requested output tokens (at least 1) is "
        f"longer than the maximum model length of {MAX_MODEL_LEN}. Make sure that `max_model_len` is no smaller "
        f"than the number of text tokens (prompt + requested output tokens).")


@pytest.mark.e2e
def test_the_engine_refuses_a_prompt_that_leaves_no_room_once_the_request_runs(pod):
    """With ``max_tokens`` given, or a prompt of exactly max_model_len tokens, the engine's input check
    refuses it when the request is added: a 400 for a whole answer, but a stream has started by then
    and carries the error as its one event (json.dumps' spacing) before ``[DONE]``."""
    done = metric(pod, "vllm:request_success_total")
    for n, sp, message in ((MAX_MODEL_LEN + 1, {"max_tokens": 2}, LONGER), (MAX_MODEL_LEN, {}, FULL)):
        r = post(pod, {"token_ids": [1] * n, "sampling_params": sp})
        assert r.status_code == 400 and r.json() == bad_request(message), r.text
        r = post(pod, {"token_ids": [1] * n, "sampling_params": sp, "stream": True})
        assert r.status_code == 200, r.text
        error = json.dumps(bad_request(message))
        assert r.text == f"data: {error}\n\ndata: [DONE]\n\n"
    assert metric(pod, "vllm:request_success_total") == done   # nothing ran


@pytest.mark.e2e
def test_token_ids_are_the_prompt_the_prefix_cache_keys(pod):
    """A second request sharing the first 36 of 40 ids hits the 2 full blocks they fill (32 tokens: the
    header, the usage's cached_tokens and vllm:prefix_cache_hits agree); the completion whose prompt is
    the same ids hits them too (the same engine prompt); a cache_salt keys blocks of its own."""
    ids = fresh_ids(40)
    hits = metric(pod, "vllm:prefix_cache_hits_total")
    first = post(pod, {"token_ids": ids, "sampling_params": {"max_tokens": 1}})
    assert first.headers["x-sim-cached-tokens"] == "0" and first.json()["usage"] == details(40, 1, 0)
    second = post(pod, {"token_ids": ids[:36] + fresh_ids(4), "sampling_params": {"max_tokens": 1}})
    assert second.headers["x-sim-cached-tokens"] == "32", second.text
    assert second.json()["usage"] == details(40, 1, 32)
    assert metric(pod, "vllm:prefix_cache_hits_total") == hits + 32
    completion = httpx.post(pod + "/v1/completions", json={"prompt": ids, "max_tokens": 1}, timeout=30)
    assert completion.headers["x-sim-cached-tokens"] == "32", completion.text
    salted = post(pod, {"token_ids": ids, "sampling_params": {"max_tokens": 1}, "cache_salt": "tenant-a"})
    assert salted.headers["x-sim-cached-tokens"] == "0", salted.text


@pytest.mark.e2e
def test_faults_apply_as_on_the_other_routes(pod):
    done = metric(pod, "vllm:request_success_total")
    r = post(pod, {"token_ids": fresh_ids(5), "sampling_params": {"max_tokens": 4}},
             headers={"x-sim-fault": "status=503", "x-request-id": "f1"})
    assert r.status_code == 503 and r.headers["x-request-id"] == "f1"
    assert r.json()["error"]["message"] == "simulated fault: status 503"
    assert metric(pod, "vllm:request_success_total") == done   # nothing ran
    r = post(pod, {"token_ids": fresh_ids(5), "sampling_params": {"max_tokens": 10}}, headers={"x-sim-fault": "eos=3"})
    [choice] = r.json()["choices"]
    assert (choice["finish_reason"], len(choice["token_ids"])) == ("stop", 3), r.text
    started = time.monotonic()
    r = post(pod, {"token_ids": fresh_ids(5), "sampling_params": {"max_tokens": 1}},
             headers={"x-sim-fault": "delay=0.4"})
    assert r.status_code == 200 and time.monotonic() - started >= 0.4
    with pytest.raises(httpx.HTTPError):   # the whole answer cut halfway
        post(pod, {"token_ids": fresh_ids(5), "sampling_params": {"max_tokens": 1}}, headers={"x-sim-fault": "drop=1"})
    with pytest.raises(httpx.HTTPError):   # the stream cut after its first chunk
        post(pod, {"token_ids": fresh_ids(5), "sampling_params": {"max_tokens": 4}, "stream": True},
             headers={"x-sim-fault": "drop=1"})
