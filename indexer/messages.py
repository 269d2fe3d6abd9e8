"""An Anthropic Messages request (``POST /v1/messages``, ``/v1/messages/count_tokens``) as the
chat-completions body that renders the same prompt, so that the router keys what vLLM 0.32 renders
for it.

vLLM 0.32 turns a Messages request into a chat-completions request and renders that
(``AnthropicServingMessages.to_chat_completion_request``, vllm/entrypoints/anthropic/serving.py):

* ``system`` (a string, or text blocks joined with no separator; a block whose text starts with
  Claude Code's ``x-anthropic-billing-header`` is left out, empty ones too) is one system message
  first;
* each message keeps its role; string content is the content; of a block list, text blocks are the
  content (one text block: a string; more: text parts, which the chat renderer joins with
  newlines), ``thinking`` blocks the assistant's ``reasoning`` (joined with no separator),
  ``tool_use`` blocks its ``tool_calls`` (``arguments`` the input as ``json.dumps`` writes it),
  ``redacted_thinking`` and ``tool_reference`` blocks nothing;
* a ``tool_result`` block in a user message is a tool message *before* that user message (its
  text items joined with newlines; its ``tool_reference`` items a second tool message), in an
  assistant message the text part ``"Tool result: "`` + ``str(content)`` (Python's repr of a list);
* a user message left with no content (only tool results, say) is dropped; an assistant one is not;
* a ``system`` message inside ``messages`` stays where it is (its text, billing header left out),
  unless the template refuses a system message after the first: then every one is appended to the
  leading system message (``merge_inline_system``, decided once by ``merges_inline_system``);
* ``tools`` are chat function tools (``input_schema`` the parameters, ``"type": "object"`` appended
  when it has no type; ``strict`` and ``defer_loading`` kept), after the ``tool_addition`` and
  ``tool_removal`` blocks of system messages are applied; ``tool_choice`` auto/any/none/tool is
  "auto"/"required"/"none"/the named function (``disable_parallel_tool_use`` the inverse of
  ``parallel_tool_calls``), "auto" when there are tools and none is given;
* ``output_config.effort`` is the ``reasoning_effort``; ``thinking`` of type ``disabled`` sets it
  to the effort the pod probed its template for (``disabled_thinking_effort``: "none" when the
  template renders "none" differently from every real effort, else "low"), ``enabled`` sets the
  ``thinking_token_budget`` (no change to the prompt), ``adaptive`` nothing;
* ``chat_template_kwargs``, ``cache_salt`` and the sampling fields carry over; no other chat field
  does (a Messages request has no ``chat_template``, ``add_generation_prompt`` or
  ``add_special_tokens``): the generation prompt is always added, even after a final assistant
  message (it is not continued), and no special tokens are added (as for a chat request).

Raises ``ChatTemplateError`` for what vLLM refuses with a 400 whatever the pod's flags (its request
model's checks, the tool changes' check, an empty conversation, a tool result's text that is not a
string), not for what depends on the pod's flags (tools with any choice but "none" and no tool
parser, a thinking budget with no reasoning parser, ``max_tokens`` over the model's length: the pod
answers those). Raises ``Unrenderable`` for what the router cannot render as vLLM does: an image (a
multimodal prompt), an empty ``tools`` list (vLLM hands the template ``tools=[]``, which a chat
request cannot carry; the tiny model's template renders it as no tools, others may not), and a
``thinking`` of type ``disabled`` when the pod's probed effort is not given.

The pod's own decisions, made once from its template (``merges_inline_system``,
``disabled_thinking_effort``), are parameters of ``chat_body``: the helpers below reproduce vLLM's
probes with the router's tokenizer. For the tiny test model both probes give vLLM's defaults
(inline system messages kept in place; thinking disabled is effort "none", which its template
renders as an empty think block).
"""

from __future__ import annotations

import json
import time
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from indexer.responses import Unrenderable
from indexer.tokens import ChatTemplateError, ServeChatFlags, Tokenizer, chat_request_ids

__all__ = ["EFFORTS", "Unrenderable", "chat_body", "disabled_thinking_effort", "merges_inline_system"]

_BILLING_HEADER = "x-anthropic-billing-header"
# the Anthropic efforts vLLM 0.32 knows (``AnthropicEffort``), in its order
EFFORTS = ("low", "medium", "high", "xhigh", "max")
_ROLES = ("user", "assistant", "system")
_BLOCK_TYPES = frozenset({"text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
                          "redacted_thinking", "tool_addition", "tool_removal"})
