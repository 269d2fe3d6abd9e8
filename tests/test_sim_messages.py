"""The simulated pod's Anthropic Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``),
checked against what vLLM 0.32's CPU engine answered on a tiny model (its field sets and order, event
order and timing, error bodies), driven with plain httpx (no anthropic SDK here)."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import pytest

from indexer.messages import chat_body
from indexer.tokens import chat_request_ids, load_tokenizer
from simulator.testing import consecutive_free_ports
from tests.helpers import kvroute_process, sse_events

MAX_MODEL_LEN = 4096
BLOCK = 16
USER = [{"role": "user", "content": "Hello there, tell me a story."}]

# vLLM 0.32's fields, in its order: a whole answer (model_dump(exclude_none=True)), each stream event
MESSAGE_FIELDS = ["id", "type", "role", "content", "model", "stop_reason", "usage"]
EVENT_FIELDS = {
    "message_start": ["type", "message"],
    "content_block_start": ["type", "content_block", "index"],
    "content_block_delta": ["type", "delta", "index"],
    "content_block_stop": ["type", "index"],
    "message_delta": ["type", "delta", "usage"],
    "message_stop": ["type"],
}
ID = re.compile(r"chatcmpl-[0-9a-f]{16}")   # vLLM's random_uuid: 16 hex digits


def render(body: dict, count_tokens: bool = False) -> list[int]:
    """The prompt vLLM renders for the Messages body with the byte tokenizer, with the choices its
    template probes give (inline system messages kept, a disabled thinking effort "low")."""
    return chat_request_ids(chat_body(body, merge_inline_system=False, disabled_thinking_effort="low",
                                      count_tokens=count_tokens), load_tokenizer("byte"))


def prompt_len(body: dict) -> int:
    return len(render(body))



def validation(loc: str, error: str) -> dict:
    """vLLM's OpenAI-shaped body for a request its pydantic model refuses."""
    return {"error": {"message": f"1 validation error:\n  {error}", "type": "Bad Request", "param": loc, "code": 400}}


def anthropic_error(err_type: str, message: str) -> dict:
    return {"type": "error", "error": {"type": err_type, "message": message}}


def start_pod(*extra: str):
    port = consecutive_free_ports(1)
    return port, kvroute_process(["sim", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), *extra],
                                 ready_url=f"http://127.0.0.1:{port}/health")


@pytest.fixture(scope="module")
def plain():
    """A pod with vLLM's default flags (no prompt-token details)."""
    port, proc = start_pod()
    with proc:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def details():
    """A pod with --enable-prompt-tokens-details: usage splits the prompt into cache reads and writes."""
    port, proc = start_pod("--enable-prompt-tokens-details")
    with proc:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def slow():
    """A slow prefill (seed timing, 2000 prompt tokens/s): a 1000-token prompt's first token ~0.5 s out."""
    port, proc = start_pod("--timing", "seed", "--prefill-tokens-per-s", "2000", "--decode-s-per-token", "0.001")
    with proc:
        yield f"http://127.0.0.1:{port}"


def post(base: str, body: object, path: str = "/v1/messages", **kw) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=10, **kw)


@pytest.mark.e2e
def test_a_whole_answer_has_vllms_fields_and_usage(plain):
    body = {"model": "sim-model", "max_tokens": 5, "messages": USER}
    r = post(plain, body)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    msg = r.json()
    assert list(msg) == MESSAGE_FIELDS   # no stop_sequence: vLLM drops it when null
    assert ID.fullmatch(msg["id"]), msg["id"]
    assert r.headers["x-request-id"] == msg["id"][len("chatcmpl-"):]
    assert msg["type"] == "message" and msg["role"] == "assistant" and msg["model"] == "sim-model"
    text = msg["content"][0]["text"]
    assert msg["content"] == [{"type": "text", "text": text}] and len(text) == 5   # byte tokenizer
    assert msg["stop_reason"] == "max_tokens"
    # without --enable-prompt-tokens-details: the whole prompt, no cache fields
    assert msg["usage"] == {"input_tokens": prompt_len(body), "output_tokens": 5}

    # the client's X-Request-Id names the message, as vLLM's chat layer does
    r = post(plain, body, headers={"x-request-id": "trace-7"})
    assert r.json()["id"] == "chatcmpl-trace-7" and r.headers["x-request-id"] == "trace-7"


