"""Request validation and response bodies in vLLM's OpenAI-server shapes (pure functions, no I/O).

Bodies are plain dicts validated by hand (no pydantic per request: this is the hot path); every
problem becomes a ``ShapeError`` carrying vLLM's error type, status and message.
"""

from __future__ import annotations

import time
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any

from indexer.tokens import ChatTemplateError, Tokenizer, chat_request_ids, completion_add_special_tokens

# vLLM's error type names, passed to kvcommon's one error builder (kvcommon/errors.py) by the server
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowed", 408: "RequestTimeout", 409: "ConflictError",
               413: "RequestEntityTooLarge", 422: "UnprocessableEntityError", 429: "RateLimitError",
               500: "InternalServerError", 501: "NotImplementedError", 502: "BadGateway",
               503: "ServiceUnavailableError", 504: "GatewayTimeout"}

MAX_TOKEN_ID = 2**32 - 1


class ShapeError(ValueError):
    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


@dataclass
class GenRequest:
    """What a validated completion/chat request asks of the engine."""

    kind: str  # "completion" or "chat"
    prompt_ids: list[int]
    max_tokens: int
    length_capped: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    kv_transfer_params: dict[str, Any] | None
    body_request_id: str | None
    ignore_eos: bool = False
    min_tokens: int = 0
    cache_salt: str | None = None   # folded into the first block's hash, as vLLM does
    lora: str | None = None         # the LoRA adapter the request named as its model


def _is_int(v: Any) -> bool:
    return type(v) is int


def _opt(body: dict, key: str, types: tuple, what: str) -> Any:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in types:
        raise ShapeError(f"'{key}' must be {what}", param=key)
    if not isinstance(v, types):
        raise ShapeError(f"'{key}' must be {what}", param=key)
    return v


def _token_list(value: list, key: str) -> list[int]:
    if not all(type(t) is int for t in value):
        raise ShapeError(f"'{key}' must be a string, a list of token ids or a list of one of those", param=key)
    if value and (min(value) < 0 or max(value) > MAX_TOKEN_ID):
        raise ShapeError(f"token ids in '{key}' must be in [0, {MAX_TOKEN_ID}]", param=key)
    return value


def prompt_ids_of(body: dict, tokenizer: Tokenizer) -> list[int]:
    """The completion prompt as token ids: a string, a token-id list, or a one-element list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ShapeError("'prompt' must not be empty", param="prompt")
        try:
            add_special = completion_add_special_tokens(body)
        except ChatTemplateError as exc:
            raise ShapeError(str(exc), param=exc.param) from exc
        return tokenizer.encode(prompt, add_special_tokens=add_special)
    if isinstance(prompt, list):
        if not prompt:
            raise ShapeError("'prompt' must not be empty", param="prompt")
        if isinstance(prompt[0], (str, list)):
            raise ShapeError("batched prompts (more than one per request) are not supported by the simulator",
                             param="prompt")
        return _token_list(prompt, "prompt")
    if prompt is None:
        raise ShapeError("'prompt' is required", param="prompt")
    raise ShapeError("'prompt' must be a string, a list of token ids or a list of one of those", param="prompt")


def chat_ids_of(body: dict, tokenizer: Tokenizer, api: str = "chat") -> list[int]:
    """A chat request's prompt ids, rendered as vLLM renders them (``indexer.tokens.chat_request_ids``;
    ``api`` "tokenize" for /tokenize's chat form, which takes no documents or reasoning_effort)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ShapeError("'messages' must be a non-empty list", param="messages")
    try:
        ids = chat_request_ids(body, tokenizer, api)
    except ChatTemplateError as exc:
        raise ShapeError(str(exc), param=exc.param) from exc
    if not ids:
        raise ShapeError("the rendered chat prompt is empty", param="messages")
    return ids