_TOOL_CHANGES = ("tool_addition", "tool_removal")
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_MIN_THINKING_BUDGET = 1024
# fields a chat request takes under the same name and meaning (a count_tokens request has only the first two)
_SAME = ("model", "chat_template_kwargs", "temperature", "top_p", "top_k", "cache_salt", "watermarking",
         "kv_transfer_params", "ec_transfer_params", "vllm_xargs")


def chat_body(body: dict[str, Any], *, merge_inline_system: bool = False,
              disabled_thinking_effort: str | None = "none", count_tokens: bool = False) -> dict[str, Any]:
    """The chat-completions body whose rendered prompt is the one vLLM 0.32 renders for the Messages
    request ``body`` (``count_tokens``: a ``/v1/messages/count_tokens`` body, which has no
    ``max_tokens``, stream or sampling fields). ``merge_inline_system`` and
    ``disabled_thinking_effort`` are what the pod decided from its chat template
    (``merges_inline_system``, ``disabled_thinking_effort`` below, or the pods'
    ``--anthropic-disabled-thinking-effort``); None for the effort when it is unknown (a disabled
    ``thinking`` is then ``Unrenderable``). ``ChatTemplateError`` for what vLLM refuses with a 400
    (as vLLM words it where it words it), ``Unrenderable`` for what the router cannot render."""
    if not isinstance(body, dict):
        raise ChatTemplateError("the request body must be a JSON object", param=None)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ChatTemplateError("Model is required", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ChatTemplateError("'messages' must be a list of messages", param="messages")
    for i, msg in enumerate(messages):
        _check_message(msg, f"messages[{i}]")
    system = body.get("system")
    if system is not None:
        if not isinstance(system, (str, list)):
            raise ChatTemplateError("'system' must be a string or a list of content blocks", param="system")
        if isinstance(system, list):
            _check_blocks(system, "system", "system", changes_allowed=False)
    max_tokens = body.get("max_tokens")
    if not count_tokens:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise ChatTemplateError("'max_tokens' is required and must be an integer", param="max_tokens")
        if max_tokens <= 0:
            raise ChatTemplateError("max_tokens must be positive", param="max_tokens")
    thinking = _thinking(body.get("thinking"))
    if (not count_tokens and thinking is not None and thinking["type"] == "enabled"
            and not (isinstance(body.get("kv_transfer_params"), dict)
                     and body["kv_transfer_params"].get("do_remote_decode"))
            and thinking["budget_tokens"] >= max_tokens):
        raise ChatTemplateError("thinking.budget_tokens must be less than max_tokens", param="thinking")
    tool_choice = body.get("tool_choice")
    if tool_choice is not None:
        _check_tool_choice(tool_choice)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ChatTemplateError("'tools' must be a list of tools", param="tools")
        for i, tool in enumerate(tools):
            _check_tool(tool, f"tools[{i}]")
    output_config = body.get("output_config")
    if output_config is not None and not isinstance(output_config, dict):
        raise ChatTemplateError("'output_config' must be an object", param="output_config")
    effort = (output_config or {}).get("effort")
    if effort is not None and effort not in EFFORTS:
        raise ChatTemplateError(f"output_config.effort must be one of {', '.join(EFFORTS)}",
                                param="output_config.effort")
    stop = None if count_tokens else body.get("stop_sequences")   # a count request has none (and ignores one)
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ChatTemplateError("'stop_sequences' must be a list of strings", param="stop_sequences")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ChatTemplateError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")

    chat_messages = _system_message(system, messages, merge_inline_system)
    chat_messages += convert_messages(messages, merge_inline_system=merge_inline_system)
    if not chat_messages:
        raise ChatTemplateError("Cannot apply chat template to an empty conversation. Provide at least one message.",
                                param="messages")
    out: dict[str, Any] = {"messages": chat_messages}
    for key in _SAME[:2] if count_tokens else _SAME:
        if body.get(key) is not None:
            out[key] = body[key]
    if not count_tokens:
        out["max_tokens"] = max_tokens
        if stop is not None:
            out["stop"] = stop
        if body.get("stream"):
            out["stream"] = True
            out["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    fmt = (output_config or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("schema") is not None:  # structured output: no change to the prompt
        out["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt["schema"],
                                                                         "name": "json_schema"}}
    if effort is not None:
        out["reasoning_effort"] = effort
    if thinking is not None:
        if thinking["type"] == "disabled":
            if disabled_thinking_effort is None:
                raise Unrenderable("thinking disabled, and the effort the pod's template probe gives is unknown")
            out["reasoning_effort"] = disabled_thinking_effort
        elif thinking["type"] == "enabled":
            out["thinking_token_budget"] = thinking["budget_tokens"]
    if tool_choice is not None:
        out["parallel_tool_calls"] = not tool_choice.get("disable_parallel_tool_use")
        kind = tool_choice["type"]
        out["tool_choice"] = (_TOOL_CHOICES[kind] if kind in _TOOL_CHOICES
                              else {"type": "function", "function": {"name": tool_choice["name"]}})
    resolved = resolve_tools(tools, messages)
    if resolved is not None:
        if not resolved:
            raise Unrenderable("an empty tool list (vLLM renders it as tools=[], which a chat request cannot carry)")
        out["tools"] = [chat_tool(t) for t in resolved]
        out.setdefault("tool_choice", "auto")
    return out


# ---------------------------------------------------------------------------------------------
# the request's shape, checked as vLLM's request model checks it
# ---------------------------------------------------------------------------------------------

def _check_message(msg: Any, where: str) -> None:
    if not isinstance(msg, dict):
        raise ChatTemplateError(f"{where} must be an object", param="messages")
    role = msg.get("role")
    if role not in _ROLES:
        raise ChatTemplateError(f"{where}.role must be one of 'user', 'assistant' or 'system'", param="messages")
    content = msg.get("content")
    if isinstance(content, list):
        _check_blocks(content, f"{where}.content", "messages", changes_allowed=role == "system")
    elif not isinstance(content, str):
        raise ChatTemplateError(f"{where}.content must be a string or a list of content blocks", param="messages")


def _check_blocks(blocks: list[Any], where: str, param: str, changes_allowed: bool) -> None:
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        if not isinstance(block, dict) or block.get("type") not in _BLOCK_TYPES:
            raise ChatTemplateError(f"{at} must be a content block of a known type", param=param)
        for key, types in (("text", str), ("id", str), ("tool_use_id", str), ("name", str), ("thinking", str),
                           ("input", dict), ("content", (str, list)), ("source", dict)):
            if block.get(key) is not None and not isinstance(block[key], types):
                raise ChatTemplateError(f"{at}.{key} has the wrong type", param=param)
        if isinstance(block.get("content"), list) and not all(isinstance(i, dict) for i in block["content"]):
            raise ChatTemplateError(f"{at}.content must be a string or a list of objects", param=param)
        kind = block["type"]
        if kind not in _TOOL_CHANGES:
            continue
        if not changes_allowed:
            raise ChatTemplateError(f'{kind} blocks are only allowed in messages with role "system"', param=param)
        change = block.get("tool")
        if change is None:
            raise ChatTemplateError(f"tool is required for {kind} blocks", param=param)
        if not isinstance(change, dict) or change.get("type") not in ("tool_reference", "tool_definition"):
            raise ChatTemplateError(f"{at}.tool must be a tool_reference or a tool_definition", param=param)
        if kind == "tool_removal" and change["type"] != "tool_reference":
            raise ChatTemplateError("tool_removal only accepts a tool_reference", param=param)
        if change["type"] == "tool_reference" and not isinstance(change.get("name"), str):
            raise ChatTemplateError(f"{at}.tool.name must be a string", param=param)
        if change["type"] == "tool_definition":
            _check_tool(change.get("definition"), f"{at}.tool.definition", param)


def _check_tool(tool: Any, where: str, param: str = "tools") -> None:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise ChatTemplateError(f"{where} must be an object with a string 'name'", param=param)
    if not isinstance(tool.get("input_schema"), dict):
        raise ChatTemplateError("input_schema must be a dictionary", param=param)
    for key, types in (("description", str), ("strict", bool), ("defer_loading", bool)):
        if tool.get(key) is not None and not isinstance(tool[key], types):
            raise ChatTemplateError(f"{where}.{key} has the wrong type", param=param)


def _check_tool_choice(choice: Any) -> None:
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise ChatTemplateError("tool_choice.type must be one of 'auto', 'any', 'tool' or 'none'",
                                param="tool_choice")
    if choice["type"] == "tool" and not choice.get("name"):
        raise ChatTemplateError("tool_choice.name is required when type is 'tool'", param="tool_choice")
    if choice.get("name") is not None and not isinstance(choice["name"], str):
        raise ChatTemplateError("tool_choice.name must be a string", param="tool_choice")


def _thinking(thinking: Any) -> dict[str, Any] | None:
    if thinking is None:
        return None
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise ChatTemplateError("thinking.type must be one of 'enabled', 'disabled' or 'adaptive'", param="thinking")
    if thinking["type"] == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool):
            raise ChatTemplateError("thinking.budget_tokens is required and must be an integer", param="thinking")
        if budget < _MIN_THINKING_BUDGET:
            raise ChatTemplateError(f"thinking.budget_tokens must be at least {_MIN_THINKING_BUDGET}",
                                    param="thinking")
    return thinking


