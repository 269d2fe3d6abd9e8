"""The Responses API against real engines (router/responses.py, indexer/responses.py).

* The chat body the router renders a Responses request as has exactly the prompt vLLM 0.32 counts
  for it, over the input shapes clients send (text, messages, typed messages, tool calls and their
  outputs, reasoning items, a partial assistant message, instructions, tools, reasoning effort).
* Through the router, with the OpenAI SDK and two API keys: a new turn goes to the pod that holds
  its prefix; a continuation (``previous_response_id``), a retrieval and a cancellation reach the
  pod that stores the response, and only for the key that made it; a stream's first events are not
  its first token.
"""

from __future__ import annotations

import os

import openai
import pytest

from indexer.responses import chat_body
from indexer.tokens import chat_request_ids, load_tokenizer
from realvllm.engines import BLOCK_SIZE, MODEL_NAME, router_pod
from router.responses import ID_CHARS
from tests.helpers import http
from tests.real_vllm.conftest import running_router

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}

SHAPES = {
    "text": {"input": "Hello there, how are you?"},
    "instructions": {"instructions": "Be brief.", "input": "Hi"},
    "messages": {"instructions": "Be brief.", "input": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": [{"type": "input_text", "text": "More"}]}]},
    "typed messages": {"input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Hello", "annotations": []}]},
        {"type": "message", "role": "user", "content": "again"}]},
    "developer": {"input": [{"role": "developer", "content": "Rules"}, {"role": "user", "content": "Hi"}]},
    "tool call": {"tools": [WEATHER], "input": [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]},
    "tools": {"input": "hi", "tools": [WEATHER]},
    "reasoning item": {"input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "id": "m2", "status": "completed",
         "content": [{"type": "output_text", "text": "answer", "annotations": []}]},
        {"role": "user", "content": "next"}]},
    "partial assistant": {"input": [
        {"role": "user", "content": "Write"},
        {"type": "message", "role": "assistant", "id": "m3", "status": "incomplete",
         "content": [{"type": "output_text", "text": "Once upon", "annotations": []}]}]},
    "reasoning effort": {"input": "hi", "reasoning": {"effort": "low"}},
}


def test_the_router_renders_a_responses_request_as_vllm_does(agg_engines, real_env):
    """The prompt length vLLM reports for each shape equals the router's rendering of its chat
    body; one token off would be the BOS vLLM adds to a Responses prompt (and not to a chat one)."""
    tokenizer = load_tokenizer(str(real_env.model))
    engine = agg_engines[0]
    seen = {}
    for name, shape in SHAPES.items():
        body = {"model": MODEL_NAME, "max_output_tokens": 1, **shape}
        r = http().post(engine.url + "/v1/responses", json=body, timeout=120)
        assert r.status_code == 200, (name, r.text)
        seen[name] = (r.json()["usage"]["input_tokens"], len(chat_request_ids(chat_body(body), tokenizer)))
    print(f"(vLLM's input tokens, the router's) by shape: {seen}")
    assert all(real == ours for real, ours in seen.values()), seen


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, timeout=120, max_retries=0)


def test_responses_through_the_router(agg_engines, real_env, tmp_path):
    keys = [{"key": "sk-a", "name": "tenant-a"}, {"key": "sk-b", "name": "tenant-b"}]
    tokenizer = load_tokenizer(str(real_env.model))
    with running_router(tmp_path, [router_pod(e) for e in agg_engines], tokenizer=str(real_env.tokenizer),
                        api_keys=keys, speculative_ttl_s=5.0) as base:
        a, b = _client(base, "sk-a"), _client(base, "sk-b")
        # new turns: each follow-up of a long instruction goes to the pod that computed it, and hits there
        for n in range(3):
            instructions = f"Conversation {n} {os.urandom(4).hex()}: " + " ".join(
                f"rule {i} is to answer in the voice of speaker {i * 7 + n}" for i in range(40))
            first = a.responses.with_raw_response.create(model=MODEL_NAME, instructions=instructions,
                                                        input="first question", max_output_tokens=2)
            pod = first.headers["x-kvroute-pod"]
            made = first.parse()
            assert made.id.startswith("resp_") and len(made.id) == ID_CHARS, made.id
            again = a.responses.with_raw_response.create(model=MODEL_NAME, instructions=instructions,
                                                        input="second question", max_output_tokens=2)
            assert again.headers["x-kvroute-pod"] == pod
            cached = again.parse().usage.input_tokens_details.cached_tokens
            assert cached >= (made.usage.input_tokens // BLOCK_SIZE - 1) * BLOCK_SIZE > 0, cached

        # a continuation reaches the pod that stores the response, and carries its conversation: the
        # earlier input and output, not its instructions (they do not carry over, as OpenAI specifies)
        cont = a.responses.with_raw_response.create(model=MODEL_NAME, previous_response_id=made.id,
                                                   input="and then?", max_output_tokens=2)
        assert cont.headers["x-kvroute-pod"] == pod
        history = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": made.output_text},
                   {"role": "user", "content": "and then?"}]
        expected = len(chat_request_ids(chat_body({"model": MODEL_NAME, "input": history}), tokenizer))
        assert cont.parse().usage.input_tokens == expected
        assert cont.parse().previous_response_id == made.id

        # retrieval and cancellation, for the key that made the response only
        got = a.responses.with_raw_response.retrieve(made.id)
        assert got.headers["x-kvroute-pod"] == pod and got.parse().id == made.id
        with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
            a.responses.cancel(made.id)
        for call in (lambda: b.responses.retrieve(made.id), lambda: b.responses.cancel(made.id),
                     lambda: b.responses.create(model=MODEL_NAME, previous_response_id=made.id, input="x",
                                                max_output_tokens=1),
                     lambda: a.responses.retrieve("resp_" + "0" * (ID_CHARS - 5))):
            with pytest.raises(openai.NotFoundError, match="not found"):
                call()

        # a client's own request_id is not the response's id (it could overwrite another's stored one)
        mine = a.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=1,
                                  extra_body={"request_id": "resp_chosen_by_client"})
        assert mine.id != "resp_chosen_by_client" and len(mine.id) == ID_CHARS

        # a stream: vLLM's events in order, relayed as they are
        with a.responses.stream(model=MODEL_NAME, input="tell me a story", max_output_tokens=4) as stream:
            kinds = [event.type for event in stream]
        assert kinds[:2] == ["response.created", "response.in_progress"], kinds
        assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds, kinds