@pytest.mark.e2e
def test_the_prompt_is_the_chat_bodys_rendering(plain):
    """system blocks, tools, an assistant turn with tool use and a user's tool result: the pod renders
    what ``indexer.messages.chat_body`` makes of them (vLLM's conversion)."""
    body: dict[str, Any] = {"model": "sim-model", "max_tokens": 2, "system": [{"type": "text", "text": "Be terse."}],
            "tools": [{"name": "get_weather", "description": "weather", "input_schema": {"properties": {}}}],
            "messages": [{"role": "user", "content": "weather in Paris?"},
                         {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                            "input": {"city": "Paris"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                       "content": "sunny"}, {"type": "text", "text": "and?"}]}]}
    r = post(plain, body)
    assert r.status_code == 200, r.text
    first_turn = {**body, "messages": body["messages"][:1]}
    assert r.json()["usage"]["input_tokens"] == prompt_len(body) > prompt_len(first_turn)


@pytest.mark.e2e
def test_usage_with_prompt_token_details_splits_reads_and_writes(details):
    """vLLM's _build_anthropic_usage: input_tokens is the prompt less its cache reads and writes."""
    first_body = {"model": "sim-model", "max_tokens": 3, "system": "You are a storyteller. " * 4, "messages": USER}
    first = post(details, first_body)
    n = prompt_len(first_body)
    written = n // BLOCK * BLOCK
    hits = int(first.headers["x-sim-cached-tokens"])
    assert hits == 0, "a fresh pod"
    assert first.json()["usage"] == {"input_tokens": n - written, "output_tokens": 3,
                                     "cache_creation_input_tokens": written, "cache_read_input_tokens": 0}
    # the next turn shares the first's prompt up to its generation prompt: those full blocks are reads
    second_body = {**first_body, "messages": USER + [{"role": "assistant", "content": first.json()["content"]},
                                                     {"role": "user", "content": "Go on."}]}
    second = post(details, second_body)
    use = second.json()["usage"]
    m = prompt_len(second_body)
    assert use["cache_read_input_tokens"] == int(second.headers["x-sim-cached-tokens"]) >= (n - 1) // BLOCK * BLOCK > 0
    assert use["cache_creation_input_tokens"] == m // BLOCK * BLOCK - use["cache_read_input_tokens"]
    assert use["input_tokens"] + use["cache_read_input_tokens"] + use["cache_creation_input_tokens"] == m

    # a tenant's cache_salt keys its own blocks: no reads of the unsalted prompt
    salted = post(details, {**first_body, "cache_salt": "tenant-a"}).json()["usage"]
    assert salted["cache_read_input_tokens"] == 0 and salted["cache_creation_input_tokens"] == written
    again = post(details, first_body).json()["usage"]
    assert again["cache_read_input_tokens"] == written and again["cache_creation_input_tokens"] == 0