# ---------------------------------------------------------------------------------------------
# the conversion
# ---------------------------------------------------------------------------------------------

def _billing(text: str) -> bool:
    return text.startswith(_BILLING_HEADER)


def _system_text(content: Any) -> str | None:
    """The text of a system message: a string as it is, text blocks joined with no separator;
    None when there is none (a billing header, or nothing but empty or other blocks)."""
    if isinstance(content, str):
        return None if _billing(content) else content
    parts = [b["text"] for b in content if b.get("type") == "text" and b.get("text") and not _billing(b["text"])]
    return "".join(parts) if parts else None


def _system_message(system: Any, messages: list[dict[str, Any]], merge_inline_system: bool) -> list[dict[str, Any]]:
    """The leading system message: the top-level ``system`` (a string as it is, even with a billing
    header: the chat renderer strips that one's first line) and, when merging, every inline one."""
    parts: list[str] = []
    if isinstance(system, str) and system:
        parts.append(system)
    elif isinstance(system, list):
        parts += [b["text"] for b in system if b.get("type") == "text" and b.get("text") and not _billing(b["text"])]
    if merge_inline_system:
        parts += [t for m in messages if m["role"] == "system" and (t := _system_text(m["content"]))]
    return [{"role": "system", "content": "".join(parts)}] if parts else []


