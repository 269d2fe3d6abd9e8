"""The simulated pod's Responses API (``POST /v1/responses``, ``GET /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel``), checked against what vLLM 0.32's CPU engine answered (its
field sets, event order and error bodies, measured on a tiny model), driven with the official
openai SDK and plain httpx."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from indexer.responses import chat_body
from indexer.tokens import chat_request_ids, load_tokenizer
from simulator.testing import consecutive_free_ports
from tests.helpers import kvroute_process, sse_events

MAX_MODEL_LEN = 4096
BLOCK = 16

# the fields of vLLM 0.32's answers, in its order (a non-streamed body; its output item and part; usage)
RESPONSE_FIELDS = ["id", "created_at", "incomplete_details", "instructions", "metadata", "model", "object", "output",
                   "parallel_tool_calls", "temperature", "tool_choice", "tools", "top_p", "background",
                   "max_output_tokens", "max_tool_calls", "previous_response_id", "prompt", "reasoning",
                   "service_tier", "status", "text", "top_logprobs", "truncation", "usage", "user", "presence_penalty",
                   "frequency_penalty", "kv_transfer_params", "ec_transfer_params", "input_messages", "output_messages"]
ITEM_FIELDS = ["id", "content", "role", "status", "type", "phase"]
PART = {"annotations": [], "type": "output_text", "logprobs": None}
USAGE_DETAILS = {"input_tokens_per_turn": [], "cached_tokens_per_turn": []}
OUTPUT_DETAILS = {"reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
                  "tool_output_tokens_per_turn": []}
# each stream event's field names, as vLLM 0.32 sent them
EVENT_FIELDS = {
    "response.created": ["response", "sequence_number", "type"],
    "response.in_progress": ["response", "sequence_number", "type"],
    "response.output_item.added": ["item", "output_index", "sequence_number", "type"],
    "response.content_part.added": ["content_index", "item_id", "output_index", "part", "sequence_number", "type"],
    "response.output_text.delta": ["content_index", "delta", "item_id", "logprobs", "output_index", "sequence_number",
                                   "type"],
    "response.output_text.done": ["content_index", "item_id", "logprobs", "output_index", "sequence_number", "text",
                                  "type"],
    "response.content_part.done": ["content_index", "item_id", "output_index", "part", "sequence_number", "type"],
    "response.output_item.done": ["item", "output_index", "sequence_number", "type"],
    "response.completed": ["response", "sequence_number", "type"],
}
NOT_FOUND = {"error": {"message": "Response with id '{}' not found.", "type": "invalid_request_error",
                       "param": "response_id", "code": 404}}
HEX16 = re.compile(r"[0-9a-f]{16}")


def not_found(rid: str) -> dict:
    return {"error": {**NOT_FOUND["error"], "message": NOT_FOUND["error"]["message"].format(rid)}}


def prompt_len(body: dict) -> int:
    """The prompt tokens vLLM renders for the Responses body (the byte tokenizer: no BOS to add)."""
    return len(chat_request_ids(chat_body(body), load_tokenizer("byte")))



@pytest.fixture(scope="module")
def plain():
    """A pod as vLLM starts by default: no Responses store."""
    port = consecutive_free_ports(1)
    with kvroute_process(["sim", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN)],
                         ready_url=f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def stored():
    """A pod with the store (vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1), a store of three responses, and a
    slow prefill (seed timing, 2000 prompt tokens/s) so a stream's first token comes well after its start."""
    port = consecutive_free_ports(1)
    with kvroute_process(["sim", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), "--responses-store",
                          "--responses-store-size", "3", "--timing", "seed", "--prefill-tokens-per-s", "2000",
                          "--decode-s-per-token", "0.001"], ready_url=f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=10)


