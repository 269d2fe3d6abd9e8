"""The Anthropic Messages API (``POST /v1/messages``) against a real engine (indexer/messages.py).

* The chat body the router renders a Messages request as has exactly the prompt vLLM 0.32 counts
  for it, over the shapes clients send (text, a system string or blocks, turns of text blocks, a
  tool call and its result, tool references and changes, tools, thinking on and off, an inline
  system message, billing headers, a final assistant message, an effort, stop sequences, a system
  alone): the count of ``/v1/messages``
  (``usage.input_tokens`` plus the cache fields, which vLLM subtracts from it when it reports them)
  and of ``/v1/messages/count_tokens`` (the only count of a thinking budget here: the engines have
  no reasoning parser, so vLLM refuses to generate with one).
* The router's helpers reproduce the pod's template probes (inline system messages kept; disabled
  thinking is effort "none"): the inline-system and thinking-disabled shapes match only so.
* A stream's events, in order: ``message_start`` (before any token, with the prompt's count), the
  content blocks, ``message_delta``, ``message_stop``; a refusal found while rendering a stream is
  an ``error`` event in a 200 stream; the shapes of refusals; and tool choices the engines refuse.
"""

from __future__ import annotations

import json

import anthropic
import pytest

from indexer.messages import chat_body, disabled_thinking_effort, merges_inline_system
from indexer.tokens import chat_request_ids, load_tokenizer
from realvllm.engines import MODEL_NAME
from tests.helpers import http