def convert_messages(messages: list[dict[str, Any]], *, merge_inline_system: bool = False) -> list[dict[str, Any]]:
    """The chat messages of a Messages request's ``messages`` (checked), in vLLM's order: a user
    message's tool results come before it."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        role, content = msg["role"], msg["content"]
        if role == "system":
            text = None if merge_inline_system else _system_text(content)
            if text:
                out.append({"role": "system", "content": text})
            continue
        chat: dict[str, Any] = {"role": role}
        if isinstance(content, str):
            chat["content"] = content
        else:
            parts: list[dict[str, Any]] = []
            calls: list[dict[str, Any]] = []
            reasoning: list[str] = []
            for block in content:
                _convert_block(block, role, parts, calls, reasoning, out)
            if reasoning:
                chat["reasoning"] = "".join(reasoning)
            if calls:
                chat["tool_calls"] = calls
            if len(parts) == 1:
                chat["content"] = parts[0]["text"]
            elif parts:
                chat["content"] = parts
        if role != "user" or "content" in chat:
            out.append(chat)
    return out


def _convert_block(block: dict[str, Any], role: str, parts: list[dict[str, Any]], calls: list[dict[str, Any]],
                   reasoning: list[str], out: list[dict[str, Any]]) -> None:
    kind = block["type"]
    if kind == "text" and block.get("text"):
        parts.append({"type": "text", "text": block["text"]})
    elif kind == "image" and block.get("source"):
        raise Unrenderable("an image block")
    elif kind == "thinking" and block.get("thinking") is not None:
        reasoning.append(block["thinking"])
    elif kind == "tool_use":
        calls.append({"id": block.get("id") or f"call_{int(time.time())}", "type": "function",
                      "function": {"name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})}})
    elif kind == "tool_result":
        if role == "user":
            out.extend(_tool_messages(block))
        else:
            given = block.get("content")
            parts.append({"type": "text", "text": f"Tool result: {str(given) if given else ''}"})
    # redacted_thinking, tool_reference, tool_addition, tool_removal and empty blocks: nothing


def _tool_messages(block: dict[str, Any]) -> list[dict[str, Any]]:
    """A user's ``tool_result`` block as tool messages: its text, then its tool references."""
    content = block.get("content")
    call_id = block.get("tool_use_id") or ""
    text = ""
    refs: list[dict[str, Any]] = []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts: list[str] = []
        for item in content:
            kind = item.get("type")
            if kind == "text":
                piece = item.get("text", "")
                if not isinstance(piece, str):
                    raise ChatTemplateError(f"sequence item {len(texts)}: expected str instance, "
                                            f"{type(piece).__name__} found", param="messages")
                texts.append(piece)
            elif kind == "image":
                source = item.get("source") or {}
                if not (isinstance(source, dict) and source.get("type") == "url" and not source.get("url")):
                    raise Unrenderable("an image in a tool result")
            elif kind == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    refs.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    out = [{"role": "tool", "tool_call_id": call_id, "content": text}]
    if refs:
        out.append({"role": "tool", "tool_call_id": call_id, "content": refs})
    return out


