"""Token ids for prompts: one small interface shared by the router and the simulated pod.

A prompt's KV blocks are named by its token ids, so the router must tokenize exactly as the engine
does. Implementations:

* ``ByteTokenizer``: one token per UTF-8 byte (ids 0-255) plus a few special ids. Needs no files;
  the default for the simulated pod, demos and tests.
* ``HFTokenizer``: a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library) and, beside it,
  ``tokenizer_config.json`` (special tokens, chat template), ``special_tokens_map.json`` and
  ``chat_template.jinja`` / ``additional_chat_templates/*.jinja`` (modern folders), read the way
  transformers reads them.

Chat requests become text the way vLLM 0.32 renders them (``chat_request_ids``): the messages are
normalised as vLLM's ``parse_chat_messages`` does (content parts joined with newlines, or kept as
parts for templates that loop over them; only the fields vLLM keeps; tool-call arguments parsed to
objects), tools as vLLM's pydantic ``model_dump`` gives them, the request's ``chat_template_kwargs``
merged with ``add_generation_prompt``, ``continue_final_message``, ``documents`` and
``reasoning_effort`` as vLLM merges them, and the template rendered in transformers' Jinja
environment (``tojson`` = ``json.dumps`` without HTML escaping or key sorting, ``strftime_now``,
loop controls, ``{% generation %}``), then encoded with the request's ``add_special_tokens``
(default false for chat). The pods' serve flags that change the rendering (``ServeChatFlags``:
``--chat-template``, read as vLLM reads it by ``load_chat_template``, replacing the tokenizer's
template; ``--chat-template-content-format``, replacing the format detected from the template;
``--default-chat-template-kwargs``; ``--exclude-tools-when-tool-choice-none``) come from the
router's settings of the same names.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Sequence
from copy import deepcopy
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from indexer.prefix_tokens import PrefixTokenCache

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ChatTemplateError(ValueError):
    """A chat request that cannot be rendered (bad shape, or the template refused it): a 400."""

    def __init__(self, message: str, param: str | None = "messages"):
        super().__init__(message)
        self.param = param


class MediaContent(ChatTemplateError):
    """A chat request with an image, audio, video or embeddings content part: vLLM serves it on a
    multimodal model (its placeholder tokens expanded by the model's processor, the blocks keyed with
    the media's hashes), which the router cannot reproduce. Not the client's fault: the router routes
    it without cache credit (``router.prompts.chat_tokens``); a text-only model's pod answers the 400."""


# ---------------------------------------------------------------------------------------------
# transformers' Jinja environment
# ---------------------------------------------------------------------------------------------

class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): renders its body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return str(caller())


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers replaces Jinja's tojson (which HTML-escapes <, >, &, ' and sorts keys)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox (as transformers renders chat templates), with its verdict on an
    attribute remembered per (type of the object, name): the verdict depends on nothing else
    (``is_internal_attribute`` and ``modifies_known_mutable`` test the object's type and the name),
    and a template asks the same few for every message (``message.get``). On an 8k-token chat
    follow-up of 16 messages the checks were about a third of the render (67 µs). Only attributes
    that exist get here, so the names are those of the types' own attributes; at most
    ``MAX_VERDICTS`` are kept all the same."""

    MAX_VERDICTS = 4096

    def __init__(self, **options: Any):
        super().__init__(**options)
        self._verdicts: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = super().is_safe_attribute(obj, attr, value)
            if len(self._verdicts) < self.MAX_VERDICTS:
                self._verdicts[key] = verdict
        return verdict


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


@lru_cache(maxsize=64)
def _compiled(source: str) -> tuple[jinja2.Template, dict[str, Any], frozenset[str], str]:
    """The compiled template, its globals as one dict (``_render``), its undeclared variables and
    its content format (cached by source)."""
    try:
        template = _ENV.from_string(source)
        ast = _ENV.parse(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template failed to compile: {exc}") from exc
    return template, dict(template.globals), frozenset(jinja2.meta.find_undeclared_variables(ast)), \
        _content_format(ast)


def _render(template: jinja2.Template, globals_: dict[str, Any], variables: dict[str, Any]) -> str:
    """``template.render(**variables)`` with the template's globals merged once, at compile time.
    Jinja keeps them as a ``ChainMap`` (the template's over the environment's) and walks it twice in
    every render (a merged copy, then a set of its names): 6 µs of a 13 µs render of one short
    message, 8 of 40 for an 8k-token follow-up of 8 messages. ``_ENV``'s globals are all set before
    any template is compiled. Errors are raised as ``render`` raises them."""
    env = template.environment
    context = env.context_class(env, {**globals_, **variables}, template.name, template.blocks, globals=globals_)
    try:
        return env.concat(template.root_render_func(context))
    except Exception:
        env.handle_exception()


# ---- content format: does the template loop over message content parts ("openai") or print it? --

def _unwrap(node: nodes.Node) -> nodes.Node:
    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            return node


def _names(node: nodes.Node, names: set[str], key: str | None = None) -> bool:
    """``node`` reads one of ``names`` (or, with ``key``, its ``key`` item/attribute), possibly
    through filters, tests and slices."""
    node = _unwrap(node)
    if key is None:
        return _is_name(node, names)
    if isinstance(node, nodes.Getitem):
        return _is_name(node.node, names) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    if isinstance(node, nodes.Getattr):
        return _is_name(node.node, names) and node.attr == key
    return False


def _is_name(node: nodes.Node, names: set[str]) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names


def _content_format(ast: nodes.Template) -> str:
    """vLLM's content-format detection (``_detect_content_format``): "openai" when the template loops
    over a message's ``content`` (directly, through a macro parameter, or over a variable named
    ``content``), else "string"."""
    aliases, todo = {"messages"}, deque(["messages"])
    while todo:
        name = todo.popleft()
        for assign in ast.find_all(nodes.Assign):
            if isinstance(assign.target, nodes.Name) and _names(assign.node, {name}) \
                    and assign.target.name not in aliases:
                aliases.add(assign.target.name)
                todo.append(assign.target.name)
    message_vars = {loop.target.name for loop in ast.find_all(nodes.For)
                    if isinstance(loop.target, nodes.Name) and _names(loop.iter, aliases)}
    in_macros: set[int] = set()
    macro_params: dict[int, set[str]] = {}
    for macro in ast.find_all(nodes.Macro):
        params = {a.name for a in macro.args}
        gets_content: set[str] = set()
        for call in ast.find_all(nodes.Call):
            if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args):
                    if i < len(macro.args) and _names(arg, message_vars, "content"):
                        gets_content.add(macro.args[i].name)
                for kw in call.kwargs:
                    if kw.key in params and _names(kw.value, message_vars, "content"):
                        gets_content.add(kw.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if gets_content:
                macro_params[id(loop)] = gets_content
    for loop in ast.find_all(nodes.For):
        if _names(loop.iter, message_vars, "content"):
            return "openai"
        if isinstance(loop.iter, nodes.Name):
            if loop.iter.name in macro_params.get(id(loop), ()):
                return "openai"
            if id(loop) not in in_macros and loop.iter.name == "content":
                return "openai"
    return "string"


# ---------------------------------------------------------------------------------------------
# vLLM's request normalisation (renderers/chat_utils.py parse_chat_messages, the pydantic models)
# ---------------------------------------------------------------------------------------------

# a text-like content part's type -> the field holding its text (router/costs.py estimates from the same)
TEXT_PART_FIELD = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                    "thinking": "thinking"}
# keys of vLLM's content-part types; a text part's other keys reach "openai"-format templates
_KNOWN_PART_KEYS = frozenset({"audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil",
                              "image_url", "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text",
                              "thinking", "type", "uuid", "video_embeds", "video_url"})
_BILLING_HEADER = "x-anthropic-billing-header"
_CONTINUE_WITH_GENERATION = ("continue_final_message and add_generation_prompt are not compatible. Use "
                             "continue_final_message when you want the model to continue the final message, and "
                             "add_generation_prompt when you want to add a header that will prompt it to start a new "
                             "assistant message instead.")


def _content_parts(content: Any, where: str) -> list[Any]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return content
    raise ChatTemplateError(f"{where}.content must be a string or a list of content parts")


# vLLM's multimodal part types (chat_utils.py MM_PARSER_MAP less its text types), and the keys that
# make a part without a type, or with a uuid, a media part (``_parse_chat_message_content_mm_part``)
_MEDIA_PART_TYPES = frozenset({"input_image", "image_url", "image_embeds", "audio_embeds", "video_embeds",
                               "prompt_embeds", "image_pil", "audio_url", "input_audio", "video_url"})
_MEDIA_PART_KEYS = _MEDIA_PART_TYPES - {"input_image"}


def is_media_part(part: Any) -> bool:
    """A content part vLLM parses as multimodal data (an image, audio, video or embeddings)."""
    if not isinstance(part, dict):
        return False
    kind = part.get("type")
    if kind in _MEDIA_PART_TYPES and part.get("uuid") is None:
        return True
    return (kind is None or part.get("uuid") is not None) and any(k in part for k in _MEDIA_PART_KEYS)


def without_media(messages: list[Any]) -> list[Any]:
    """``messages`` with their media content parts left out (``is_media_part``)."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(is_media_part(p) for p in content):
            m = {**m, "content": [p for p in content if not is_media_part(p)]}
        out.append(m)
    return out


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """vLLM drops Claude Code's per-request attribution line from system text parts."""
    out = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) \
            and part.get("type") == "text" else None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _parse_part(part: Any, openai: bool, where: str) -> Any:
    """One content part as a string ("string" format) or a part dict ("openai"); None to skip."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if openai else part
    if not isinstance(part, dict):
        raise ChatTemplateError(f"{where} must be a string or an object")
    kind = part.get("type")
    if kind in TEXT_PART_FIELD and part.get("uuid") is None:
        text = part.get(TEXT_PART_FIELD[kind])
        if text is None and kind in ("text", "refusal"):
            return None  # vLLM skips a text part without text
        if not isinstance(text, str):
            raise ChatTemplateError(f"{where}.{TEXT_PART_FIELD[kind]} must be a string")
        if not openai:
            return text
        return {"type": "text", "text": text, **{k: v for k, v in part.items() if k not in _KNOWN_PART_KEYS}}
    if kind == "tool_reference" and part.get("uuid") is None:
        name = part.get("name")
        return {"type": "tool_reference", "name": name} if openai else name
    error = MediaContent if is_media_part(part) else ChatTemplateError
    raise error(f"{where}: only text content parts can be tokenized here (got type {kind!r})")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """An assistant tool call as vLLM hands it to the template: pydantic's key order (id, function
    {arguments, name}, type, then the rest) and ``arguments`` parsed to an object ({} when it is
    missing, not JSON or not an object)."""
    if not isinstance(call, dict):
        raise ChatTemplateError("assistant tool_calls entries must be objects.", param="tool_calls")
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise ChatTemplateError("chat completions only support assistant tool_calls of type 'function'.",
                                param="tool_calls")
    if not isinstance(function.get("name"), str):
        raise ChatTemplateError(f"{where}.function.name must be a string", param="tool_calls")
    args = function.get("arguments")
    parsed: Any = {}
    if args:
        parsed = args
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = {}
        if not isinstance(parsed, dict):
            parsed = {}
    fn = {"arguments": parsed, "name": function["name"],
          **{k: v for k, v in function.items() if k not in ("arguments", "name")}}
    out: dict[str, Any] = {}
    if "id" in call:
        out["id"] = call["id"]
    out["function"] = fn
    if "type" in call:
        out["type"] = call["type"]
    out.update((k, v) for k, v in call.items() if k not in ("id", "function", "type"))
    return out


def conversation(messages: Any, content_format: str = "string") -> list[dict[str, Any]]:
    """Chat messages as vLLM 0.32 hands them to the chat template (``parse_chat_messages``): content
    as one string (text parts joined with "\\n", empty ones left out) or, for templates that loop
    over content parts ("openai"), a list of ``{"type": "text", "text": ...}``; only role, content, tool_calls,
    reasoning (and reasoning_content), tool_call_id, name, task and a developer's tools kept."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    openai = content_format == "openai"
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"{where} must be an object with a string 'role'")
        role = m["role"]
        content = m.get("content")
        if not openai and isinstance(content, str) and not content.startswith(_BILLING_HEADER):
            msg: dict[str, Any] = {"role": role, "content": content}  # what the parts below make of it
        else:
            parts = _content_parts(content, where)
            if role == "system":
                parts = _strip_billing_header(parts)
            # vLLM keeps a part only if it parses to something truthy: in the "string" format an
            # empty text ("" of any text type, a nameless tool_reference) is dropped, not joined in
            items = [p for p in (_parse_part(p, openai, f"{where}.content[{j}]") for j, p in enumerate(parts)) if p]
            msg = {"role": role, "content": items if openai else "\n".join(items)}
        if role == "assistant":
            calls = m.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise ChatTemplateError(f"{where}.tool_calls must be a list", param="tool_calls")
                if calls:  # an empty list is dropped (the template's plain assistant path)
                    msg["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
            reasoning = m.get("reasoning")
            if reasoning is None:
                reasoning = m.get("reasoning_content")  # renamed to reasoning by vLLM's request model
            if reasoning is not None:
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in m:
                msg["tool_call_id"] = m["tool_call_id"]
            if openai and all(isinstance(p, dict) and p.get("type") == "text" for p in items):
                msg["content"] = "\n".join(p.get("text", "") for p in items)
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if isinstance(m.get("task"), str):
            msg["task"] = m["task"]
        if role == "developer":
            msg["tools"] = m.get("tools")
        out.append(msg)
    return out


def _developer_as_system(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For templates that do not know the developer role, vLLM makes developer messages system
    messages and merges all system messages into one at the front."""
    conv = [{k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m["role"] == "developer" else m
            for m in conv]
    texts: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(conv):
        if m["role"] != "system":
            rest.append(m)
            continue
        if i > 0 or texts:
            merge = True
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if content:
            texts.append(content)
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest] if merge else conv


def tool_dicts(tools: Any) -> list[dict[str, Any]] | None:
    """Request ``tools`` as vLLM passes them to the template (``ChatCompletionToolsParam.model_dump``):
    ``{"type": "function", "function": {"name", "description", "parameters"[, "strict"][,
    "defer_loading"]}[, "defer_loading"]}`` in that key order, absent description/parameters as
    null, unknown keys dropped."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatTemplateError("'tools' must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise ChatTemplateError(f"{where} must be an object with a 'function' object", param="tools")
        if tool.get("type", "function") != "function":
            raise ChatTemplateError(f"{where}.type must be 'function'", param="tools")
        fn = tool["function"]
        for key, types, what in (("name", (str,), "a string"), ("description", (str, type(None)), "a string"),
                                 ("parameters", (dict, type(None)), "an object"),
                                 ("strict", (bool, type(None)), "a boolean"),
                                 ("defer_loading", (bool, type(None)), "a boolean")):
            if not isinstance(fn.get(key), types):
                raise ChatTemplateError(f"{where}.function.{key} must be {what}", param="tools")
        defer = tool.get("defer_loading")
        if not isinstance(defer, (bool, type(None))):
            raise ChatTemplateError(f"{where}.defer_loading must be a boolean", param="tools")
        f = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
        if fn.get("strict") is not None:
            f["strict"] = fn["strict"]
        fn_defer = fn.get("defer_loading") if fn.get("defer_loading") is not None else defer
        if fn_defer is not None:
            f["defer_loading"] = fn_defer
        out.append({"type": "function", "function": f, **({"defer_loading": defer} if defer is not None else {})})
    return out


def _merge(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``merge_kwargs``: overrides win unless they are None or "auto"."""
    return {**defaults,
            **{k: v for k, v in overrides.items() if v is not None and not (isinstance(v, str) and v == "auto")}}


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ChatTemplateError(f"'{key}' must be a boolean", param=key)
    return v


@dataclass(frozen=True)
class ServeChatFlags:
    """The vLLM serve flags that change how a pod renders a chat prompt, which no request shows:
    ``--default-chat-template-kwargs`` (merged under each request's chat_template_kwargs and switches,
    below the request's ``tools``: vLLM 0.32 renderers/online_renderer.py ``preprocess_chat`` merges
    ``merge_kwargs(defaults, {tools, tokenize})`` and then ``ChatParams.with_defaults`` puts the
    request's own kwargs over that) and ``--exclude-tools-when-tool-choice-none`` (a chat completion
    whose ``tool_choice`` is the string "none" renders without its tools: ``render_chat``; vLLM's
    ``/tokenize`` does not apply it), ``--chat-template`` (``chat_template``: the template's text, as
    ``load_chat_template`` reads the flag; it replaces the tokenizer's for every request without a
    template of its own, and wins over a ``chat_template`` in the kwargs: vLLM's ``ChatParams`` puts
    ``request.chat_template or default`` over them) and ``--chat-template-content-format``
    (``chat_template_content_format``: "string" or "openai" replace the format detected from the
    template, "auto"; the chat endpoint and ``/tokenize`` both apply these two).
    ``router.prompts.serve_chat_flags`` gives None when all are unset, and None costs nothing per
    request."""

    default_chat_template_kwargs: dict[str, Any] | None = None
    exclude_tools_when_tool_choice_none: bool = False
    chat_template: str | None = None
    chat_template_content_format: str = "auto"


def load_chat_template(value: str) -> str:
    """The text of vLLM's ``--chat-template`` as vLLM 0.32 reads the flag (renderers/chat_utils.py
    ``load_chat_template``): the file it names, else, when it holds a Jinja character ("{", "}" or a
    newline), the template itself. One with none that names no readable file is an error, as in vLLM;
    vLLM's built-in templates (``template_chatml.jinja`` and the like, found by name in its package)
    are not here: name their file. The template is compiled now, so that a broken one fails at start
    and not on every chat request. Raises ``ChatTemplateError``."""
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        if not any(c in value for c in "{}\n"):
            raise ChatTemplateError(f"chat_template {value!r} looks like a file path, but it cannot be read "
                                    f"({exc.strerror or exc}); vLLM's built-in templates are not known to the "
                                    "router: give the template file's path", param="chat_template") from exc
        text = value
    except ValueError as exc:  # a NUL character, or a file that is not UTF-8
        raise ChatTemplateError(f"chat_template cannot be read: {exc}", param="chat_template") from exc
    _compiled(text)
    return text


@dataclass
class ChatRequest:
    """What a chat request (``/v1/chat/completions`` or ``/tokenize`` with messages) asks of the
    chat template, merged as vLLM merges it."""

    messages: list[Any]
    template_kwargs: dict[str, Any]  # chat_template_kwargs merged with the request's own switches and tools
    chat_template: str | None
    add_special_tokens: bool
    content_format: str = "auto"  # "auto": detected from the template; "string" or "openai": the pods' flag

    @classmethod
    def from_body(cls, body: dict[str, Any], api: str = "chat", trust_request_template: bool = False,
                  flags: ServeChatFlags | None = None) -> ChatRequest:
        """``api`` "chat" (chat completions: ``documents`` and ``reasoning_effort`` count) or
        "tokenize" (vLLM's ``/tokenize``, which has neither). A template carried by the request
        (``chat_template``, or ``chat_template_kwargs.chat_template``) is refused unless
        ``trust_request_template``, as vLLM refuses it without ``--trust-request-chat-template``:
        rendering a client's template costs unbounded CPU (a ``chat_template`` in the operator's
        default kwargs is not the request's: vLLM checks only the request's). ``flags``: the pods'
        serve flags (``ServeChatFlags``)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ChatTemplateError("'messages' must be a non-empty list")
        if api == "tokenize":  # only the chat endpoint's request model renames it to reasoning
            messages = [{k: v for k, v in m.items() if k != "reasoning_content"}
                        if isinstance(m, dict) and "reasoning_content" in m else m for m in messages]
        add_generation_prompt = _flag(body, "add_generation_prompt", True)
        continue_final = _flag(body, "continue_final_message", False)
        if continue_final and body.get("add_generation_prompt"):
            raise ChatTemplateError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                                    param=None)
        if continue_final and add_generation_prompt:  # left at its default (true): transformers refuses
            raise ChatTemplateError(_CONTINUE_WITH_GENERATION, param="continue_final_message")
        user = body.get("chat_template_kwargs")
        if user is None:
            user = {}
        if not isinstance(user, dict):
            raise ChatTemplateError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        template = body.get("chat_template")
        if template is not None and not isinstance(template, str):
            raise ChatTemplateError("'chat_template' must be a string", param="chat_template")
        if not trust_request_template and (template is not None or user.get("chat_template") is not None):
            raise ChatTemplateError("Chat template is passed with request, but --trust-request-chat-template is not "
                                    "set. Refused request with untrusted chat template.", param="chat_template")
        if api == "chat" and body.get("tools") == []:
            raise ChatTemplateError("`tools` must not be an empty array. Either provide at least one tool or omit "
                                    "the field entirely.", param="tools")
        extra: dict[str, Any] = {"add_generation_prompt": add_generation_prompt,
                                 "continue_final_message": continue_final}
        if api == "chat":
            documents = body.get("documents")
            if documents is not None and not (isinstance(documents, list) and all(
                    isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents)):
                raise ChatTemplateError("'documents' must be a list of objects of strings", param="documents")
            effort = body.get("reasoning_effort")
            if effort is not None and not isinstance(effort, str):
                raise ChatTemplateError("'reasoning_effort' must be a string", param="reasoning_effort")
            extra.update(documents=documents, reasoning_effort=effort)
            if effort is not None and "enable_thinking" not in user:
                extra["enable_thinking"] = effort != "none"
        tools = tool_dicts(body.get("tools"))
        if flags is None:
            kwargs = _merge({"tools": tools}, _merge(user, extra))
        else:
            if flags.exclude_tools_when_tool_choice_none and api == "chat" and body.get("tool_choice") == "none":
                tools = None
            kwargs = _merge(_merge(flags.default_chat_template_kwargs or {}, {"tools": tools}), _merge(user, extra))
        kwargs.pop("tokenize", None)
        content_format = "auto"
        if flags is not None:
            template = template or flags.chat_template  # the pods' --chat-template, over the kwargs' one
            content_format = flags.chat_template_content_format
        template = template or kwargs.pop("chat_template", None)
        kwargs.pop("chat_template", None)
        if template is not None and not isinstance(template, str):
            raise ChatTemplateError("'chat_template' must be a string", param="chat_template")
        return cls(messages, kwargs, template, _flag(body, "add_special_tokens", False), content_format)


def tokenize_chat_body(body: dict[str, Any], model: str | None) -> dict[str, Any]:
    """A chat-completions body as the body of vLLM's ``POST /tokenize`` that renders the same prompt.

    ``/tokenize`` takes the chat fields as they are (tools, add_generation_prompt,
    continue_final_message, add_special_tokens, chat_template, chat_template_kwargs) but has no
    ``documents`` or ``reasoning_effort`` and does not rename ``reasoning_content``: those are
    carried the way the chat endpoint would merge them. Check the body with
    ``ChatRequest.from_body`` first.
    """
    messages = []
    for m in body["messages"]:
        if isinstance(m, dict) and "reasoning_content" in m:
            renamed = {k: v for k, v in m.items() if k != "reasoning_content"}
            if m["reasoning_content"] is not None and m.get("reasoning") is None:
                renamed["reasoning"] = m["reasoning_content"]
            m = renamed
        messages.append(m)
    out: dict[str, Any] = {"model": model, "messages": messages}
    for key in ("add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template", "tools"):
        if body.get(key) is not None:
            out[key] = body[key]
    kwargs = dict(body.get("chat_template_kwargs") or {})
    user_thinking = "enable_thinking" in kwargs
    if body.get("documents") is not None:
        kwargs["documents"] = body["documents"]
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort != "auto":
            kwargs["reasoning_effort"] = effort
        if not user_thinking:
            kwargs["enable_thinking"] = effort != "none"
    if kwargs:
        out["chat_template_kwargs"] = kwargs
    return out


# ---------------------------------------------------------------------------------------------
# rendering: transformers' apply_chat_template / render_jinja_template, as vLLM calls them
# ---------------------------------------------------------------------------------------------

# the named parameters of transformers' apply_chat_template: never template variables, always
# accepted by vLLM's kwargs filter (the rest of chat_template_kwargs only if the template reads them)
_HF_APPLY_PARAMS = frozenset({"self", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                              "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                              "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class _ChatRendering:
    """Chat rendering shared by the tokenizers: ``_templates`` (one template, named templates, or
    None), ``_default_template`` (an override, like vLLM's ``--chat-template``) and ``_special``
    (the special-token strings every template sees: bos_token, eos_token, ...)."""

    _templates: str | dict[str, str] | None
    _default_template: str | None = None
    _special: dict[str, str]

    def resolve_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        """transformers' ``get_chat_template``: a template name or source, else the tokenizer's own
        (of named ones, "tool_use" when there are tools, else "default")."""
        chat_template = chat_template if chat_template is not None else self._default_template
        templates = self._templates
        if isinstance(templates, dict):
            if chat_template is not None:
                return templates.get(chat_template, chat_template)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ChatTemplateError("This model has multiple chat templates with no default specified! Please "
                                    f"name one of {sorted(templates)} in 'chat_template'.", param="chat_template")
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ChatTemplateError("As of transformers v4.44, default chat template is no longer allowed, so you "
                                    "must provide a chat template if the tokenizer does not define one.",
                                    param="chat_template")
        return templates

    def compile_templates(self) -> None:
        """Compile the tokenizer's own templates now (a load-time cost), not on the first chat request:
        compiling a model's template took 10-40 ms, on the router's event loop for a small prompt.
        A template that does not compile is left to fail that request with its clear error."""
        templates = self._templates
        override = self._default_template
        sources = [override] if override is not None and not (isinstance(templates, dict) and override in templates) \
            else []
        sources += list(templates.values()) if isinstance(templates, dict) else [templates] if templates else []
        for source in sources:
            try:
                _compiled(source)
            except ChatTemplateError:
                pass

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True, *,
                            continue_final_message: bool | str = False, tools: Any = None, documents: Any = None,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        """The prompt text for ``messages``, as vLLM renders it (``kwargs``: chat_template_kwargs)."""
        return self._render_chat(messages, add_generation_prompt, continue_final_message, tools, documents,
                                 chat_template, "auto", kwargs)

    def render_chat(self, messages: Any, template_kwargs: dict[str, Any], chat_template: str | None = None,
                    content_format: str = "auto") -> str:
        """``apply_chat_template(messages, chat_template=chat_template, **template_kwargs)`` with the
        message content in ``content_format`` ("string" or "openai", as vLLM's
        ``--chat-template-content-format`` forces it; "auto": detected from the template). Its own
        argument, so that no key of a request's chat_template_kwargs can set it."""
        kwargs = dict(template_kwargs)
        return self._render_chat(messages, kwargs.pop("add_generation_prompt", True),
                                 kwargs.pop("continue_final_message", False), kwargs.pop("tools", None),
                                 kwargs.pop("documents", None), chat_template, content_format, kwargs)

    def _render_chat(self, messages: Any, add_generation_prompt: bool, continue_final_message: bool | str,
                     tools: Any, documents: Any, chat_template: str | None, forced_format: str,
                     kwargs: dict[str, Any]) -> str:
        source = self.resolve_template(chat_template, tools)
        template, globals_, variables, content_format = _compiled(source)
        conv = conversation(messages, content_format if forced_format == "auto" else forced_format)
        if any(m["role"] == "developer" for m in conv) and '"developer"' not in source \
                and "'developer'" not in source:
            conv = _developer_as_system(conv)
        # vLLM passes on only the kwargs the template reads (or transformers' own parameters)
        kwargs = {k: v for k, v in kwargs.items()
                  if (k in variables or k in _HF_APPLY_PARAMS) and k not in ("chat_template", "tokenize")}
        for reserved in ("messages", "conversation", "self"):
            if reserved in kwargs:
                raise ChatTemplateError(f"chat_template_kwargs may not set '{reserved}'", param="chat_template_kwargs")
        if kwargs.get("return_assistant_tokens_mask"):
            raise ChatTemplateError("`return_assistant_tokens_mask=True` requires `return_dict=True` and "
                                    "`tokenize=True`", param="chat_template_kwargs")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(_CONTINUE_WITH_GENERATION, param="continue_final_message")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ChatTemplateError("Tools should be a list of JSON schemas (objects).", param="tools")
        if documents is not None and not (isinstance(documents, list) and all(isinstance(d, dict) for d in documents)):
            raise ChatTemplateError("Documents should be a list of dicts with 'title' and 'text' keys!",
                                    param="documents")
        context = {**self._special, **{k: v for k, v in kwargs.items() if k not in _HF_APPLY_PARAMS}}
        final = None
        if continue_final_message:
            conv, final = _tag_final_message(conv, continue_final_message, source)
        try:
            text = _render(template, globals_, {"messages": conv, "tools": tools, "documents": documents,
                                                "add_generation_prompt": add_generation_prompt, **context})
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc
        except Exception as exc:  # a template's own TypeError, ValueError, ...: vLLM answers 400 as well
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        return _cut_at_tag(text, final) if final is not None else text  # final: set by continue_final_message


def _tag_final_message(conv: list[dict[str, Any]], field: bool | str, source: str) -> tuple[list[dict[str, Any]], str]:
    """transformers' continue_final_message: mark the end of the last message's text with a tag,
    so the rendered text can be cut right after it (no end-of-turn tokens)."""
    field = field if isinstance(field, str) else "content"
    conv = deepcopy(conv)
    final = conv[-1].get(field)
    if final is None:
        raise ChatTemplateError(f'continue_final_message is set but the final message has no "{field}" to continue!')
    if field not in source:
        raise ChatTemplateError(f'continue_final_message is set to "{field}" but this is not an accepted field in '
                                "the chat_template")
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if isinstance(block, dict) and "text" in block:
                final = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                break
        else:
            raise ChatTemplateError("continue_final_message is set but we could not find any text to continue in "
                                    "the final message!")
    else:
        conv[-1][field] = final + _CONTINUE_TAG
    return conv, final


def _cut_at_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError("continue_final_message is set but the final message does not appear in the chat "
                                "after applying the chat template!")
    at = text.rindex(tag)
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]  # the template kept the spacing
    return text[:at].rstrip()  # the template trimmed trailing space: so must we


def chat_request_ids(body: dict[str, Any], tokenizer: Tokenizer, api: str = "chat",
                     trust_request_template: bool = False, flags: ServeChatFlags | None = None) -> list[int]:
    """The prompt token ids vLLM computes for a chat request body (``api`` "chat" for
    /v1/chat/completions, "tokenize" for /tokenize; ``flags``: the pods' ``ServeChatFlags``).
    Raises ``ChatTemplateError`` (a 400)."""
    text, add_special_tokens = chat_text(body, tokenizer, api, trust_request_template, flags)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def chat_text(body: dict[str, Any], tokenizer: Tokenizer, api: str = "chat",
              trust_request_template: bool = False, flags: ServeChatFlags | None = None) -> tuple[str, bool]:
    """The rendered prompt of a chat request body and whether to add special tokens around it."""
    req = ChatRequest.from_body(body, api, trust_request_template, flags)
    if req.content_format == "auto":
        text = tokenizer.apply_chat_template(req.messages, chat_template=req.chat_template, **req.template_kwargs)
    else:  # the pods' --chat-template-content-format (a _ChatRendering tokenizer: ByteTokenizer, HFTokenizer)
        text = tokenizer.render_chat(req.messages, req.template_kwargs, req.chat_template,  # type: ignore[attr-defined]
                                     req.content_format)
    return text, req.add_special_tokens


def routing_encoder(tokenizer: Tokenizer, max_new_chars: int | None = None) -> Callable[[str, bool], Sequence[int]]:
    """``(text, add_special_tokens) -> tokens`` for routing: the prefix token cache's ``encode_cached``
    where the tokenizer has one (``HFTokenizer.cache_prefixes``), else ``encode``. With
    ``max_new_chars``, it raises ``indexer.prefix_tokens.NotCached`` rather than tokenize more than
    that many characters."""
    cache = getattr(tokenizer, "prefix_cache", None)
    if max_new_chars is None:
        return cache.encode_cached if cache is not None else tokenizer.encode
    from indexer.prefix_tokens import NotCached

    def bounded(text: str, add_special_tokens: bool) -> Sequence[int]:
        if cache is not None:
            return cache.encode_cached(text, add_special_tokens, max_new_chars)  # type: ignore[no-any-return]
        if len(text) > max_new_chars:
            raise NotCached
        return tokenizer.encode(text, add_special_tokens)

    return bounded


def completion_add_special_tokens(body: dict[str, Any]) -> bool:
    """A completion request's ``add_special_tokens`` (vLLM's default: true)."""
    return _flag(body, "add_special_tokens", True)


# ---------------------------------------------------------------------------------------------
# tokenizers
# ---------------------------------------------------------------------------------------------

@runtime_checkable
class Tokenizer(Protocol):
    """What the router and the simulated pod need of a tokenizer."""

    name: str
    vocab_size: int

    @property
    def eos_token_id(self) -> int | None: ...  # read-only here: ByteTokenizer's is always an int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True, **kwargs: Any) -> str: ...


class ByteTokenizer(_ChatRendering):
    """One token per UTF-8 byte; ids 256.. are special tokens. Needs no files.

    ``encode`` adds no BOS, so a text prefix always gives a token-id prefix (what prefix caching
    needs to show). ``decode`` drops special ids and replaces invalid UTF-8.
    """

    BOS = 256
    EOS = 257
    name = "byte"

    def __init__(self, chat_template: str | None = None):
        self.vocab_size = 258
        self.eos_token_id = self.EOS
        self._templates = chat_template or DEFAULT_CHAT_TEMPLATE
        self._special = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def token_str(self, token_id: int) -> str:
        if token_id == self.BOS:
            return "<s>"
        if token_id == self.EOS:
            return "</s>"
        return bytes([token_id]).decode("latin-1")


class HFTokenizer(_ChatRendering):
    """A Hugging Face ``tokenizer.json`` with what lies beside it, read as transformers reads a
    model folder: the chat template from ``chat_template.jinja`` (plus named ones in
    ``additional_chat_templates/``) or else ``tokenizer_config.json``'s ``chat_template``; special
    tokens from ``tokenizer_config.json`` and, when that has no ``added_tokens_decoder``,
    ``special_tokens_map.json``. ``chat_template`` overrides the folder's (vLLM's ``--chat-template``).
    A folder with no template at all gets ``DEFAULT_CHAT_TEMPLATE`` (where vLLM would refuse chat)."""

    def __init__(self, path: str | Path, chat_template: str | None = None):
        from tokenizers import Tokenizer as _HF

        p = Path(path)
        tok_file = p / "tokenizer.json" if p.is_dir() else p
        if not tok_file.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {tok_file}")
        folder = tok_file.parent
        self._tok = _HF.from_file(str(tok_file))
        from indexer.prefix_tokens import fast_encoder

        self._encode = fast_encoder(self._tok)  # lets go of the GIL, so a tokenize thread does not stall the loop
        self.name = str(folder.name or tok_file.name)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        cfg: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        self._special = _special_tokens(cfg, folder / "special_tokens_map.json")
        eos = self._special.get("eos_token")
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None
        self._default_template = chat_template
        self._templates = _folder_templates(folder, cfg) or DEFAULT_CHAT_TEMPLATE
        self.compile_templates()

    prefix_cache: PrefixTokenCache | None = None  # set by ``cache_prefixes``

    def cache_prefixes(self, **options: Any) -> Any:
        """Reuse the tokens of text prefixes seen before (``indexer/prefix_tokens.py``); returns the cache."""
        from indexer.prefix_tokens import PrefixTokenCache

        self.prefix_cache = PrefixTokenCache(self._tok, **options)
        return self.prefix_cache

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.prefix_cache is not None:
            return self.prefix_cache.encode(text, add_special_tokens)
        return self._encode(text, add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def token_str(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) or ""


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content") if isinstance(tok.get("content"), str) else None
    return tok if isinstance(tok, str) else None


def _special_tokens(cfg: dict[str, Any], map_file: Path) -> dict[str, str]:
    """transformers' ``special_tokens_map``: the named special tokens (bos_token, eos_token, ...) and
    any model-specific ``*_token`` entries, as strings."""
    raw = {k: v for k, v in cfg.items() if k in _SPECIAL_TOKEN_NAMES or k.endswith("_token")}
    extra = cfg.get("extra_special_tokens")
    if isinstance(extra, dict):
        raw.update(extra)
    if "added_tokens_decoder" not in cfg and map_file.is_file():
        legacy = json.loads(map_file.read_text(encoding="utf-8"))
        if isinstance(legacy, dict):
            raw.update({k: v for k, v in legacy.items() if k in _SPECIAL_TOKEN_NAMES or k.endswith("_token")})
    out = {}
    for key, value in raw.items():
        text = _token_text(value)
        if text is not None:
            out[key] = text
    return out


def _folder_templates(folder: Path, cfg: dict[str, Any]) -> str | dict[str, str] | None:
    """``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` take priority over
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{name, template}``)."""
    named: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        named["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            named[f.stem] = f.read_text(encoding="utf-8")
    if not named:
        template = cfg.get("chat_template")
        if isinstance(template, str):
            return template
        if isinstance(template, list):
            named = {t["name"]: t["template"] for t in template
                     if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
        elif isinstance(template, dict):
            named = {k: v for k, v in template.items() if isinstance(v, str)}
    if not named:
        return None
    return named["default"] if list(named) == ["default"] else named


def load_tokenizer(spec: str | None) -> Tokenizer:
    """``None``/``"byte"`` -> ByteTokenizer; a path to tokenizer.json (or its folder) -> HFTokenizer."""
    if spec in (None, "", "byte"):
        return ByteTokenizer()
    return HFTokenizer(spec)


class RemoteTokenizer:
    """Token ids from a pod's own ``POST /tokenize`` (vLLM applies its chat template there), cached.

    For deployments where the router has no tokenizer files: the pod's answer is exactly what the
    engine hashes. ``base_url`` comes from the router's configured fleet, never from a client.
    Results are kept in an LRU keyed by a 128-bit BLAKE2b digest of the request body, so a
    repeated system prompt or conversation costs one round trip, and bounded by entries
    (``cache_size``) and by token ids held (``max_tokens``; a list of Python ints is about 36 bytes
    a token, so ~72 MB at the default; an answer of more is not kept). Until 2026-12-06 the body
    itself was the key and entries the only bound: 4,096 bodies of up to ``max_body_bytes`` (8 MB).
    Raises ``RemoteTokenizeError`` on a non-2xx answer or a body without a ``tokens`` list.
    """

    def __init__(self, base_url: str, model: str, client: Any, cache_size: int = 4096,
                 max_tokens: int = 2_000_000):
        from collections import OrderedDict

        self.base_url = base_url.rstrip("/")
        self.model = model
        self._client = client  # an httpx.AsyncClient, owned by the caller
        self.cache_size = cache_size
        self.max_tokens = max_tokens
        self._cache: OrderedDict[bytes, list[int]] = OrderedDict()  # the body's digest -> its token ids
        self._held = 0  # token ids in ``_cache``
        self.hits = self.misses = 0

    async def encode(self, prompt: str, add_special_tokens: bool = True, salt: str | None = None) -> list[int]:
        return await self._tokenize({"model": self.model, "prompt": prompt, "add_special_tokens": add_special_tokens},
                                    salt)

    async def encode_chat(self, messages: Any, add_generation_prompt: bool = True, **fields: Any) -> list[int]:
        """``fields``: more of /tokenize's chat fields (tools, chat_template_kwargs, ...)."""
        return await self._tokenize({"model": self.model, "messages": messages,
                                     "add_generation_prompt": add_generation_prompt, **fields})

    async def encode_chat_request(self, body: dict[str, Any], salt: str | None = None) -> list[int]:
        """A chat-completions body's prompt ids (``tokenize_chat_body`` maps its fields)."""
        return await self._tokenize(tokenize_chat_body(body, self.model), salt)

    async def _tokenize(self, body: dict[str, Any], salt: str | None = None) -> list[int]:
        """``salt``: the request's ``cache_salt`` (not sent): its answer is cached under a digest keyed
        by the salt, which no unsalted body's digest (unkeyed) nor another salt's meets, so only
        requests of that salt are answered from it (docs/reliability.md, "Tenants that never share a
        prefix cache")."""
        import hashlib

        import orjson

        # key order matters (tools and kwargs dicts render in their own order): the body as sent is
        # what is hashed. A strong digest, not xxh3: a client chooses the body, and a body made to
        # collide with another would be answered the other's tokens.
        sent = orjson.dumps(body)
        if salt is None:
            key = hashlib.blake2b(sent, digest_size=16).digest()
        else:
            mac = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=32).digest()
            key = hashlib.blake2b(sent, digest_size=16, key=mac).digest()
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return hit
        self.misses += 1
        r = await self._client.post(f"{self.base_url}/tokenize", content=sent,
                                    headers={"content-type": "application/json"})
        if r.status_code // 100 != 2:
            raise RemoteTokenizeError(f"/tokenize answered {r.status_code}: {r.text[:200]}")
        try:
            tokens = r.json().get("tokens")
        except ValueError:
            tokens = None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise RemoteTokenizeError("/tokenize answer has no 'tokens' list of ints")
        if len(tokens) <= self.max_tokens:
            old = self._cache.pop(key, None)  # the same body asked twice at once: counted once
            if old is not None:
                self._held -= len(old)
            self._cache[key] = tokens
            self._held += len(tokens)
            while len(self._cache) > self.cache_size or self._held > self.max_tokens:
                _, old = self._cache.popitem(last=False)
                self._held -= len(old)
        return tokens


class RemoteTokenizeError(RuntimeError):
    """A pod's /tokenize failed or answered something unusable."""
