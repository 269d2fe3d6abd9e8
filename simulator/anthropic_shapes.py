"""Request checks and response bodies of vLLM 0.32's Anthropic Messages API (``POST /v1/messages``,
``POST /v1/messages/count_tokens``; vllm/entrypoints/anthropic/), pure functions, no I/O.

vLLM answers a Messages request by converting it to a chat-completions request and running that;
the simulator does the same with ``indexer.messages.chat_body``. Two error shapes, as vLLM's:

* what its pydantic request model refuses (FastAPI's request validation) is OpenAI-shaped, typed
  "Bad Request" (``ShapeError`` with ``VALIDATION_TYPE``, written by the server's usual path);
* what fails after it (the conversion, the chat serving layer: unknown model 404, too long a prompt
  or budget, the rendering) is Anthropic-shaped, ``{"type": "error", "error": {"type", "message"}}``
  with the real status (``MessagesError``), the message as ``str(exc)`` gives it (vLLM's validation
  errors append ``(parameter=..., value=...)``).

Bodies carry vLLM's exact field sets and order, as measured on its CPU engine (tiny model): a whole
answer is dumped with ``exclude_none`` (no ``stop_sequence`` unless one matched), stream events with
``exclude_unset``.
"""

from __future__ import annotations

from typing import Any

import orjson

from indexer.messages import Unrenderable
from indexer.messages import chat_body as messages_chat_body
from indexer.tokens import ChatTemplateError
from simulator.openai_shapes import ERROR_TYPES, VALIDATION_TYPE, ShapeError, check_object, validation_message

# failures of vLLM's conversion or rendering, not of its request model: chat_body raises them as
# ChatTemplateError too, vLLM answers them Anthropic-shaped (serving.py's ``_resolve_tools`` ValueError,
# the renderer's empty conversation, a tool result's join TypeError)
_AFTER_VALIDATION = ("Cannot apply chat template to an empty conversation", "which is not declared in tools",
                     "sequence item ")
EMPTY_CONVERSATION = _AFTER_VALIDATION[0]
_ROLES = ("user", "assistant", "system")
COUNT_TOKENS_FIELDS = frozenset({"model", "messages", "output_config", "system", "thinking", "tool_choice", "tools",
                                 "chat_template_kwargs"})
_STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


class MessagesError(ShapeError):
    """A failure vLLM answers Anthropic-shaped: ``{"type": "error", "error": {"type", "message"}}``."""

    @classmethod
    def of(cls, exc: ShapeError) -> MessagesError:
        """The chat serving layer's error as the Messages API answers it: its ``str`` with vLLM's
        ``(parameter=..., value=...)`` when the error carries a value."""
        message = exc.message
        if exc.value is not None and exc.param is not None:
            message = f"{message} (parameter={exc.param}, value={exc.value})"
        return cls(message, status=exc.status, param=exc.param, err_type=exc.err_type)


def error_body(status: int, message: str, err_type: str | None = None) -> bytes:
    """vLLM's ``translate_error_response``: the ErrorResponse's type and message, no param or code."""
    if err_type is None or err_type == VALIDATION_TYPE:
        err_type = ERROR_TYPES.get(status, "Error")
    return orjson.dumps({"type": "error", "error": {"type": err_type, "message": message}})


# --- request validation (AnthropicMessagesRequest / AnthropicCountTokensRequest) -----------------
def _input(value: Any) -> str:
    """pydantic's ``input`` as vLLM's validation handler prints it."""
    if isinstance(value, (dict, list)):
        return f"<{type(value).__name__} of {len(value)} items>"
    return str(value)


def _refused(kind: str, loc: str, msg: str, value: Any, ctx: dict | None = None) -> ShapeError:
    error: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": _input(value)}
    if ctx is not None:
        error["ctx"] = ctx
    return ShapeError(validation_message(error), param=loc, err_type=VALIDATION_TYPE)


def _value_error(loc: str, text: str, value: Any) -> ShapeError:
    return _refused("value_error", loc, f"Value error, {text}", value, {"error": ValueError(text)})


def _missing(body: dict, key: str) -> ShapeError:
    return _refused("missing", f"body.{key}", "Field required", body)