def resolve_tools(tools: list[dict[str, Any]] | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The tools in effect at the end of the conversation: ``tools`` with the ``tool_addition`` and
    ``tool_removal`` blocks of (system) messages applied in order; None when there are neither."""
    changes = [b for m in messages if isinstance(m["content"], list)
               for b in m["content"] if b["type"] in _TOOL_CHANGES]
    if not changes:
        return tools
    table = {t["name"]: t for t in tools or []}
    removed: set[str] = set()
    for block in changes:
        change = block["tool"]
        if change["type"] == "tool_definition":
            name = change["definition"]["name"]
            table[name] = change["definition"]
        else:
            name = change["name"]
            if name not in table:
                raise ChatTemplateError(f"{block['type']} references tool {name!r}, which is not declared in tools",
                                        param="messages")
            if block["type"] == "tool_addition":
                table[name] = {**table[name], "defer_loading": None}
        if block["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [t for name, t in table.items() if name not in removed]


def chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic tool as a chat function tool; a schema without a type gets ``"type": "object"``
    last (vLLM's request model adds it)."""
    schema = tool["input_schema"]
    if "type" not in schema:
        schema = {**schema, "type": "object"}
    return {"type": "function", "function": {"name": tool["name"], "description": tool.get("description"),
                                             "parameters": schema, "strict": tool.get("strict"),
                                             "defer_loading": tool.get("defer_loading")}}


# ---------------------------------------------------------------------------------------------
# what a pod decides once from its chat template
# ---------------------------------------------------------------------------------------------

_PROBE_CONVERSATION = [{"role": "system", "content": "t"}, {"role": "user", "content": "t"},
                       {"role": "system", "content": "t"}, {"role": "user", "content": "t"}]


def template_refuses_inline_system(chat_template: str | None) -> bool:
    """vLLM's probe of one template: it needs system messages first when rendering a system, user,
    system, user conversation fails in a bare sandbox (trim_blocks, lstrip_blocks, loop controls, and
    none of transformers' globals: a template calling ``raise_exception`` or ``strftime_now`` fails
    there), or when there is no template."""
    if not chat_template:
        return True
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    try:
        env.from_string(chat_template).render(messages=_PROBE_CONVERSATION, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


def merges_inline_system(tokenizer: Tokenizer, chat_template: str | None = None) -> bool:
    """Whether a pod merges inline system messages into the leading one (``merge_inline_system``):
    the probe above on the template it renders with no tools and with ``tools=[]`` (a tokenizer with
    named templates may pick "tool_use" for the latter); ``chat_template``: the pods'
    ``--chat-template``. A template the tokenizer cannot resolve counts as none."""
    resolve = getattr(tokenizer, "resolve_template", None)
    templates: list[str | None] = []
    no_tools: list[Any] = []
    for tools in (None, no_tools):
        try:
            templates.append(resolve(chat_template, tools) if resolve is not None else chat_template)
        except ChatTemplateError:
            templates.append(None)
    return any(template_refuses_inline_system(t) for t in templates)


def disabled_thinking_effort(tokenizer: Tokenizer, flags: ServeChatFlags | None = None,
                             configured: str = "auto") -> str:
    """The ``reasoning_effort`` a pod gives a request whose ``thinking`` is disabled: its
    ``--anthropic-disabled-thinking-effort`` unless "auto", else vLLM's probe: "low" when a user
    "Hi" fails to render with effort "none" or renders as with one of the real efforts (the template
    ignores "none"), "none" otherwise. ``flags``: the pods' chat serve flags."""
    if configured != "auto":
        return configured

    def render(effort: str) -> list[int] | None:
        try:
            return chat_request_ids({"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": effort},
                                    tokenizer, flags=flags)
        except Exception:  # noqa: BLE001 - as vLLM: any failure to render means "none" is not usable
            return None

    none = render("none")
    if none is None or any(render(effort) == none for effort in EFFORTS):
        return "low"
    return "none"
