"""A Responses API request (``POST /v1/responses``) as the chat-completions body that renders the
same prompt, so that the router keys, and the simulator computes, what vLLM 0.32 renders for it.

vLLM 0.32 renders a Responses request through the model's chat template, as a chat request
(``OnlineRenderer.render_responses``, vllm/renderers/online_renderer.py, and
``construct_input_messages``, vllm/entrypoints/openai/responses/utils.py, for a model without the
Harmony format):

* ``instructions`` is a system message first;
* ``input`` as a string is one user message; as a list, each item becomes a chat message: an item
  with a ``role`` as it is (its ``input_text`` parts are text parts), a ``function_call`` a tool
  call of the assistant message before it (or of a new one), a ``function_call_output`` a tool
  message, a ``reasoning`` item the assistant's ``reasoning``, an assistant message its first
  part's text;
* the generation prompt is added unless the last item is an assistant message (or reasoning) whose
  ``status`` is ``in_progress`` or ``incomplete``: then the final message is continued;
* the rendered text is tokenized with the tokenizer's special tokens added (``TokenizeParams``'s
  default, which a Responses request does not change, where a chat request's
  ``add_special_tokens`` defaults to false): a template that writes its own BOS gets a second one
  (measured on vLLM 0.32: ten request shapes, each one token more than the chat rendering);
* ``reasoning.effort`` is the chat request's ``reasoning_effort``, ``chat_template_kwargs`` are
  merged as a chat request's, and the ``function`` tools are the chat tools
  (``{"type": "function", "function": {...}}``); other tool types are not rendered.

A request with ``previous_response_id`` also renders the stored conversation, which only the pod
that stored it holds: ``chat_body`` renders what the request itself carries, the end of that
prompt. Items the router cannot render as vLLM does (``custom_tool_call``, namespaced tools)
raise ``Unrenderable``: such a request is routed by its length alone.
"""

from __future__ import annotations

from typing import Any

from indexer.tokens import ChatTemplateError


class Unrenderable(ValueError):
    """The request is valid as far as the router can tell, but its prompt cannot be rendered here
    as vLLM renders it."""


# the body fields a chat request takes under the same name and meaning
_SAME = ("model", "chat_template_kwargs", "cache_salt", "stream", "priority", "tool_choice")


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body whose rendered prompt is the one vLLM 0.32 renders for the
    Responses request ``body``. ``ChatTemplateError`` for what vLLM refuses with a 400 (as
    vLLM words it where it words it), ``Unrenderable`` for what the router cannot render."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ChatTemplateError("'instructions' must be a string", param="instructions")
    given = body.get("input")
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        continue_final = False
    elif isinstance(given, list):
        messages += input_messages(given)
        continue_final = bool(given) and _partial(given[-1])
    else:
        raise ChatTemplateError("'input' must be a string or a list of input items", param="input")
    if not messages:
        raise ChatTemplateError("'input' must not be empty", param="input")
    out: dict[str, Any] = {"messages": messages, "add_generation_prompt": not continue_final,
                           "continue_final_message": continue_final, "add_special_tokens": True}
    for key in _SAME:
        if key in body:
            out[key] = body[key]
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise ChatTemplateError("'reasoning' must be an object", param="reasoning")
        if reasoning.get("effort") is not None:
            out["reasoning_effort"] = reasoning["effort"]
    max_output = body.get("max_output_tokens")
    if max_output is not None:
        out["max_tokens"] = max_output
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ChatTemplateError("'tools' must be a list of objects", param="tools")
        if any(t.get("type") == "namespace" for t in tools):
            raise Unrenderable("namespaced tools")
        chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                      for t in tools if t.get("type") == "function"]
        if chat_tools:
            out["tools"] = chat_tools
        else:
            out.pop("tool_choice", None)
    else:
        out.pop("tool_choice", None)
    return out


def _partial(item: Any) -> bool:
    """vLLM's ``should_continue_final_message`` for the last input item: an assistant message or a
    reasoning item left ``in_progress`` or ``incomplete`` is continued."""
    return (isinstance(item, dict) and item.get("type", "message") in ("message", "reasoning")
            and item.get("status") in ("in_progress", "incomplete"))


def input_messages(items: list[Any]) -> list[dict[str, Any]]:
    """The chat messages of a list of input items (vLLM's ``construct_chat_messages_with_tool_call``):
    a tool call, a reasoning text or an assistant text joins the assistant message before it when
    that one has none yet."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict):
            raise ChatTemplateError("each input item must be an object", param="input")
        prev = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
        kind = item.get("type")
        if kind == "function_call":
            call = {"id": item.get("call_id"), "function": {"name": item.get("name"),
                                                            "arguments": item.get("arguments")},
                    "type": "function"}
            if item.get("namespace"):
                raise Unrenderable("a namespaced tool call")
            if prev is not None:
                calls = prev.get("tool_calls")
                if calls is None:
                    prev["tool_calls"] = [call]
                    continue
                if isinstance(calls, list):
                    calls.append(call)
                    continue
            messages.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "custom_tool_call":
            raise Unrenderable("a custom tool call")
        elif kind == "reasoning":
            if item.get("encrypted_content"):
                raise ChatTemplateError("Encrypted content is not supported.", param="input")
            content, summary = item.get("content"), item.get("summary")
            if isinstance(content, list) and content:   # its content, even an empty text, before the summary
                text = _first_text(content) or ""
            else:
                text = _first_text(summary) or ""
            if prev is not None and prev.get("reasoning") is None:
                prev["reasoning"] = text
                continue
            messages.append({"role": "assistant", "reasoning": text})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")})
        elif item.get("role") == "assistant":
            content = item.get("content")
            said = content if isinstance(content, str) else _first_text(content)
            if said is None:
                messages.append(item)
            elif prev is not None and prev.get("content") is None:
                prev["content"] = said
            else:
                messages.append({"role": "assistant", "content": said})
        elif "role" in item:
            messages.append(item)
        else:
            raise ChatTemplateError(f"Unsupported input item type: {kind}", param="input")
    return messages


def _first_text(parts: Any) -> str | None:
    """The ``text`` of the first part of a content or summary list, if there is one."""
    if isinstance(parts, list) and parts and isinstance(parts[0], dict):
        text = parts[0].get("text")
        return text if isinstance(text, str) else None
    return None