@pytest.mark.e2e
def test_a_stream_has_vllms_events_in_order(details):
    body = {"model": "sim-model", "max_tokens": 6, "messages": USER, "stream": True}
    with httpx.stream("POST", details + "/v1/messages", json=body, timeout=10,
                      headers={"x-request-id": "s-1"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        raw = r.read().decode()
    assert "[DONE]" not in raw and "ping" not in raw and raw.endswith("\n\n")
    events = sse_events(raw)
    names = [n for n, _ in events]
    assert names == ["message_start", "content_block_start"] + ["content_block_delta"] * 6 + [
        "content_block_stop", "message_delta", "message_stop"]
    for name, data in events:
        assert data["type"] == name and list(data) == EVENT_FIELDS[name], (name, data)
    n = prompt_len(body)
    # message_start's usage is the chat role chunk's: the whole prompt, no cache fields
    assert events[0][1]["message"] == {"id": "chatcmpl-s-1", "type": "message", "role": "assistant", "content": [],
                                       "model": "sim-model", "stop_reason": None, "stop_sequence": None,
                                       "usage": {"input_tokens": n, "output_tokens": 0}}
    assert events[1][1] == {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0}
    deltas = [d["delta"] for name, d in events if name == "content_block_delta"]
    assert all(set(d) == {"type", "text"} and d["type"] == "text_delta" for d in deltas)
    assert len("".join(d["text"] for d in deltas)) == 6
    assert events[-3][1] == {"type": "content_block_stop", "index": 0}
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    use = delta["usage"]
    assert list(use) == ["input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"]
    assert use["output_tokens"] == 6
    assert use["input_tokens"] + use["cache_creation_input_tokens"] + use["cache_read_input_tokens"] == n


@pytest.mark.e2e
def test_message_start_goes_out_with_the_first_token_not_before(slow):
    """vLLM 0.32 makes message_start from the chat stream's role chunk, which it sends with the first
    output: on the tiny CPU model the headers came at ~10 ms and message_start only after the prefill
    (~160 ms for 3560 tokens), 0.1-5 ms before the first text delta. Here the prompt takes ~0.5 s to
    prefill: the headers come at once, message_start with the first token. (The Responses API's
    response.created, by contrast, goes out before the prefill: tests/test_sim_responses.py.)"""
    body = {"model": "sim-model", "max_tokens": 2, "stream": True,
            "messages": [{"role": "user", "content": "y" * 1000}]}
    arrivals: list[tuple[float, str]] = []
    start = time.monotonic()
    with httpx.stream("POST", slow + "/v1/messages", json=body, timeout=10) as r:
        headers_at = time.monotonic() - start
        for line in r.iter_lines():
            if line.startswith("event: "):
                arrivals.append((time.monotonic() - start, line[len("event: "):]))
    names = [n for _, n in arrivals]
    assert names[:3] == ["message_start", "content_block_start", "content_block_delta"], names
    assert arrivals[0][0] - headers_at > 0.3, (headers_at, arrivals)   # after the prefill
    assert arrivals[2][0] - arrivals[0][0] < 0.1, arrivals             # with the first token


@pytest.mark.e2e
def test_count_tokens_is_the_generations_input(plain):
    bodies: list[dict[str, Any]] = [
        {"model": "sim-model", "messages": USER},
        {"model": "sim-model", "messages": USER, "system": "Be terse."},
        {"model": "sim-model", "messages": USER, "thinking": {"type": "disabled"}},
        {"model": "sim-model", "messages": USER + [{"role": "system", "content": "inline"}],
         "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"}},
    ]
    for body in bodies:
        r = post(plain, body, "/v1/messages/count_tokens")
        assert r.status_code == 200, r.text
        n = len(render(body, count_tokens=True))
        assert r.json() == {"input_tokens": n, "context_management": {"original_input_tokens": n}}
        whole = post(plain, {**body, "max_tokens": 1}).json()
        assert whole["usage"]["input_tokens"] == n, body
    # fields of a Messages request that count_tokens does not take are ignored, as pydantic does
    r = post(plain, {**bodies[0], "max_tokens": 5, "stream": True, "stop_sequences": "not a list"},
             "/v1/messages/count_tokens")
    assert r.json()["input_tokens"] == post(plain, bodies[0], "/v1/messages/count_tokens").json()["input_tokens"]


TOO_LONG = ("This model's maximum context length is 4096 tokens. However, your prompt contains at least 4097 input "
            "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
            "prompt. (parameter=input_tokens, value=4097)")


@pytest.mark.e2e
@pytest.mark.parametrize("body,status,expected", [
    # vLLM's request validation: OpenAI-shaped, "Bad Request" (bytes as vLLM 0.32 answered)
    ({"model": "sim-model", "messages": USER}, 400, validation(
        "body.max_tokens", "{'type': 'missing', 'loc': 'body.max_tokens', 'msg': 'Field required', "
                           "'input': '<dict of 2 items>'}")),
    ({"model": "sim-model", "messages": USER, "max_tokens": 0}, 400, validation(
        "body.max_tokens", "{'type': 'value_error', 'loc': 'body.max_tokens', 'msg': 'Value error, max_tokens must "
                           "be positive', 'input': '0', 'ctx': {'error': ValueError('max_tokens must be positive')}}")),
    ({"model": "sim-model", "messages": USER, "max_tokens": "x"}, 400, validation(
        "body.max_tokens", "{'type': 'int_parsing', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid "
                           "integer, unable to parse string as an integer', 'input': 'x'}")),
    ({"messages": USER, "max_tokens": 4}, 400, validation(
        "body.model", "{'type': 'missing', 'loc': 'body.model', 'msg': 'Field required', "
                      "'input': '<dict of 2 items>'}")),
    ({"model": "", "messages": USER, "max_tokens": 4}, 400, validation(
        "body.model", "{'type': 'value_error', 'loc': 'body.model', 'msg': 'Value error, Model is required', "
                      "'input': '', 'ctx': {'error': ValueError('Model is required')}}")),
    ({"model": "sim-model", "messages": [{"role": "tool", "content": "x"}], "max_tokens": 4}, 400, validation(
        "body.messages.0.role", "{'type': 'literal_error', 'loc': 'body.messages.0.role', 'msg': \"Input should be "
                                "'user', 'assistant' or 'system'\", 'input': 'tool', "
                                "'ctx': {'expected': \"'user', 'assistant' or 'system'\"}}")),
    ({"model": "sim-model", "messages": USER, "max_tokens": 2000, "thinking": {"type": "enabled",
                                                                                "budget_tokens": 4000}}, 400,
     validation("body", "{'type': 'value_error', 'loc': 'body', 'msg': 'Value error, thinking.budget_tokens must "
                        "be less than max_tokens', 'input': '<dict of 4 items>', 'ctx': {'error': "
                        "ValueError('thinking.budget_tokens must be less than max_tokens')}}")),
    ({"model": "sim-model", "messages": USER, "max_tokens": 4, "cache_salt": ""}, 400, validation(
        "body.cache_salt", "{'type': 'string_too_short', 'loc': 'body.cache_salt', 'msg': 'String should have at "
                           "least 1 character', 'input': '', 'ctx': {'min_length': 1}}")),
    ([1, 2], 400, validation(
        "body", "{'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid dictionary or "
                "object to extract fields from', 'input': '<list of 2 items>'}")),
    # past the validation: Anthropic-shaped, with the real status
    ({"model": "nope", "messages": USER, "max_tokens": 4}, 404, anthropic_error(
        "NotFoundError", "The model `nope` does not exist. Valid aliases: sim-model.")),
    ({"model": "nope", "messages": USER, "max_tokens": 4, "stream": True}, 404, anthropic_error(
        "NotFoundError", "The model `nope` does not exist. Valid aliases: sim-model.")),
    ({"model": "nope", "messages": [], "max_tokens": 4}, 404, anthropic_error(
        "NotFoundError", "The model `nope` does not exist. Valid aliases: sim-model.")),
    ({"model": "sim-model", "messages": [], "max_tokens": 4}, 400, anthropic_error(
        "BadRequestError", "Cannot apply chat template to an empty conversation. Provide at least one message.")),
    ({"model": "sim-model", "messages": USER, "max_tokens": 100000}, 400, anthropic_error(
        "BadRequestError", "max_completion_tokens=100000 cannot be greater than max_model_len=4096. Please request "
                           "fewer output tokens. (parameter=max_completion_tokens, value=100000)")),
    ({"model": "sim-model", "messages": [{"role": "user", "content": "a" * 5000}], "max_tokens": 4}, 400,
     anthropic_error("BadRequestError", TOO_LONG)),
    ({"model": "sim-model", "max_tokens": 4, "messages": [
        {"role": "system", "content": [{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "zz"}}]},
        {"role": "user", "content": "hi"}]}, 400,
     anthropic_error("BadRequestError", "tool_addition references tool 'zz', which is not declared in tools")),
])
def test_errors_are_shaped_as_vllms(plain, body, status, expected):
    r = post(plain, body)
    assert r.status_code == status and r.json() == expected, r.text
    assert r.headers["content-type"] == "application/json"