def _int_field(body: dict, key: str) -> int:
    """An int field as pydantic's lax mode reads JSON: ints, integral floats, numeric strings."""
    value = body[key]
    if isinstance(value, bool) or isinstance(value, int):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, float):
        raise _refused("int_from_float", f"body.{key}", "Input should be a valid integer, got a number with a "
                       "fractional part", value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise _refused("int_parsing", f"body.{key}", "Input should be a valid integer, unable to parse string "
                           "as an integer", value) from None
    raise _refused("int_type", f"body.{key}", "Input should be a valid integer", value)


def check_request(body: Any, count_tokens: bool = False) -> dict[str, Any]:
    """The checks of vLLM's request model a client most often fails, with its words (the rest are
    chat_body's, in the same shape); the body, its ``max_tokens`` made an int."""
    check_object(body)
    # pydantic's order: the fields as declared (each with its own validator), then the model validator
    if "model" not in body:
        raise _missing(body, "model")
    model = body["model"]
    if not isinstance(model, str):
        raise _refused("string_type", "body.model", "Input should be a valid string", model)
    if not model:
        raise _value_error("body.model", "Model is required", model)
    if "messages" not in body:
        raise _missing(body, "messages")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise _refused("list_type", "body.messages", "Input should be a valid list", messages)
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _refused("model_type", f"body.messages.{i}", "Input should be a valid dictionary or instance of "
                           "AnthropicMessage", msg, {"class_name": "AnthropicMessage"})
        if "role" not in msg:
            raise _missing(msg, f"messages.{i}.role")
        if msg["role"] not in _ROLES:
            raise _refused("literal_error", f"body.messages.{i}.role",
                           "Input should be 'user', 'assistant' or 'system'", msg["role"],
                           {"expected": "'user', 'assistant' or 'system'"})
        if "content" not in msg:
            raise _missing(msg, f"messages.{i}.content")
    if count_tokens:   # the fields AnthropicCountTokensRequest has; pydantic ignores the rest
        return {k: v for k, v in body.items() if k in COUNT_TOKENS_FIELDS}
    if "max_tokens" not in body:
        raise _missing(body, "max_tokens")
    body = {**body, "max_tokens": _int_field(body, "max_tokens")}
    if body["max_tokens"] <= 0:
        raise _value_error("body.max_tokens", "max_tokens must be positive", body["max_tokens"])
    salt = body.get("cache_salt")
    if isinstance(salt, str) and not 1 <= len(salt) <= 1024:
        kind, msg, ctx = (("string_too_short", "String should have at least 1 character", {"min_length": 1})
                          if not salt else
                          ("string_too_long", "String should have at most 1024 characters", {"max_length": 1024}))
        raise _refused(kind, "body.cache_salt", msg, salt, ctx)
    thinking = body.get("thinking")
    kv = body.get("kv_transfer_params")
    if (isinstance(thinking, dict) and thinking.get("type") == "enabled"
            and type(thinking.get("budget_tokens")) is int and thinking["budget_tokens"] >= 1024
            and not (isinstance(kv, dict) and kv.get("do_remote_decode"))
            and thinking["budget_tokens"] >= body["max_tokens"]):
        raise _value_error("body", "thinking.budget_tokens must be less than max_tokens", body)
    return body


def to_chat(body: Any, *, merge_inline_system: bool, disabled_thinking_effort: str,
            count_tokens: bool = False) -> dict[str, Any]:
    """The chat-completions body vLLM 0.32 runs for a Messages (or count_tokens) request: its request
    model's checks (a ``ShapeError`` typed "Bad Request"), then ``indexer.messages.chat_body`` (its
    conversion failures a ``MessagesError``; what the simulator cannot render, such as an image, a
    ``MessagesError`` saying so). A Messages body also gets ``max_completion_tokens``, as vLLM sets
    both (its budget errors name that one)."""
    body = check_request(body, count_tokens)
    try:
        chat = messages_chat_body(body, merge_inline_system=merge_inline_system,
                                  disabled_thinking_effort=disabled_thinking_effort, count_tokens=count_tokens)
    except ChatTemplateError as exc:
        text = str(exc)
        if any(marker in text for marker in _AFTER_VALIDATION):
            raise MessagesError(text, param=exc.param) from exc
        raise ShapeError(text, param=f"body.{exc.param}" if exc.param else "body",
                         err_type=VALIDATION_TYPE) from exc
    except Unrenderable as exc:
        raise MessagesError(f"Unsupported content: {exc} (the simulator does not render it)") from exc
    if not count_tokens:
        chat["max_completion_tokens"] = chat["max_tokens"]
    return chat


# --- answers ---------------------------------------------------------------------------------------
def stop_reason(finish_reason: str | None) -> str | None:
    """vLLM's ``_to_anthropic_stop_reason`` for a text answer with no stop string matched."""
    return _STOP_REASONS.get(finish_reason or "")


def usage(prompt_tokens: int, output_tokens: int, cached: int, created: int, details: bool) -> dict:
    """vLLM's ``_build_anthropic_usage``: ``input_tokens`` is the prompt less its cache reads and
    writes, and the cache fields are there, only with ``--enable-prompt-tokens-details``."""
    if not details:
        return {"input_tokens": prompt_tokens, "output_tokens": output_tokens}
    return {"input_tokens": max(0, prompt_tokens - cached - created), "output_tokens": output_tokens,
            "cache_creation_input_tokens": created, "cache_read_input_tokens": cached}


def message_body(rid: str, model: str, text: str, finish_reason: str | None, use: dict,
                 kv_transfer_params: dict | None = None) -> dict:
    """A whole answer (``model_dump(exclude_none=True)``): an empty text is one empty text block."""
    out: dict[str, Any] = {"id": rid, "type": "message", "role": "assistant",
                           "content": [{"type": "text", "text": text}], "model": model}
    reason = stop_reason(finish_reason)
    if reason is not None:
        out["stop_reason"] = reason
    out["usage"] = use
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = kv_transfer_params
    return out


def count_body(input_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "context_management": {"original_input_tokens": input_tokens}}


def event(data: dict) -> bytes:
    """One server-sent event: ``event: <type>`` then its JSON (no ``[DONE]``, no pings)."""
    return b"event: " + data["type"].encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def message_start(rid: str, model: str, prompt_tokens: int) -> dict:
    """Sent with the first token (it is made from the chat stream's role chunk), its usage the
    role chunk's: the whole prompt, no cache fields whatever the flags."""
    return {"type": "message_start", "message": {
        "id": rid, "type": "message", "role": "assistant", "content": [], "model": model, "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}


def content_block_start(index: int = 0) -> dict:
    return {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": index}


def text_delta(text: str, index: int = 0) -> dict:
    return {"type": "content_block_delta", "delta": {"type": "text_delta", "text": text}, "index": index}


def content_block_stop(index: int = 0) -> dict:
    return {"type": "content_block_stop", "index": index}


def message_delta(finish_reason: str | None, use: dict) -> dict:
    # the stream reports a finish with no reason as "stop" (``finish_reason or "stop"``)
    return {"type": "message_delta", "delta": {"stop_reason": stop_reason(finish_reason or "stop"),
                                               "stop_sequence": None}, "usage": use}


MESSAGE_STOP = {"type": "message_stop"}