def parse_generation(body: Any, kind: str, tokenizer: Tokenizer, *, model: str, max_model_len: int,
                     default_max_tokens: int, max_prompt_tokens: int,
                     adapters: Container[str] = ()) -> GenRequest:
    if not isinstance(body, dict):
        raise ShapeError("request body must be a JSON object")
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise ShapeError("'model' must be a string", param="model")
    if name not in (None, "", model) and name not in adapters:
        raise ShapeError(f"The model `{name}` does not exist.", status=404, param="model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ShapeError("'stream' must be a boolean", param="stream")
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise ShapeError("'stream_options' must be an object", param="stream_options")
        if not stream:
            raise ShapeError("Stream options can only be defined when `stream=True`.", param="stream_options")
    n = body.get("n", 1)
    if n is not None and (not _is_int(n) or n < 1):
        raise ShapeError("'n' must be a positive integer", param="n")
    if n not in (None, 1):
        raise ShapeError("n > 1 is not supported by the simulator", param="n")
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        _opt(body, key, (int, float), "a number")
    for key in ("ignore_eos", "echo", "return_token_ids"):
        _opt(body, key, (bool,), "a boolean")
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise ShapeError("'kv_transfer_params' must be an object or null", param="kv_transfer_params")
    request_id = _opt(body, "request_id", (str,), "a string")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ShapeError("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")

    max_tokens = _opt(body, "max_tokens", (int,), "an integer")
    if kind == "chat":
        mct = _opt(body, "max_completion_tokens", (int,), "an integer")
        if mct is not None:
            max_tokens = mct
    if max_tokens is not None and max_tokens < 1:
        raise ShapeError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    min_tokens = _opt(body, "min_tokens", (int,), "an integer")
    if min_tokens is not None and (min_tokens < 0 or (max_tokens is not None and min_tokens > max_tokens)):
        raise ShapeError("min_tokens must be greater than or equal to 0 and less than or equal to max_tokens",
                         param="min_tokens")

    ids = prompt_ids_of(body, tokenizer) if kind == "completion" else chat_ids_of(body, tokenizer)
    n_prompt = len(ids)
    if n_prompt >= max_model_len:  # at least one output token must fit
        raise ShapeError(f"This model's maximum context length is {max_model_len} tokens. However, your "
                         f"request has {n_prompt} input tokens. Please reduce the length of the input "
                         f"messages.", param="messages" if kind == "chat" else "prompt")
    if n_prompt > max_prompt_tokens:
        raise ShapeError(f"The prompt ({n_prompt} tokens) needs more KV blocks than this pod has "
                         f"({max_prompt_tokens} tokens).", param="prompt")
    if max_tokens is None:
        capped = False
        max_tokens = max(1, min(default_max_tokens, max_model_len - n_prompt))
    else:
        capped = True
        if n_prompt + max_tokens > max_model_len:
            raise ShapeError(f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                             f"model's maximum context length is {max_model_len} tokens and your request "
                             f"has {n_prompt} input tokens ({max_tokens} > {max_model_len} - {n_prompt}).",
                             param="max_tokens")
    if body.get("ignore_eos"):
        capped = True
    if n_prompt + max_tokens > max_prompt_tokens:
        raise ShapeError(f"The prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) needs more KV blocks "
                         f"than this pod has ({max_prompt_tokens} tokens).", param="max_tokens")
    # vLLM 0.32 StreamOptions: include_usage and continuous_usage_stats both default to false
    include_usage = bool(stream_options.get("include_usage")) if stream_options else False
    continuous = (include_usage and bool(stream_options.get("continuous_usage_stats", False))
                  if stream_options else False)
    return GenRequest(kind, ids, max_tokens, capped, stream, include_usage, continuous, kv, request_id,
                      ignore_eos=bool(body.get("ignore_eos")), min_tokens=min_tokens or 0, cache_salt=salt,
                      lora=name if name in adapters else None)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, details: bool = True) -> dict:
    """vLLM's usage object; ``prompt_tokens_details`` only with ``details`` (vLLM's
    --enable-prompt-tokens-details), else null as vLLM sends it."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens} if details else None}


def completion_body(rid: str, model: str, text: str, finish_reason: str | None, use: dict,
                    kv_params: dict | None, created: int | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created or int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                         "stop_reason": None, "prompt_logprobs": None}],
            "service_tier": None, "system_fingerprint": None, "usage": use, "kv_transfer_params": kv_params}


def chat_body(rid: str, model: str, text: str, finish_reason: str | None, use: dict,
              kv_params: dict | None, created: int | None = None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created or int(time.time()), "model": model,
            "choices": [{"index": 0,
                         "message": {"role": "assistant", "content": text, "refusal": None,
                                     "annotations": None, "audio": None, "function_call": None,
                                     "tool_calls": [], "reasoning_content": None},
                         "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}],
            "service_tier": None, "system_fingerprint": None, "usage": use, "prompt_logprobs": None,
            "kv_transfer_params": kv_params}


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                         "stop_reason": None}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, model: str, created: int, kind: str, use: dict) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def models_body(model: str, max_model_len: int, created: int, adapters: Mapping[str, str] | None = None) -> dict:
    """vLLM's model list: the base model, then each LoRA adapter (``adapters``: name -> path) with the
    base as its ``parent`` and its path as its ``root``."""
    def card(name: str, root: str, parent: str | None) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": root,
                "parent": parent, "max_model_len": max_model_len,
                "permission": [{"id": f"modelperm-{name}", "object": "model_permission", "created": created,
                                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                                "organization": "*", "group": None, "is_blocking": False}]}
    return {"object": "list", "data": [card(model, model, None)] +
            [card(name, path, model) for name, path in (adapters or {}).items()]}