@pytest.mark.e2e
def test_count_tokens_errors(plain):
    r = post(plain, {"model": "nope", "messages": USER}, "/v1/messages/count_tokens")
    assert r.status_code == 404 and r.json() == anthropic_error(
        "NotFoundError", "The model `nope` does not exist. Valid aliases: sim-model.")
    r = post(plain, {"model": "sim-model"}, "/v1/messages/count_tokens")
    assert r.status_code == 400 and r.json() == validation(
        "body.messages", "{'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', "
                         "'input': '<dict of 1 items>'}")
    r = post(plain, {"model": "sim-model", "messages": []}, "/v1/messages/count_tokens")
    assert r.status_code == 400 and r.json() == anthropic_error(
        "BadRequestError", "Cannot apply chat template to an empty conversation. Provide at least one message.")
    r = post(plain, {"model": "nope", "messages": []}, "/v1/messages/count_tokens")   # the model is checked first
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = post(plain, {"model": "sim-model", "messages": [{"role": "user", "content": "a" * 5000}]},
             "/v1/messages/count_tokens")
    assert r.status_code == 400 and r.json() == anthropic_error("BadRequestError", TOO_LONG)
    r = httpx.post(plain + "/v1/messages/count_tokens", content=b"{bad", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.1"
    # only POST
    assert httpx.get(plain + "/v1/messages", timeout=10).status_code == 405
    assert httpx.get(plain + "/v1/messages/count_tokens", timeout=10).status_code == 405


@pytest.mark.e2e
def test_faults_and_metrics_work_as_for_chat(plain):
    body = {"model": "sim-model", "max_tokens": 4, "messages": USER}
    r = post(plain, body, headers={"x-sim-fault": "status=503", "x-request-id": "f1"})
    assert r.status_code == 503 and r.headers["x-request-id"] == "f1"
    assert r.json() == anthropic_error("ServiceUnavailableError", "simulated fault: status 503")
    # the model samples EOS after 2 tokens: an end_turn, whole or streamed
    r = post(plain, {**body, "max_tokens": 8}, headers={"x-sim-fault": "eos=2"})
    assert r.json()["stop_reason"] == "end_turn" and r.json()["usage"]["output_tokens"] == 2
    with httpx.stream("POST", plain + "/v1/messages", json={**body, "max_tokens": 8, "stream": True}, timeout=10,
                      headers={"x-sim-fault": "eos=2"}) as s:
        events = sse_events(s.read().decode())
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn" and events[-2][1]["usage"]["output_tokens"] == 2
    before = httpx.get(plain + "/metrics", timeout=10).text
    seen = re.search(r'^kvsim_faults_injected_total\{kind="drop"\} (\S+)$', before, re.M)
    drops = float(seen.group(1)) if seen else 0.0
    with pytest.raises(httpx.HTTPError):   # the connection is cut after two events
        with httpx.stream("POST", plain + "/v1/messages", json={**body, "stream": True}, timeout=10,
                          headers={"x-sim-fault": "drop=2"}) as s:
            s.read()
    with pytest.raises(httpx.HTTPError):
        post(plain, body, headers={"x-sim-fault": "drop=1"})
    metrics = httpx.get(plain + "/metrics", timeout=10).text
    assert re.search(rf'^kvsim_faults_injected_total\{{kind="drop"\}} {drops + 2:.1f}$', metrics, re.M), metrics


@pytest.mark.e2e
def test_a_client_that_leaves_mid_stream_frees_the_engine(slow):
    body = {"model": "sim-model", "max_tokens": 2000, "stream": True, "messages": USER}
    with httpx.stream("POST", slow + "/v1/messages", json=body, timeout=10) as r:
        for line in r.iter_lines():
            if line.startswith("event: content_block_delta"):
                break
    state = {}
    for _ in range(100):   # bounded: 5 s
        state = httpx.get(slow + "/sim/state", timeout=10).json()
        if state["running"] == 0 and state["waiting"] == 0:
            break
        time.sleep(0.05)
    assert state["running"] == 0 and state["waiting"] == 0, state


@pytest.mark.e2e
def test_a_data_parallel_pod_routes_messages_by_rank():
    port, proc = start_pod("--data-parallel-size", "2")
    with proc:
        base = f"http://127.0.0.1:{port}"
        body = {"model": "sim-model", "max_tokens": 2, "messages": USER}
        for rank in (0, 1):
            r = post(base, body, headers={"x-data-parallel-rank": str(rank)})
            assert r.status_code == 200, r.text
            # each engine has its own cache: the first request on each rank reads nothing
            assert r.headers["x-sim-cached-tokens"] == "0"
        r = post(base, body, headers={"x-data-parallel-rank": "2"})
        assert r.status_code == 400 and r.json()["type"] == "error" and "out of range" in r.json()["error"]["message"]


def test_the_pods_template_choices_are_vllms_probes():
    """What the pod decides once from its template, as vLLM does at start-up: the byte tokenizer's
    template keeps inline system messages and ignores reasoning_effort (so "none" is no use and a
    disabled thinking is effort "low"); a tokenizer with no resolvable template gets vLLM's defaults."""
    from simulator.server import anthropic_template_choices

    assert anthropic_template_choices(load_tokenizer("byte")) == (False, "low")

    class Bare:
        def encode(self, text, add_special_tokens=True):
            return [1]

    assert anthropic_template_choices(Bare()) == (False, "none")  # type: ignore[arg-type]


@pytest.mark.e2e
def test_a_pod_probes_its_template_for_inline_system_and_disabled_thinking(tmp_path):
    """A template that refuses a system message after the first gets every inline system message
    appended to the leading one (merge_inline_system); one that renders reasoning_effort "none"
    differently from the real efforts gets "none" for a disabled thinking."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<s>", "</s>", "user", "system", "assistant", "hello", "world", "rules", "more", "nothink"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
                         "{{ raise_exception('system messages must come first') }}{% endif %}"
                         "{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}assistant {% endif %}"
                         "{% if reasoning_effort is defined and reasoning_effort == 'none' %}nothink {% endif %}"}))
    body = {"model": "sim-model", "system": "rules ",
            "messages": [{"role": "user", "content": "hello"}, {"role": "system", "content": "more"},
                         {"role": "user", "content": "world"}]}
    tokenizer = load_tokenizer(str(tmp_path / "tokenizer.json"))
    merged = chat_request_ids(chat_body(body, merge_inline_system=True, count_tokens=True), tokenizer)
    assert len(merged) == 8   # system "rules more", user hello, user world, assistant
    with pytest.raises(Exception, match="system messages must come first"):   # kept in place, it fails
        chat_request_ids(chat_body(body, count_tokens=True), tokenizer)
    port = consecutive_free_ports(1)
    with kvroute_process(["sim", "--port", str(port), "--tokenizer", str(tmp_path / "tokenizer.json")],
                         ready_url=f"http://127.0.0.1:{port}/health"):
        base = f"http://127.0.0.1:{port}"
        r = post(base, body, "/v1/messages/count_tokens")
        assert r.status_code == 200 and r.json()["input_tokens"] == len(merged), r.text
        r = post(base, {**body, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["input_tokens"] == len(merged), r.text
        # thinking disabled: effort "none", which this template renders as one more word
        r = post(base, {**body, "thinking": {"type": "disabled"}}, "/v1/messages/count_tokens")
        assert r.status_code == 200 and r.json()["input_tokens"] == len(merged) + 1, r.text


@pytest.mark.e2e
def test_a_prefill_leg_answers_kv_transfer_params(plain):
    """A P/D prefill leg (``do_remote_decode``, max_tokens 1): the answer carries the blocks to read, and
    vLLM skips its thinking-budget check for it (the decode leg carries the client's max_tokens)."""
    body = {"model": "sim-model", "max_tokens": 1, "messages": USER, "kv_transfer_params": {"do_remote_decode": True},
            "thinking": {"type": "enabled", "budget_tokens": 2048}}
    r = post(plain, body)
    assert r.status_code == 200, r.text
    msg = r.json()
    assert list(msg) == MESSAGE_FIELDS + ["kv_transfer_params"]
    kv = msg["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["remote_num_tokens"] == msg["usage"]["input_tokens"]
    assert kv["remote_request_id"].startswith(msg["id"])
    # the same body as a plain request is refused by the budget check
    r = post(plain, {**body, "kv_transfer_params": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body", r.text