@pytest.mark.e2e
def test_a_whole_answer_has_vllms_fields_text_and_usage(plain):
    c = client(plain)
    r = c.responses.create(model="sim-model", input="The capital of France is", max_output_tokens=5)
    assert re.fullmatch(r"resp_[0-9a-f]{16}", r.id), r.id
    assert r.object == "response" and r.model == "sim-model"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == prompt_len({"input": "The capital of France is"})
    assert r.usage.output_tokens == 5 and r.usage.total_tokens == r.usage.input_tokens + 5
    assert len(r.output_text) == 5   # the byte tokenizer: one character per token
    assert r.max_output_tokens == 5 and r.output[0].id.startswith("msg_")

    raw = httpx.post(plain + "/v1/responses", json={"input": "hello", "max_output_tokens": 3}, timeout=10)
    assert raw.status_code == 200 and raw.headers["content-type"] == "application/json"
    body = raw.json()
    assert list(body) == RESPONSE_FIELDS
    item = body["output"][0]
    assert list(item) == ITEM_FIELDS and item["status"] == "completed" and item["role"] == "assistant"
    assert HEX16.fullmatch(item["id"][len("msg_"):]), item["id"]
    assert item["content"] == [{"annotations": [], "text": item["content"][0]["text"], "type": "output_text",
                                "logprobs": None}]
    n = prompt_len({"input": "hello"})
    hits = int(raw.headers["x-sim-cached-tokens"])   # the chat template's first block, from the first request
    assert hits == BLOCK
    assert body["usage"] == {"input_tokens": n, "input_tokens_details": {
        "cached_tokens": hits, "cache_write_tokens": n // BLOCK * BLOCK - hits, **USAGE_DETAILS},
        "output_tokens": 3, "output_tokens_details": OUTPUT_DETAILS, "total_tokens": n + 3}
    # what vLLM echoes of a request that sets nothing else
    assert {k: body[k] for k in ("instructions", "metadata", "parallel_tool_calls", "temperature", "tool_choice",
                                 "tools", "top_p", "background", "previous_response_id", "service_tier", "text",
                                 "top_logprobs", "truncation", "user", "presence_penalty", "frequency_penalty",
                                 "kv_transfer_params")} == {
        "instructions": None, "metadata": None, "parallel_tool_calls": True, "temperature": 1.0,
        "tool_choice": "none", "tools": [], "top_p": 1.0, "background": False, "previous_response_id": None,
        "service_tier": "auto", "text": None, "top_logprobs": None, "truncation": "disabled", "user": None,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "kv_transfer_params": None}
    assert float(raw.headers["x-sim-prefill-compute-s"]) >= 0
    # the same prompt again: its full blocks are hits, and nothing new is written
    again = httpx.post(plain + "/v1/responses", json={"input": "hello", "max_output_tokens": 3}, timeout=10).json()
    assert again["usage"]["input_tokens_details"]["cached_tokens"] == n // BLOCK * BLOCK
    assert again["usage"]["input_tokens_details"]["cache_write_tokens"] == 0


@pytest.mark.e2e
def test_without_a_budget_the_model_stops_and_the_response_is_completed(plain):
    r = client(plain).responses.create(model="sim-model", input="tell me", temperature=0.5)
    assert r.status == "completed" and r.incomplete_details is None
    assert r.usage.output_tokens == 16   # the simulator's default stop
    assert r.temperature == 0.5
    # vLLM reports SamplingParams.max_tokens: what fits in the model's length
    assert r.max_output_tokens == MAX_MODEL_LEN - r.usage.input_tokens


@pytest.mark.e2e
def test_the_body_request_id_is_the_response_id_and_instructions_are_the_system_message(plain):
    body = {"input": "hi", "instructions": "Be brief.", "max_output_tokens": 2, "request_id": "resp_myown123"}
    r = httpx.post(plain + "/v1/responses", json=body, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "resp_myown123" and r.json()["instructions"] == "Be brief."
    assert r.headers["x-request-id"] == "resp_myown123"
    assert r.json()["usage"]["input_tokens"] == prompt_len(body) > prompt_len({"input": "hi"})
    # a client's x-request-id is echoed; vLLM keeps the body's id as the response's
    r = httpx.post(plain + "/v1/responses", json=body, headers={"x-request-id": "trace-7"}, timeout=10)
    assert r.headers["x-request-id"] == "trace-7" and r.json()["id"] == "resp_myown123"


@pytest.mark.e2e
def test_a_stream_has_vllms_events_in_order_numbered_from_zero(plain):
    c = client(plain)
    events = list(c.responses.create(model="sim-model", input="stream me", max_output_tokens=6, stream=True))
    types = [e.type for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * 6 + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and events[-4].text == text
    assert final.status == "incomplete" and final.usage.output_tokens == 6
    assert final.usage.input_tokens == prompt_len({"input": "stream me"})
    assert events[0].response.status == "in_progress" and events[0].response.usage is None
    assert events[0].response.output == [] and events[0].response.id == final.id

    with httpx.stream("POST", plain + "/v1/responses", json={"input": "x", "max_output_tokens": 2, "stream": True},
                      timeout=10) as r:
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        raw = r.read().decode()
    assert "[DONE]" not in raw and raw.endswith("\n\n")
    parsed = sse_events(raw)
    for name, data in parsed:
        assert data["type"] == name and list(data) == EVENT_FIELDS[name], (name, list(data))
    by = dict(parsed)
    item_id = by["response.output_item.added"]["item"]["id"]
    assert by["response.output_item.added"]["item"] == {"id": item_id, "content": [], "role": "assistant",
                                                        "status": "in_progress", "type": "message", "phase": None}
    assert by["response.content_part.added"]["part"] == {"annotations": [], "text": "", "type": "output_text",
                                                         "logprobs": []}
    done_text = by["response.output_text.done"]["text"]
    assert by["response.content_part.done"]["part"] == {**PART, "text": done_text}
    assert by["response.output_item.done"]["item"]["status"] == "completed"
    assert list(by["response.completed"]["response"]) == RESPONSE_FIELDS
    assert by["response.completed"]["response"]["output"] == [by["response.output_item.done"]["item"]]


@pytest.mark.e2e
def test_created_and_in_progress_go_out_before_the_engine_produces_anything(stored):
    """vLLM 0.32 sends both at once, ~35 ms before the first token on the tiny model: here the prompt
    takes ~0.5 s to prefill (seed timing, 2000 tokens/s), and they arrive long before the first token."""
    body = {"input": "y" * 1000, "max_output_tokens": 2, "stream": True, "store": False}
    arrivals: list[tuple[float, str]] = []
    start = time.monotonic()
    with httpx.stream("POST", stored + "/v1/responses", json=body, timeout=10) as r:
        for line in r.iter_lines():
            if line.startswith("event: "):
                arrivals.append((time.monotonic() - start, line[len("event: "):]))
    names = [n for _, n in arrivals]
    assert names[:3] == ["response.created", "response.in_progress", "response.output_item.added"], names
    assert arrivals[2][0] - arrivals[1][0] > 0.3, arrivals


@pytest.mark.e2e
def test_the_store_keeps_responses_for_retrieval_and_the_next_turn(stored):
    c = client(stored)
    first_body = {"input": "What is the capital of France? Answer in one word.", "instructions": "Be brief."}
    first = c.responses.create(model="sim-model", max_output_tokens=4, **first_body)
    got = c.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    raw = httpx.get(f"{stored}/v1/responses/{first.id}", timeout=10)
    assert raw.status_code == 200 and list(raw.json()) == RESPONSE_FIELDS

    # the next turn renders the stored conversation (its system message dropped), the previous output as
    # the assistant's, then the new instructions first and the new input: vLLM's construct_input_messages
    second = c.responses.create(model="sim-model", input="And of Spain?", instructions="Be brief.",
                                previous_response_id=first.id, max_output_tokens=3)
    assert second.previous_response_id == first.id
    expected = chat_body({"input": "And of Spain?", "instructions": "Be brief."})
    expected["messages"] = [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": first_body["input"]},
                            {"role": "assistant", "content": first.output_text},
                            {"role": "user", "content": "And of Spain?"}]
    assert second.usage.input_tokens == len(chat_request_ids(expected, load_tokenizer("byte")))
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # the first turn's prompt is the second's prefix up to its generation prompt: its full blocks are hits
    assert second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens // BLOCK * BLOCK > 0

    # a third turn chains on: the conversation of both earlier turns, no system message this time
    third = c.responses.create(model="sim-model", input="Thanks.", previous_response_id=second.id,
                               max_output_tokens=2, stream=True)
    final = [e for e in third if e.type == "response.completed"][0].response
    expected["messages"] = expected["messages"][1:] + [{"role": "assistant", "content": second.output_text},
                                                       {"role": "user", "content": "Thanks."}]
    assert final.usage.input_tokens == len(chat_request_ids(expected, load_tokenizer("byte")))
    assert c.responses.retrieve(final.id).output_text == final.output_text   # a stream is stored too

    # cancelling a finished (synchronous) response: vLLM's 400
    r = httpx.post(f"{stored}/v1/responses/{first.id}/cancel", timeout=10)
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "Cannot cancel a synchronous response.", "type": "invalid_request_error",
                                  "param": "response_id", "code": 400}}
    with pytest.raises(openai.BadRequestError):
        c.responses.cancel(first.id)


@pytest.mark.e2e
def test_the_store_is_bounded_and_store_false_keeps_nothing(stored):
    ids = [client(stored).responses.create(model="sim-model", input=f"turn {i}", max_output_tokens=1).id
           for i in range(4)]
    assert httpx.get(f"{stored}/v1/responses/{ids[0]}", timeout=10).status_code == 404   # the oldest went first
    assert all(httpx.get(f"{stored}/v1/responses/{i}", timeout=10).status_code == 200 for i in ids[1:])
    r = httpx.post(stored + "/v1/responses", json={"input": "x", "max_output_tokens": 1, "store": False}, timeout=10)
    rid = r.json()["id"]
    assert httpx.get(f"{stored}/v1/responses/{rid}", timeout=10).json() == not_found(rid)


@pytest.mark.e2e
@pytest.mark.parametrize("method,path", [("GET", "/v1/responses/resp_nope"),
                                         ("POST", "/v1/responses/resp_nope/cancel")])
def test_unknown_ids_are_vllms_404(stored, plain, method, path):
    for base in (stored, plain):
        r = httpx.request(method, base + path, timeout=10)
        assert r.status_code == 404 and r.json() == not_found("resp_nope"), r.text
    with pytest.raises(openai.NotFoundError):
        client(stored).responses.retrieve("resp_nope")


@pytest.mark.e2e
def test_without_the_store_nothing_is_kept_and_previous_response_id_is_unknown(plain):
    """vLLM without VLLM_ENABLE_RESPONSES_API_STORE ignores ``store: true`` silently."""
    first = httpx.post(plain + "/v1/responses", json={"input": "x", "max_output_tokens": 1, "store": True},
                       timeout=10)
    assert first.status_code == 200
    rid = first.json()["id"]
    assert httpx.get(f"{plain}/v1/responses/{rid}", timeout=10).json() == not_found(rid)
    r = httpx.post(plain + "/v1/responses", json={"input": "y", "previous_response_id": rid}, timeout=10)
    assert r.status_code == 404 and r.json() == not_found(rid)


@pytest.mark.e2e
def test_background_needs_the_store_and_store_true(plain, stored):
    r = httpx.post(plain + "/v1/responses", json={"input": "x", "background": True}, timeout=10)
    assert r.status_code == 400 and r.json() == {"error": {
        "message": "This vLLM engine does not support `store=True` and therefore does not support the background "
                   "mode. To enable these features, set the environment variable "
                   "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
        "type": "invalid_request_error", "param": "background", "code": 400}}
    # ResponsesRequest's own validator, before the serving code's check: the same 400 with or without the store
    for base in (stored, plain):
        r = httpx.post(base + "/v1/responses", json={"input": "x", "background": True, "store": False}, timeout=10)
        assert r.status_code == 400 and r.json() == {"error": {
            "message": "background can only be used when `store` is true (parameter=background)",
            "type": "BadRequestError", "param": "background", "code": 400}}, r.text


def wait_until_done(base: str, rid: str, timeout: float = 5.0) -> dict:
    """Poll ``GET /v1/responses/{rid}`` until it is no longer "queued"."""
    end = time.monotonic() + timeout
    while True:
        body = httpx.get(f"{base}/v1/responses/{rid}", timeout=10).json()
        if body["status"] != "queued" or time.monotonic() > end:
            return body
        time.sleep(0.02)


def engine_busy(base: str) -> int:
    state = httpx.get(base + "/sim/state", timeout=10).json()
    return state["running"] + state["waiting"]


@pytest.mark.e2e
def test_a_background_response_is_answered_queued_at_once_and_stored_finished(stored):
    """vLLM 0.32 answers at once with the response "queued" (no output, no usage) and keeps it so in
    its store until the run ends ("in_progress" is never stored); then GET has the finished response.
    Here the prompt takes ~0.5 s to prefill (seed timing, 2000 tokens/s)."""
    body = {"input": "z" * 1000, "max_output_tokens": 4, "background": True}
    start = time.monotonic()
    r = httpx.post(stored + "/v1/responses", json=body, timeout=10)
    took = time.monotonic() - start
    assert r.status_code == 200 and took < 0.3, (r.text, took)
    queued = r.json()
    assert list(queued) == RESPONSE_FIELDS
    assert queued["status"] == "queued" and queued["output"] == [] and queued["usage"] is None
    assert queued["background"] is True and queued["incomplete_details"] is None
    rid = queued["id"]
    assert httpx.get(f"{stored}/v1/responses/{rid}", timeout=10).json() == queued   # stored as answered
    assert engine_busy(stored) == 1   # the run goes on without its client

    done = wait_until_done(stored, rid)
    assert time.monotonic() - start > 0.4   # the prefill's time
    assert done["status"] == "incomplete" and done["incomplete_details"] == {"reason": "max_output_tokens"}
    n = prompt_len(body)
    hits = done["usage"]["input_tokens_details"]["cached_tokens"]
    assert hits in (0, BLOCK)   # the chat template's first block, if an earlier request wrote it
    assert done["usage"] == {"input_tokens": n, "input_tokens_details": {
        "cached_tokens": hits, "cache_write_tokens": n // BLOCK * BLOCK - hits, **USAGE_DETAILS},
        "output_tokens": 4, "output_tokens_details": OUTPUT_DETAILS, "total_tokens": n + 4}
    assert len(done["output"][0]["content"][0]["text"]) == 4
    assert done["created_at"] == queued["created_at"] and done["id"] == rid and done["background"] is True
    assert engine_busy(stored) == 0
    # its blocks are cached: the same prompt again hits all its full blocks
    again = client(stored).responses.create(model="sim-model", input=body["input"], max_output_tokens=1)
    assert again.usage.input_tokens_details.cached_tokens == n // BLOCK * BLOCK


@pytest.mark.e2e
def test_cancelling_a_running_background_response_aborts_it(stored):
    c = client(stored)
    body = {"input": "w" * 1000, "max_output_tokens": 1000, "background": True, "request_id": "resp_tocancel"}
    queued = httpx.post(stored + "/v1/responses", json=body, timeout=10).json()
    assert queued["status"] == "queued" and engine_busy(stored) == 1
    r = httpx.post(f"{stored}/v1/responses/resp_tocancel/cancel", timeout=10)
    assert r.status_code == 200 and r.json() == {**queued, "status": "cancelled"}   # vLLM's: the queued one, cancelled
    assert engine_busy(stored) == 0   # its engine request is aborted (it had ~1.5 s to go)
    assert httpx.get(f"{stored}/v1/responses/resp_tocancel", timeout=10).json()["status"] == "cancelled"
    r = httpx.post(f"{stored}/v1/responses/resp_tocancel/cancel", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"] == "Cannot cancel a synchronous response."

    # the next turn on it has its conversation but no output of it: vLLM renders none
    second = c.responses.create(model="sim-model", input="Go on.", previous_response_id="resp_tocancel",
                                max_output_tokens=1)
    expected = chat_body({"input": "Go on."})
    expected["messages"] = [{"role": "user", "content": body["input"]}, {"role": "user", "content": "Go on."}]
    assert second.usage.input_tokens == len(chat_request_ids(expected, load_tokenizer("byte")))
    # vLLM stores nothing over a cancelled response, even a new one reusing its id
    r = httpx.post(stored + "/v1/responses", json={"input": "x", "max_output_tokens": 1, "request_id": "resp_tocancel"},
                   timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "incomplete"
    assert httpx.get(f"{stored}/v1/responses/resp_tocancel", timeout=10).json()["status"] == "cancelled"

    # a streamed one too; its events end where it was cancelled (vLLM's stream there stays open, silent)
    body = {"input": "t" * 1000, "max_output_tokens": 1000, "background": True, "stream": True,
            "request_id": "resp_streamcancel"}
    with httpx.stream("POST", stored + "/v1/responses", json=body, timeout=10) as s:
        first_line = next(s.iter_lines())
    assert first_line == "event: response.created"
    r = httpx.post(f"{stored}/v1/responses/resp_streamcancel/cancel", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "cancelled" and engine_busy(stored) == 0
    replay = httpx.get(f"{stored}/v1/responses/resp_streamcancel?stream=true", timeout=10)
    assert [name for name, _ in sse_events(replay.text)] == ["response.created", "response.in_progress"]


@pytest.mark.e2e
def test_a_background_stream_runs_on_and_get_replays_its_events(stored):
    """The POST's stream is the run's events as they come; the run goes on when its client leaves, and
    ``GET ...?stream=true`` replays them all, or those after ``starting_after`` (negative: vLLM's deque
    indexing from the end), through ``response.completed``."""
    body = {"input": "v" * 1000, "max_output_tokens": 5, "background": True, "stream": True,
            "request_id": "resp_bgstream"}
    with httpx.stream("POST", stored + "/v1/responses", json=body, timeout=10) as s:
        assert s.status_code == 200 and s.headers["content-type"] == "text/event-stream; charset=utf-8"
        first_line = next(s.iter_lines())
    assert first_line == "event: response.created"    # and the client leaves during the prefill
    assert httpx.get(f"{stored}/v1/responses/resp_bgstream", timeout=10).json()["status"] == "queued"

    with httpx.stream("GET", f"{stored}/v1/responses/resp_bgstream?stream=true&starting_after=0", timeout=10) as s:
        assert s.headers["content-type"] == "text/event-stream; charset=utf-8"
        rest = sse_events(s.read().decode())
    assert [e["sequence_number"] for _, e in rest] == list(range(1, 13))
    assert [name for name, _ in rest] == ["response.in_progress", "response.output_item.added",
                                          "response.content_part.added"] + ["response.output_text.delta"] * 5 + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    final = rest[-1][1]["response"]
    assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 5
    assert final["usage"]["input_tokens"] == prompt_len(body)
    assert rest[0][1]["response"]["status"] == "in_progress" and rest[0][1]["response"]["background"] is True
    stored_now = httpx.get(f"{stored}/v1/responses/resp_bgstream", timeout=10).json()
    assert stored_now == final

    whole = httpx.get(f"{stored}/v1/responses/resp_bgstream?stream=true", timeout=10).text
    events = sse_events(whole)
    assert [e["sequence_number"] for _, e in events] == list(range(13)) and events[1:] == rest
    assert events[0][0] == "response.created" and events[0][1]["response"]["created_at"] == final["created_at"]
    tail = httpx.get(f"{stored}/v1/responses/resp_bgstream?stream=true&starting_after=-3", timeout=10).text
    assert sse_events(tail) == events[-2:]
    with httpx.stream("GET", f"{stored}/v1/responses/resp_bgstream?stream=true&starting_after=-15", timeout=10) as s:
        assert s.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):   # before the first event: vLLM's stream fails
            s.read()
    # past the end: nothing (vLLM's stream there stays open, silent)
    assert httpx.get(f"{stored}/v1/responses/resp_bgstream?stream=true&starting_after=20", timeout=10).text == ""


@pytest.mark.e2e
def test_streaming_a_response_without_kept_events_is_cut_and_bad_query_values_are_400(stored):
    """vLLM keeps the events of background streams only; for any other response its streamed retrieval
    starts (200, an event stream), then fails and the connection is cut."""
    sync = httpx.post(stored + "/v1/responses", json={"input": "u", "max_output_tokens": 1}, timeout=10).json()
    background = httpx.post(stored + "/v1/responses", json={"input": "u", "max_output_tokens": 1, "background": True},
                            timeout=10).json()
    for rid in (sync["id"], background["id"]):
        with httpx.stream("GET", f"{stored}/v1/responses/{rid}?stream=true", timeout=10) as s:
            assert s.status_code == 200 and s.headers["content-type"] == "text/event-stream; charset=utf-8"
            with pytest.raises(httpx.RemoteProtocolError):
                s.read()
    assert httpx.get(f"{stored}/v1/responses/resp_nope?stream=true", timeout=10).json() == not_found("resp_nope")
    assert httpx.get(f"{stored}/v1/responses/{sync['id']}?stream=false&starting_after=3", timeout=10).json() == sync

    r = httpx.get(f"{stored}/v1/responses/{sync['id']}?stream=true&starting_after=abc", timeout=10)
    assert r.status_code == 400 and r.json() == {"error": {
        "message": "1 validation error:\n  {'type': 'int_parsing', 'loc': 'query.starting_after', 'msg': 'Input "
                   "should be a valid integer, unable to parse string as an integer', 'input': 'abc'}",
        "type": "Bad Request", "param": "query.starting_after", "code": 400}}
    r = httpx.get(f"{stored}/v1/responses/{sync['id']}?stream=abc", timeout=10)
    assert r.status_code == 400 and r.json() == {"error": {
        "message": "1 validation error:\n  {'type': 'bool_parsing', 'loc': 'query.stream', 'msg': 'Input should be "
                   "a valid boolean, unable to interpret input', 'input': 'abc'}",
        "type": "Bad Request", "param": "query.stream", "code": 400}}


@pytest.mark.e2e
@pytest.mark.parametrize("body,needle", [
    ({"model": "sim-model"}, "'input'"),                                                  # no input
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": "x"}]},
     "Unsupported input item"),                                                           # Unrenderable
    ({"input": [{"type": "reasoning", "encrypted_content": "zz", "summary": []}]}, "Encrypted content"),
    ({"input": "x", "instructions": 5}, "instructions"),
])
def test_bodies_the_renderer_refuses_are_400(plain, body, needle):
    r = httpx.post(plain + "/v1/responses", json=body, timeout=10)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


@pytest.mark.e2e
def test_a_wrong_model_and_a_too_long_budget_are_refused_as_for_chat(plain):
    r = httpx.post(plain + "/v1/responses", json={"model": "other", "input": "x"}, timeout=10)
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]
    r = httpx.post(plain + "/v1/responses", json={"input": "x", "max_output_tokens": MAX_MODEL_LEN + 1}, timeout=10)
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]


@pytest.mark.e2e
def test_routes_with_an_id_match_one_segment_and_other_methods_are_405(plain):
    assert httpx.delete(plain + "/v1/responses/resp_x", timeout=10).status_code == 405
    assert httpx.get(plain + "/v1/responses/resp_x/cancel", timeout=10).status_code == 405
    assert httpx.get(plain + "/v1/responses", timeout=10).status_code == 405
    assert httpx.get(plain + "/v1/responses/a/b", timeout=10).json() == {"detail": "Not Found"}
    assert httpx.post(plain + "/v1/responses/a/cancel/x", timeout=10).status_code == 404
    # the exact routes still answer
    assert httpx.get(plain + "/v1/models", timeout=10).status_code == 200


@pytest.mark.e2e
def test_cache_salt_faults_and_metrics_work_as_for_chat(plain):
    body = {"input": "salted prompt " * 4, "max_output_tokens": 1}
    httpx.post(plain + "/v1/responses", json=body, timeout=10)
    hit = httpx.post(plain + "/v1/responses", json=body, timeout=10).json()["usage"]["input_tokens_details"]
    assert hit["cached_tokens"] > 0
    salted = httpx.post(plain + "/v1/responses", json={**body, "cache_salt": "tenant-a"}, timeout=10).json()
    assert salted["usage"]["input_tokens_details"]["cached_tokens"] == 0

    r = httpx.post(plain + "/v1/responses", json=body, headers={"x-sim-fault": "status=503", "x-request-id": "f1"},
                   timeout=10)
    assert r.status_code == 503 and r.headers["x-request-id"] == "f1"
    with pytest.raises(httpx.HTTPError):   # the connection is cut after two events
        with httpx.stream("POST", plain + "/v1/responses", json={**body, "stream": True, "max_output_tokens": 4},
                          headers={"x-sim-fault": "drop=2"}, timeout=10) as s:
            s.read()
    with pytest.raises(httpx.HTTPError):
        httpx.post(plain + "/v1/responses", json=body, headers={"x-sim-fault": "drop=1"}, timeout=10)
    metrics = httpx.get(plain + "/metrics", timeout=10).text
    assert re.search(r'^kvsim_faults_injected_total\{kind="drop"\} 2\.0$', metrics, re.M), metrics
    assert re.search(r'^kvsim_faults_injected_total\{kind="status"\} 1\.0$', metrics, re.M), metrics


@pytest.mark.e2e
def test_a_data_parallel_pods_engines_share_one_store():
    """vLLM's store lives in its API server, in front of every engine: a response made on rank 1 is
    read and continued through rank 0."""
    port = consecutive_free_ports(1)
    with kvroute_process(["sim", "--port", str(port), "--responses-store", "--data-parallel-size", "2"],
                         ready_url=f"http://127.0.0.1:{port}/health"):
        base = f"http://127.0.0.1:{port}"
        for rank in (0, 1):
            r = httpx.post(base + "/v1/responses", headers={"x-data-parallel-rank": str(rank)}, timeout=10,
                           json={"input": f"hello {rank}", "max_output_tokens": 2, "request_id": f"resp_rank{rank}"})
            assert r.status_code == 200 and r.json()["id"] == f"resp_rank{rank}", r.text
        assert all(httpx.get(f"{base}/v1/responses/resp_rank{rank}", timeout=10).status_code == 200 for rank in (0, 1))
        r = httpx.post(base + "/v1/responses", headers={"x-data-parallel-rank": "0"}, timeout=10,
                       json={"input": "more", "max_output_tokens": 1, "previous_response_id": "resp_rank1"})
        assert r.status_code == 200 and r.json()["previous_response_id"] == "resp_rank1"
        r = httpx.post(base + "/v1/responses", headers={"x-data-parallel-rank": "2"}, timeout=10,
                       json={"input": "x", "max_output_tokens": 1})
        assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]