WEATHER = {"name": "get_weather", "description": "Get the weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CLOCK = {"name": "get_time", "input_schema": {"properties": {"zone": {"type": "string"}}}}  # no "type": vLLM adds it

# the engines have no tool parser: vLLM refuses any other tool choice with tools (see the refusals below);
# the choice does not change the prompt (only "none" with --exclude-tools-when-tool-choice-none would)
NONE = {"type": "none"}

SHAPES: dict[str, dict] = {
    "text": {"messages": [{"role": "user", "content": "Hello there, how are you?"}]},
    "system string": {"system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}]},
    "system blocks": {"system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc"},
                                 {"type": "text", "text": "You are a helpful assistant."},
                                 {"type": "text", "text": " In French.", "cache_control": {"type": "ephemeral"}}],
                      "messages": [{"role": "user", "content": "Hi"}]},
    "multi-turn blocks": {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "First"}, {"type": "text", "text": "Second"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Answer"}]},
        {"role": "user", "content": "Follow-up"}]},
    "tool round trip": {"tools": [WEATHER], "tool_choice": NONE, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "20C"}]},
                                     {"type": "text", "text": "And tomorrow?"}]}]},
    "tools": {"tools": [WEATHER, CLOCK], "tool_choice": {**NONE, "disable_parallel_tool_use": True},
              "messages": [{"role": "user", "content": "What time is it?"}]},
    "thinking disabled": {"thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "Hi"}]},
    "thinking enabled": {"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048,
                         "messages": [{"role": "user", "content": "Hi"}]},
    "thinking history": {"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "redacted_thinking", "data": "abc"},
                                          {"type": "text", "text": "answer"}]},
        {"role": "user", "content": "next"}]},
    "inline system": {"system": "Rules.", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "system", "content": [{"type": "text", "text": "Reminder: be kind."}]},
        {"role": "user", "content": "Bye"}]},
    "final assistant": {"messages": [{"role": "user", "content": "Write"},
                                     {"role": "assistant", "content": "Once upon"}]},
    "effort": {"output_config": {"effort": "high"}, "messages": [{"role": "user", "content": "Hi"}]},
    "stop sequences": {"stop_sequences": ["\n\n", "END"], "temperature": 0.5, "top_k": 5,
                       "messages": [{"role": "user", "content": "Count"}]},
    "assistant tool result": {"messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "text", "text": "done", "flag": True, "none": None}]}]},
        {"role": "user", "content": "ok"}]},
    "tool reference, a call without id": {"tools": [WEATHER], "tool_choice": NONE, "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "tool_use", "name": "get_weather", "input": {"city": "Zürich"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": [
            {"type": "text", "text": "r"}, {"type": "tool_reference", "tool_name": "get_weather"}]}]}]},
    "tool changes": {"tools": [WEATHER, {**CLOCK, "defer_loading": True, "strict": True}], "tool_choice": NONE,
                     "messages": [{"role": "system", "content": [
                         {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "get_time"}},
                         {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "get_weather"}},
                         {"type": "tool_addition", "tool": {"type": "tool_definition",
                                                            "definition": {"name": "noop", "input_schema": {}}}}]},
                         {"role": "user", "content": "hi"}]},
    "billing lines": {"system": "x-anthropic-billing-header: a\nReal system", "messages": [
        {"role": "user", "content": "hi"}, {"role": "system", "content": "x-anthropic-billing-header: z"},
        {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image"}]}]},
    "system only": {"system": "Say something.", "messages": []},
}


def _prompt_tokens(engine_url: str, body: dict) -> int:
    """The prompt's length as ``/v1/messages`` reports it: ``input_tokens`` excludes the tokens read
    from or written to the cache when vLLM reports those (--enable-prompt-tokens-details)."""
    r = http().post(engine_url + "/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return usage["input_tokens"] + usage.get("cache_read_input_tokens", 0) + usage.get("cache_creation_input_tokens", 0)


# shapes this pod renders (count_tokens counts them) but will not generate for: a thinking budget
# needs --reasoning-parser or --reasoning-config
NOT_GENERATED = {"thinking enabled": "thinking_token_budget is set but reasoning_config is not configured"}


def test_the_router_renders_a_messages_request_as_vllm_does(agg_engines, real_env):
    """For each shape, the prompt length of ``/v1/messages`` and of ``/v1/messages/count_tokens``
    equals the router's rendering of its chat body (with what the pod's probes decided)."""
    tokenizer = load_tokenizer(str(real_env.model))
    engine = agg_engines[0]
    # the tiny model's template takes inline system messages and reads enable_thinking
    merge, effort = merges_inline_system(tokenizer), disabled_thinking_effort(tokenizer)
    assert (merge, effort) == (False, "none")
    seen = {}
    for name, shape in SHAPES.items():
        body = {"model": MODEL_NAME, "max_tokens": 1, **shape}
        counted = http().post(engine.url + "/v1/messages/count_tokens", json=body, timeout=120)
        assert counted.status_code == 200, (name, counted.text)
        ours = len(chat_request_ids(chat_body(body, merge_inline_system=merge, disabled_thinking_effort=effort),
                                    tokenizer))
        if name in NOT_GENERATED:
            r = http().post(engine.url + "/v1/messages", json=body, timeout=120)
            assert r.status_code == 400 and NOT_GENERATED[name] in r.json()["error"]["message"], r.text
            real = counted.json()["input_tokens"]
        else:
            real = _prompt_tokens(engine.url, body)
        seen[name] = (real, counted.json()["input_tokens"], ours)
    print(f"(vLLM's /v1/messages count, its count_tokens, the router's) by shape: {seen}")
    assert all(real == counted == ours for real, counted, ours in seen.values()), seen
    # the shapes differ where they should: thinking disabled renders the template's empty think block
    assert seen["thinking disabled"][2] > seen["thinking enabled"][2]


def _events(url: str, body: dict) -> tuple[list[str], list[dict]]:
    with http().stream("POST", url + "/v1/messages", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    return ([line[len("event: "):] for line in lines if line.startswith("event: ")],
            [json.loads(line[5:]) for line in lines if line.startswith("data:")])


def test_a_messages_stream_and_its_refusals(agg_engines, real_env):
    engine = agg_engines[0]
    body = {"model": MODEL_NAME, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "Tell"}]}
    names, data = _events(engine.url, body)
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    assert [d["type"] for d in data] == names  # each event's name is its data's type
    # the first event is no token: the message, empty, with the prompt's count
    tokenizer = load_tokenizer(str(real_env.model))
    assert data[0]["message"]["content"] == [], data[0]
    assert data[0]["message"]["usage"]["input_tokens"] == len(chat_request_ids(chat_body(body), tokenizer))
    assert "content_block_start" in names and "content_block_delta" in names, names
    assert data[-2]["usage"]["output_tokens"] == 4 and data[-2]["delta"]["stop_reason"] == "max_tokens", data[-2]

    # a refusal met while rendering a stream is a 200 stream of one error event (vLLM fails to parse
    # the chat error it converts, so the message is not the refusal's)
    names, data = _events(engine.url, {**body, "max_tokens": 2048,
                                       "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert names == ["error"] and data[0]["error"]["type"] == "internal_error", data

    # with tools, a pod without a tool parser refuses every choice but "none": no choice is "auto",
    # "any" is "required", "tool" the named function (the router's conversion, as the pod words it)
    auto = '"auto" tool choice requires --enable-auto-tool-choice'
    choices: list[tuple[dict | None, object, str]] = [
        (None, "auto", auto), ({"type": "auto"}, "auto", auto),
        ({"type": "any"}, "required", 'tool_choice="required" requires --tool-call-parser'),
        ({"type": "tool", "name": "get_time"}, {"type": "function", "function": {"name": "get_time"}},
         'tool_choice=function "get_time" requires --tool-call-parser')]
    for choice, chat_choice, said in choices:
        asked = {"model": MODEL_NAME, "max_tokens": 1, "tools": [WEATHER, CLOCK],
                 "messages": [{"role": "user", "content": "hi"}], **({"tool_choice": choice} if choice else {})}
        r = http().post(engine.url + "/v1/messages", json=asked, timeout=60)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert said in r.json()["error"]["message"], r.text
        assert chat_body(asked)["tool_choice"] == chat_choice

    # a refusal after the request model accepted the body is shaped as Anthropic's errors are
    bad = {"model": MODEL_NAME, "max_tokens": 8, "messages": [{"role": "system", "content": [
        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "nope"}}]},
        {"role": "user", "content": "hi"}]}
    r = http().post(engine.url + "/v1/messages", json=bad, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "which is not declared in tools" in r.json()["error"]["message"], r.text
    # one the request model refuses is shaped as an OpenAI error
    r = http().post(engine.url + "/v1/messages", json={**bad, "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and "max_tokens must be positive" in r.json()["error"]["message"], r.text
    assert "type" not in r.json() or r.json()["type"] != "error", r.text


def test_messages_through_the_router(agg_engines, real_env, tmp_path):
    """The router in front of both engines: each conversation's follow-ups go to the engine that
    computed its system prompt and hit its cache there; a stream is relayed as the engine sends it
    (message_start first); count_tokens answers as the engine does."""
    import os

    from realvllm.engines import router_pod
    from tests.real_vllm.conftest import engine_metric, running_router

    urls = {e.name: e.url for e in agg_engines}
    with running_router(tmp_path, [router_pod(e) for e in agg_engines], tokenizer=str(real_env.tokenizer),
                        speculative_ttl_s=5.0) as base:
        for n in range(3):
            system = f"Conversation {n} {os.urandom(4).hex()}: " + " ".join(
                f"rule {i} is to answer in the voice of speaker {i * 7 + n}" for i in range(40))
            body = {"model": MODEL_NAME, "max_tokens": 2, "system": system,
                    "messages": [{"role": "user", "content": "first question"}]}
            first = http().post(base + "/v1/messages", json=body, timeout=120)
            assert first.status_code == 200, first.text
            pod = first.headers["x-kvroute-pod"]
            before = engine_metric(urls[pod], "vllm:prefix_cache_hits_total")
            again = http().post(base + "/v1/messages", json={
                **body, "messages": [{"role": "user", "content": "second question"}]}, timeout=120)
            assert again.status_code == 200 and again.headers["x-kvroute-pod"] == pod
            hit = engine_metric(urls[pod], "vllm:prefix_cache_hits_total") - before
            assert hit >= 32 * 20, hit   # the ~900-token system prompt's blocks, less the last
        names, data = _events(base, {**body, "stream": True, "max_tokens": 3})
        assert names[0] == "message_start" and names[-1] == "message_stop", names
        # Anthropic's own SDK reads the relayed stream whole, and raises on the engine's error event
        # (the form the router's and the sidecar's own error events take on this route)
        client = anthropic.Anthropic(base_url=base, api_key="k", max_retries=0, timeout=120)
        with client.messages.stream(model=MODEL_NAME, max_tokens=3, system=system,
                                    messages=[{"role": "user", "content": "third question"}]) as stream:
            final = stream.get_final_message()
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 3, final
        with pytest.raises(anthropic.APIError, match="internal_error"):
            with client.messages.stream(model=MODEL_NAME, max_tokens=2048, system=system,
                                        thinking={"type": "enabled", "budget_tokens": 1024},
                                        messages=[{"role": "user", "content": "hi"}]) as stream:
                stream.get_final_message()
        client.close()
        counted = {"model": MODEL_NAME, "system": system, "messages": [{"role": "user", "content": "hi"}]}
        routed = http().post(base + "/v1/messages/count_tokens", json=counted, timeout=60)
        direct = http().post(urls[routed.headers["x-kvroute-pod"]] + "/v1/messages/count_tokens", json=counted,
                             timeout=60)
        assert routed.status_code == 200 and routed.json() == direct.json()
