"""indexer/messages.py: an Anthropic Messages request as the chat body vLLM 0.32 renders for it.

Pure: the conversions of each block kind, the tools and choices, thinking, the template probes, and
the refusals with their params (tests/real_vllm/test_messages_parity.py checks the prompts against
a real engine).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from indexer.messages import (
    Unrenderable,
    chat_body,
    chat_tool,
    disabled_thinking_effort,
    merges_inline_system,
    template_refuses_inline_system,
)
from indexer.tokens import ByteTokenizer, ChatTemplateError, ServeChatFlags, chat_request_ids, chat_text

pytestmark = pytest.mark.unit

USER = {"role": "user", "content": "hi"}
TOOL = {"name": "get_weather", "description": "Weather", "input_schema": {"type": "object", "properties": {}}}
# a template like the tiny test model's: reads enable_thinking, keeps inline system messages
THINKING_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                     "{% if add_generation_prompt %}<assistant>"
                     "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
                     "{% endif %}")
# Qwen's guard: a system message after the first is refused
SYSTEM_FIRST = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
                "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
                "{{ m['content'] }}{% endfor %}")


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 16, "messages": [USER], **fields}


# ---------------------------------------------------------------------------------------------
# system
# ---------------------------------------------------------------------------------------------

def test_a_system_string_is_the_first_message_as_it_is():
    out = chat_body(body(system="Be brief."))
    assert out["messages"] == [{"role": "system", "content": "Be brief."}, USER]


def test_system_blocks_are_joined_with_nothing_between_and_billing_blocks_and_empty_ones_left_out():
    out = chat_body(body(system=[{"type": "text", "text": "x-anthropic-billing-header: cch=1"},
                                 {"type": "text", "text": "A."}, {"type": "text", "text": ""},
                                 {"type": "image", "source": {"type": "url", "url": "u"}},
                                 {"type": "text", "text": " B."}]))
    assert out["messages"][0] == {"role": "system", "content": "A. B."}


@pytest.mark.parametrize("system", ["", [], [{"type": "text", "text": "x-anthropic-billing-header: a"}]])
def test_a_system_with_no_text_adds_no_message(system):
    assert chat_body(body(system=system))["messages"] == [USER]


def test_an_inline_system_message_stays_in_place_or_is_merged_into_the_leading_one():
    messages = [USER, {"role": "system", "content": [{"type": "text", "text": "R1"}, {"type": "text", "text": "R2"}]},
                {"role": "system", "content": "x-anthropic-billing-header: z"}, {"role": "user", "content": "x"}]
    kept = chat_body(body(system="S", messages=messages))["messages"]
    assert kept == [{"role": "system", "content": "S"}, USER, {"role": "system", "content": "R1R2"},
                    {"role": "user", "content": "x"}]
    merged = chat_body(body(system="S", messages=messages), merge_inline_system=True)["messages"]
    assert merged == [{"role": "system", "content": "SR1R2"}, USER, {"role": "user", "content": "x"}]
    # merging with no top-level system makes one from the inline ones alone
    alone = chat_body(body(messages=messages), merge_inline_system=True)["messages"]
    assert alone[0] == {"role": "system", "content": "R1R2"}


# ---------------------------------------------------------------------------------------------
# content blocks
# ---------------------------------------------------------------------------------------------

def test_text_blocks_one_is_a_string_more_are_parts_and_empty_ones_are_left_out():
    one = chat_body(body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": ""}]}]))
    assert one["messages"] == [{"role": "user", "content": "a"}]
    two = chat_body(body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}]))
    assert two["messages"] == [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                            {"type": "text", "text": "b"}]}]
    # rendered as the chat renderer joins parts: with a newline
    assert "a\nb" in chat_text(two, ByteTokenizer())[0]


def test_a_tool_use_is_an_assistant_tool_call_with_its_input_as_json_dumps_writes_it():
    out = chat_body(body(messages=[USER, {"role": "assistant", "content": [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Zürich", "n": 1}}]}]))
    assert out["messages"][1] == {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "toolu_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Z\\u00fcrich", "n": 1}'}}]}
    assert "content" not in chat_body(body(messages=[USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]))["messages"][1]


def test_a_tool_use_without_id_name_or_input_gets_vllms_defaults():
    call = chat_body(body(messages=[USER, {"role": "assistant", "content": [{"type": "tool_use"}]}]))[
        "messages"][1]["tool_calls"][0]
    assert call["id"].startswith("call_") and call["id"][5:].isdigit()
    assert call["function"] == {"name": "", "arguments": "{}"}


def test_a_users_tool_result_is_a_tool_message_before_the_users_message():
    out = chat_body(body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "and then?"},
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
        {"type": "tool_result", "tool_use_id": "toolu_2",
         "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}, {"type": "whatever"}]}]}]))
    assert out["messages"] == [{"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
                               {"role": "tool", "tool_call_id": "toolu_2", "content": "a\nb"},
                               {"role": "user", "content": "and then?"}]


def test_a_user_message_of_tool_results_only_is_dropped_an_assistant_one_is_kept_empty():
    out = chat_body(body(messages=[{"role": "user", "content": [{"type": "tool_result"}]},
                                   {"role": "assistant", "content": []}, {"role": "user", "content": []}]))
    assert out["messages"] == [{"role": "tool", "tool_call_id": "", "content": ""}, {"role": "assistant"}]


def test_tool_references_in_a_tool_result_are_a_second_tool_message():
    out = chat_body(body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "text", "text": "r"}, {"type": "tool_reference", "tool_name": "a"},
        {"type": "tool_reference", "name": "b"}, {"type": "tool_reference"}]}]}]))
    assert out["messages"] == [{"role": "tool", "tool_call_id": "t", "content": "r"},
                               {"role": "tool", "tool_call_id": "t", "content": [
                                   {"type": "tool_reference", "name": "a"}, {"type": "tool_reference", "name": "b"}]}]


def test_an_assistants_tool_result_is_text_with_pythons_repr_of_its_content():
    content = [{"type": "text", "text": "x", "ok": True, "none": None}]
    out = chat_body(body(messages=[USER, {"role": "assistant", "content": [
        {"type": "tool_result", "content": content}, {"type": "tool_result"}]}]))
    assert out["messages"][1]["content"] == [
        {"type": "text", "text": "Tool result: [{'type': 'text', 'text': 'x', 'ok': True, 'none': None}]"},
        {"type": "text", "text": "Tool result: "}]


def test_thinking_blocks_are_the_reasoning_and_redacted_ones_are_left_out():
    out = chat_body(body(messages=[USER, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "a", "signature": "s"}, {"type": "redacted_thinking", "data": "d"},
        {"type": "thinking", "thinking": "b"}, {"type": "text", "text": "answer"}]}]))
    assert out["messages"][1] == {"role": "assistant", "content": "answer", "reasoning": "ab"}


def test_a_final_assistant_message_is_not_continued():
    out = chat_body(body(messages=[USER, {"role": "assistant", "content": "Once upon"}]))
    assert "continue_final_message" not in out and "add_generation_prompt" not in out
    text, special = chat_text(out, ByteTokenizer())
    assert text.endswith("<|im_start|>assistant\n") and not special


def test_an_image_is_unrenderable_unless_it_has_no_source():
    with pytest.raises(Unrenderable):
        chat_body(body(messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]))
    with pytest.raises(Unrenderable):
        chat_body(body(messages=[{"role": "user", "content": [{"type": "tool_result", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://x"}}]}]}]))
    sourceless = chat_body(body(messages=[{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": "a"}]}]))
    assert sourceless["messages"] == [{"role": "user", "content": "a"}]
    assert issubclass(Unrenderable, ValueError) and not issubclass(Unrenderable, ChatTemplateError)


# ---------------------------------------------------------------------------------------------
# tools, tool choice, thinking, the other fields
# ---------------------------------------------------------------------------------------------

def test_a_tool_is_a_chat_function_and_a_schema_without_type_gets_object_last():
    assert chat_tool({"name": "f", "input_schema": {"properties": {"a": {}}}, "strict": True}) == {
        "type": "function", "function": {"name": "f", "description": None,
                                         "parameters": {"properties": {"a": {}}, "type": "object"},
                                         "strict": True, "defer_loading": None}}
    # last, as the template's tojson writes it
    assert list(chat_tool({"name": "f", "input_schema": {"properties": {}}})["function"]["parameters"]) == [
        "properties", "type"]
    out = chat_body(body(tools=[TOOL]))
    assert out["tools"] == [chat_tool(TOOL)] and out["tool_choice"] == "auto"
    assert list(out["tools"][0]["function"]["parameters"]) == ["type", "properties"]


@pytest.mark.parametrize(("choice", "chat_choice", "parallel"), [
    ({"type": "auto"}, "auto", True), ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "none"}, "none", True),
    ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}, True)])
def test_each_tool_choice(choice, chat_choice, parallel):
    out = chat_body(body(tools=[TOOL], tool_choice=choice))
    assert out["tool_choice"] == chat_choice and out["parallel_tool_calls"] is parallel


def test_tool_choice_none_drops_the_tools_only_where_the_pods_say_so():
    out = chat_body(body(tools=[TOOL], tool_choice={"type": "none"}))
    tok = ByteTokenizer("{{ tools | tojson }}")
    assert "get_weather" in chat_text(out, tok)[0]
    assert "get_weather" not in chat_text(out, tok, flags=ServeChatFlags(exclude_tools_when_tool_choice_none=True))[0]


def test_tool_changes_in_system_messages_resolve_the_tools():
    messages: list[dict[str, Any]] = [{"role": "system", "content": [
        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "late"}},
        {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "get_weather"}},
        {"type": "tool_addition",
         "tool": {"type": "tool_definition", "definition": {"name": "new", "input_schema": {}}}},
        {"type": "text", "text": "Sys"}]}, USER]
    late = {"name": "late", "input_schema": {"type": "object"}, "defer_loading": True}
    out = chat_body(body(tools=[TOOL, late], messages=messages))
    assert [t["function"]["name"] for t in out["tools"]] == ["late", "new"]
    assert out["tools"][0]["function"]["defer_loading"] is None  # added by reference: no longer deferred
    assert out["tools"][1]["function"]["parameters"] == {"type": "object"}
    assert out["messages"][0] == {"role": "system", "content": "Sys"}
    # tool changes with no tools at all: the tools are those the changes define
    defined = chat_body(body(messages=[{"role": "system", "content": messages[0]["content"][2:]}, USER]))
    assert [t["function"]["name"] for t in defined["tools"]] == ["new"] and defined["tool_choice"] == "auto"
    with pytest.raises(ChatTemplateError, match="references tool 'late', which is not declared in tools") as err:
        chat_body(body(messages=messages))
    assert err.value.param == "messages"


def test_an_empty_tool_list_is_unrenderable():
    with pytest.raises(Unrenderable):
        chat_body(body(tools=[]))
    removed = [{"role": "system", "content": [{"type": "tool_removal",
                                               "tool": {"type": "tool_reference", "name": "get_weather"}}]}, USER]
    with pytest.raises(Unrenderable):
        chat_body(body(tools=[TOOL], messages=removed))


def test_thinking_and_effort():
    assert "reasoning_effort" not in chat_body(body(thinking={"type": "adaptive"}))
    enabled = chat_body(body(max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024}))
    assert enabled["thinking_token_budget"] == 1024 and "reasoning_effort" not in enabled
    assert chat_body(body(output_config={"effort": "high"}))["reasoning_effort"] == "high"
    # disabled wins over the effort, with what the pod's probe decided
    disabled = body(thinking={"type": "disabled"}, output_config={"effort": "max"})
    assert chat_body(disabled)["reasoning_effort"] == "none"
    assert chat_body(disabled, disabled_thinking_effort="low")["reasoning_effort"] == "low"
    with pytest.raises(Unrenderable):
        chat_body(disabled, disabled_thinking_effort=None)
    # rendered: "none" is enable_thinking false for the template
    tok = ByteTokenizer(THINKING_TEMPLATE)
    assert chat_text(chat_body(disabled), tok)[0].endswith("<think></think>")
    assert not chat_text(chat_body(body(output_config={"effort": "low"})), tok)[0].endswith("<think></think>")


def test_the_fields_that_carry_over_and_those_that_do_not():
    out = chat_body(body(stop_sequences=["END"], temperature=0.2, top_p=0.9, top_k=3, cache_salt="salt",
                         chat_template_kwargs={"enable_thinking": False}, stream=True, metadata={"user_id": "u"},
                         kv_transfer_params={"do_remote_prefill": True}, add_generation_prompt=False,
                         add_special_tokens=True, chat_template="{{ x }}", documents=[{"title": "t"}],
                         reasoning_effort="high", output_config={"format": {"type": "json_schema",
                                                                           "schema": {"type": "object"}}}))
    assert out == {"messages": [USER], "model": "m", "chat_template_kwargs": {"enable_thinking": False},
                   "temperature": 0.2, "top_p": 0.9, "top_k": 3, "cache_salt": "salt",
                   "kv_transfer_params": {"do_remote_prefill": True}, "max_tokens": 16, "stop": ["END"],
                   "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                   "response_format": {"type": "json_schema",
                                       "json_schema": {"schema": {"type": "object"}, "name": "json_schema"}}}
    counted = chat_body({"model": "m", "messages": [USER], "stream": True, "temperature": 1, "cache_salt": "s"},
                        count_tokens=True)
    assert counted == {"messages": [USER], "model": "m"}


def test_the_chat_body_renders_without_special_tokens_like_a_chat_request():
    tok = ByteTokenizer()
    out = chat_body(body(system="S", tools=[TOOL], tool_choice={"type": "none"}, messages=[
        USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]))
    ids = chat_request_ids(out, tok)
    text, special = chat_text(out, tok)
    assert not special and ids == tok.encode(text, add_special_tokens=False)
    assert json.loads(json.dumps(out)) == out  # plain JSON, as a router would send it on


# ---------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"model": ""}, "model", "Model is required"),
    ({"messages": "hi"}, "messages", "must be a list"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "role must be one of"),
    ({"messages": [{"role": "user", "content": None}]}, "messages", "content must be a string or a list"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages", "known type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_addition",
                                                  "tool": {"type": "tool_reference", "name": "a"}}]}]},
     "messages", 'only allowed in messages with role "system"'),
    ({"messages": [{"role": "system", "content": [{"type": "tool_addition"}]}]}, "messages", "tool is required"),
    ({"messages": [{"role": "system", "content": [{"type": "tool_removal", "tool": {
        "type": "tool_definition", "definition": TOOL}}]}]}, "messages", "only accepts a tool_reference"),
    ({"system": [{"type": "tool_removal", "tool": {"type": "tool_reference", "name": "a"}}]}, "system",
     'only allowed in messages with role "system"'),
    ({"system": 3}, "system", "'system' must be"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be positive"),
    ({"max_tokens": None}, "max_tokens", "required"),
    ({"thinking": {"type": "enabled", "budget_tokens": 512}}, "thinking", "at least 1024"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 1024}, "thinking",
     "thinking.budget_tokens must be less than max_tokens"),
    ({"thinking": {"type": "sometimes"}}, "thinking", "thinking.type"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice", "tool_choice.name is required when type is 'tool'"),
    ({"tool_choice": {"type": "all"}}, "tool_choice", "tool_choice.type"),
    ({"tools": [{"name": "f"}]}, "tools", "input_schema must be a dictionary"),
    ({"tools": {"name": "f"}}, "tools", "must be a list"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort", "must be one of"),
    ({"stop_sequences": "END"}, "stop_sequences", "list of strings"),
    ({"messages": []}, "messages", "Cannot apply chat template to an empty conversation"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "content": [{"type": "text", "text": None}]}]}]},
     "messages", "sequence item 0: expected str instance, NoneType found"),
])
def test_what_vllm_refuses(fields, param, says):
    with pytest.raises(ChatTemplateError, match=says) as err:
        chat_body(body(**fields))
    assert err.value.param == param


def test_a_budget_over_max_tokens_passes_for_a_prefill_leg_and_for_count_tokens():
    thinking = {"type": "enabled", "budget_tokens": 1024}
    chat_body(body(max_tokens=1, thinking=thinking, kv_transfer_params={"do_remote_decode": True}))
    chat_body({"model": "m", "messages": [USER], "thinking": thinking}, count_tokens=True)
    with pytest.raises(ChatTemplateError):
        chat_body({"model": "m", "messages": [USER], "thinking": thinking})


def test_a_system_only_request_renders():
    assert chat_body(body(system="S", messages=[]))["messages"] == [{"role": "system", "content": "S"}]


# ---------------------------------------------------------------------------------------------
# the template probes
# ---------------------------------------------------------------------------------------------

def test_the_inline_system_probe():
    assert template_refuses_inline_system(SYSTEM_FIRST)
    assert template_refuses_inline_system(None) and template_refuses_inline_system("")
    assert template_refuses_inline_system("{{ messages | unknown_filter }}")  # fails to compile
    assert not template_refuses_inline_system(THINKING_TEMPLATE)
    assert not merges_inline_system(ByteTokenizer(THINKING_TEMPLATE))
    assert merges_inline_system(ByteTokenizer(SYSTEM_FIRST))
    # the pods' --chat-template replaces the tokenizer's
    assert merges_inline_system(ByteTokenizer(THINKING_TEMPLATE), SYSTEM_FIRST)
    # a tokenizer with named templates: the one picked with tools=[] counts too
    named = ByteTokenizer()
    named._templates = {"default": THINKING_TEMPLATE, "tool_use": SYSTEM_FIRST}
    assert merges_inline_system(named)


def test_the_disabled_thinking_probe():
    assert disabled_thinking_effort(ByteTokenizer(THINKING_TEMPLATE)) == "none"
    # a template that ignores the effort renders "none" as it renders "low": low
    assert disabled_thinking_effort(ByteTokenizer("{{ messages[0]['content'] }}")) == "low"
    # one that fails on "none": low
    refusing = "{% if reasoning_effort == 'none' %}{{ raise_exception('no') }}{% endif %}{{ reasoning_effort }}"
    assert disabled_thinking_effort(ByteTokenizer(refusing)) == "low"
    # one that renders each effort differently: none
    assert disabled_thinking_effort(ByteTokenizer("{{ reasoning_effort }}")) == "none"
    # the pods' --anthropic-disabled-thinking-effort wins; their --chat-template is the one probed
    assert disabled_thinking_effort(ByteTokenizer(THINKING_TEMPLATE), configured="medium") == "medium"
    ignoring = ServeChatFlags(chat_template="{{ messages[0]['content'] }}")
    assert disabled_thinking_effort(ByteTokenizer(THINKING_TEMPLATE), ignoring) == "low"