@pytest.mark.e2e
def test_a_tokenizer_with_a_bos_gets_one_more_token_than_the_chat_rendering(tmp_path):
    """vLLM tokenizes a Responses prompt with the special tokens added (a chat request's default is
    not to): a BOS-adding tokenizer gives one token more for the same messages."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", "</s>", "user", "hello", "world", "assistant"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}assistant {% endif %}"}))
    port = consecutive_free_ports(1)
    with kvroute_process(["sim", "--port", str(port), "--tokenizer", str(tmp_path / "tokenizer.json")],
                         ready_url=f"http://127.0.0.1:{port}/health"):
        base = f"http://127.0.0.1:{port}"
        chat = httpx.post(base + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 1}, timeout=10).json()
        resp = httpx.post(base + "/v1/responses", json={"input": "hello world", "max_output_tokens": 1},
                          timeout=10).json()
    assert chat["usage"]["prompt_tokens"] == 4   # "user hello world assistant", no BOS
    assert resp["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"] + 1


def test_the_store_bounds_background_runs_and_stopping_ends_them():
    """A background run whose entry the store drops (its bound) or replaces is cancelled with it; the
    run that replaces its own entry with its finished response is not; ``stop`` ends the rest."""
    import asyncio

    from simulator.server import ResponseStore, StoredResponse

    async def main() -> None:
        store = ResponseStore(True, 2)
        finished = asyncio.Event()

        async def finishes(rid: str) -> None:
            store.put(rid, StoredResponse({"status": "completed"}, [], "done"))
            finished.set()
            await asyncio.sleep(10)

        entries = [StoredResponse({"status": "queued"}, [], "") for _ in range(4)]
        store.run_in_background("a", entries[0], asyncio.sleep(10))
        store.run_in_background("b", entries[1], finishes("b"))
        await finished.wait()
        await asyncio.sleep(0.01)
        assert store.get("b").text == "done" and not entries[1].run.done()   # its own put: it goes on
        store.run_in_background("c", entries[2], asyncio.sleep(10))   # the third: "a" is dropped
        await asyncio.sleep(0)
        assert store.get("a") is None and entries[0].run.cancelled()
        store.run_in_background("c", entries[3], asyncio.sleep(10))   # "c" replaced
        await asyncio.sleep(0)
        assert entries[2].run.cancelled() and not entries[3].run.done()
        await store.stop()
        assert entries[1].run.cancelled() and entries[3].run.cancelled()

    asyncio.run(main())


def test_the_store_keeps_the_events_of_its_last_background_streams_only(monkeypatch):
    """A background stream's events (about one per output token) are kept for the last
    ``MAX_EVENT_LOGS`` streams; an older one's are let go, and its retrieval then has none."""
    import asyncio

    from simulator.server import EventLog, ResponseStore, StoredResponse

    monkeypatch.setattr(ResponseStore, "MAX_EVENT_LOGS", 2)

    async def main() -> None:
        store = ResponseStore(True, 100)
        for rid in ("a", "b", "c"):
            store.run_in_background(rid, StoredResponse({"status": "queued"}, [], "", events=EventLog()),
                                    asyncio.sleep(0))
        assert store.get("a").events is None
        assert store.get("b").events is not None and store.get("c").events is not None
        store.run_in_background("d", StoredResponse({"status": "queued"}, [], ""), asyncio.sleep(0))  # no stream
        assert store.get("b").events is not None
        await store.stop()

    asyncio.run(main())
