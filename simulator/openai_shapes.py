"""Request validation and response bodies in vLLM's OpenAI-server shapes (pure functions, no I/O).

Bodies are plain dicts validated by hand (no pydantic per request: this is the hot path); every
problem becomes a ``ShapeError`` carrying vLLM's error type, status and message.
"""

from __future__ import annotations

import time
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from indexer.tokens import ChatTemplateError, Tokenizer, chat_request_ids, completion_add_special_tokens

# vLLM's error type names, passed to kvcommon's one error builder (kvcommon/errors.py) by the server
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowed", 408: "RequestTimeout", 409: "ConflictError",
               413: "RequestEntityTooLarge", 422: "UnprocessableEntityError", 429: "RateLimitError",
               500: "InternalServerError", 501: "NotImplementedError", 502: "BadGateway",
               503: "ServiceUnavailableError", 504: "GatewayTimeout"}

MAX_TOKEN_ID = 2**32 - 1


# the ``type`` vLLM's FastAPI handler gives a request that fails its pydantic model (bad JSON, a field
# of the wrong type): ``HTTPStatus.BAD_REQUEST.phrase`` (vllm/entrypoints/serve/exception_handling/
# handlers/validation.py), not the "BadRequestError" of the checks in its serving code
VALIDATION_TYPE = "Bad Request"

# The switches vLLM 0.32 types a plain ``bool`` (a default, not ``bool | None``): its pydantic model
# refuses a null for them (400, "Input should be a valid boolean") where the simulator's own checks,
# and the chat renderer's, take a null for the default. ChatCompletionRequest
# (vllm/entrypoints/openai/chat_completion/protocol.py) and CompletionRequest
# (vllm/entrypoints/openai/completion/protocol.py), with their sampling fields; ``echo`` is
# ``bool | None`` on a completion only.
_BOTH_NOT_NULL = ("add_special_tokens", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                  "spaces_between_special_tokens", "use_beam_search")
NOT_NULL_BOOLEANS = {"completion": _BOTH_NOT_NULL,
                     "chat": (*_BOTH_NOT_NULL, "add_generation_prompt", "continue_final_message", "echo",
                              "include_reasoning")}

# vLLM's CompletionRequest.max_tokens default (vllm/entrypoints/openai/completion/protocol.py)
COMPLETION_DEFAULT_MAX_TOKENS = 16


class ShapeError(ValueError):
    def __init__(self, message: str, status: int = 400, param: str | None = None, err_type: str | None = None,
                 value: Any = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type  # None: ERROR_TYPES[status]
        # the rejected value of a VLLMValidationError, which its str appends ("(parameter=..., value=...)"):
        # the Anthropic API's errors show it (simulator/anthropic_shapes.py), the OpenAI ones here do not
        self.value = value


def invalid(key: str, message: str) -> ShapeError:
    """A field that vLLM's pydantic request model would refuse: 400 "Bad Request", param ``body.<key>``
    (the cleaned ``loc`` of its first validation error)."""
    return ShapeError(message, param=f"body.{key}", err_type=VALIDATION_TYPE)


def validation_message(error: dict | str) -> str:
    """vLLM's message for one request-validation error: ``1 validation error:`` and the error dict
    (``validation_exception_handler``, with its ``loc`` joined by dots)."""
    return f"1 validation error:\n  {error}"


def error_input(value: Any) -> str:
    """A refused value as vLLM's validation handler shows it (``_summarize_error_input``): a container
    by its size, anything else as its text, cut at 200 characters."""
    if isinstance(value, (list, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text[:200] + "...[truncated]" if len(text) > 200 else text


def vllm_validation_error(message: str, param: str, value: Any = None) -> ShapeError:
    """A ``VLLMValidationError`` that reaches vLLM's exception handler as it is (raised outside a
    pydantic model's validation): "BadRequestError", its ``str`` naming the parameter and value."""
    extras = f"parameter={param}" + ("" if value is None else f", value={value}")
    return ShapeError(f"{message} ({extras})", param=param, value=value)


def chat_batch_conversations(body: dict) -> list[list]:
    """The conversations of a ``POST /v1/chat/completions/batch`` body, checked as vLLM 0.32's
    ``BatchChatCompletionRequest`` checks it (vllm/entrypoints/openai/chat_completion/protocol.py): its
    "before" model validator first (beam search, ``logprob_token_ids`` without ``logprobs``, a
    pre-tokenized prompt in ``kv_transfer_params``, ``n`` other than 1), whose errors reach the
    exception handler as they are; then its fields, as pydantic reports them ("Bad Request", every
    error): ``messages`` a non-empty list of non-empty lists, ``tool_choice`` "none" or null."""
    if body.get("use_beam_search"):
        raise vllm_validation_error("Batch chat completions do not support beam search. Please set "
                                    "`use_beam_search` to False.", "use_beam_search")
    if body.get("logprob_token_ids") and not body.get("logprobs"):
        raise vllm_validation_error("when using `logprob_token_ids`, `logprobs` must be set to true.",
                                    "logprob_token_ids")
    kv = body.get("kv_transfer_params")
    if isinstance(kv, dict) and kv.get("prompt_token_ids") is not None:
        raise vllm_validation_error("Batch chat completions do not support `kv_transfer_params['prompt_token_ids']`: "
                                    "one pre-tokenized prompt cannot serve several conversations.",
                                    "kv_transfer_params.prompt_token_ids")
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise vllm_validation_error("Batch chat completions do not support `n > 1`. Please set `n` to 1.", "n", n)

    def too_short(loc: str) -> dict:
        return {"type": "too_short", "loc": loc, "msg": "List should have at least 1 item after validation, not 0",
                "input": "<list of 0 items>", "ctx": {"field_type": "List", "min_length": 1, "actual_length": 0}}

    def not_list(loc: str, value: Any) -> dict:
        return {"type": "list_type", "loc": loc, "msg": "Input should be a valid list", "input": error_input(value)}

    errors: list[dict] = []
    messages = body.get("messages")
    if "messages" not in body:
        errors.append({"type": "missing", "loc": "body.messages", "msg": "Field required", "input": error_input(body)})
    elif not isinstance(messages, list):
        errors.append(not_list("body.messages", messages))
    elif not messages:
        errors.append(too_short("body.messages"))
    else:
        for i, conversation in enumerate(messages):
            if not isinstance(conversation, list):
                errors.append(not_list(f"body.messages.{i}", conversation))
            elif not conversation:
                errors.append(too_short(f"body.messages.{i}"))
    choice = body.get("tool_choice")
    if choice is not None and choice != "none":
        errors.append({"type": "literal_error", "loc": "body.tool_choice", "msg": "Input should be 'none'",
                       "input": error_input(choice), "ctx": {"expected": "'none'"}})
    if errors:   # vLLM reports the first ten, the first one's loc as the param
        label = "error" if len(errors) == 1 else "errors"
        message = f"{len(errors)} validation {label}:\n" + "".join(f"  {e}\n" for e in errors[:10])
        if len(errors) > 10:
            message += f"  ...and {len(errors) - 10} more {label}\n"
        raise ShapeError(message.rstrip(), param=errors[0]["loc"], err_type=VALIDATION_TYPE)
    return body["messages"]


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
    return_token_ids: bool = False  # vLLM's extra: prompt_token_ids / token_ids in the answer


def _is_int(v: Any) -> bool:
    return type(v) is int


def _opt(body: dict, key: str, types: tuple, what: str) -> Any:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in types:
        raise invalid(key, f"'{key}' must be {what}")
    if not isinstance(v, types):
        raise invalid(key, f"'{key}' must be {what}")
    return v


def _token_list(value: list, key: str) -> list[int]:
    if not all(type(t) is int for t in value):
        raise invalid(key, f"'{key}' must be a string, a list of token ids or a list of one of those")
    for i, t in enumerate(value):
        if t < 0:  # vLLM: list[Annotated[int, Field(ge=0)]], the first error's loc is prompt.<index>
            raise invalid(f"{key}.{i}", f"token ids in '{key}' must be in [0, {MAX_TOKEN_ID}]")
    if value and max(value) > MAX_TOKEN_ID:
        raise ShapeError(f"token ids in '{key}' must be in [0, {MAX_TOKEN_ID}]", param=key)
    return value


def prompt_ids_of(body: dict, tokenizer: Tokenizer) -> list[int]:
    """The completion prompt as token ids: a string, a token-id list, or a one-element list of either."""
    prompt = body.get("prompt")
    if prompt is None or prompt == "":
        # CompletionRequest.validate_prompt_and_prompt_embeds, a model validator: "Bad Request"
        raise ShapeError("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt",
                         err_type=VALIDATION_TYPE)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ShapeError("The decoder prompt cannot be empty", param=None)
        try:
            add_special = completion_add_special_tokens(body)
        except ChatTemplateError as exc:
            raise ShapeError(str(exc), param=exc.param) from exc
        return tokenizer.encode(prompt, add_special_tokens=add_special)
    if isinstance(prompt, list):
        if not prompt:
            raise ShapeError("The decoder prompt cannot be empty", param=None)
        if isinstance(prompt[0], (str, list)):
            raise ShapeError("batched prompts (more than one per request) are not supported by the simulator",
                             param="prompt")
        return _token_list(prompt, "prompt")
    raise invalid("prompt", "'prompt' must be a string, a list of token ids or a list of one of those")


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


def check_object(body: Any) -> None:
    """A body that is not a JSON object: what vLLM's pydantic request model says of it."""
    if not isinstance(body, dict):
        raise ShapeError(validation_message({
            "type": "model_attributes_type", "loc": "body",
            "msg": "Input should be a valid dictionary or object to extract fields from",
            "input": f"<{type(body).__name__} of {len(body)} items>" if isinstance(body, list) else str(body)}),
            param="body", err_type=VALIDATION_TYPE)


def parse_generation(body: Any, kind: str, tokenizer: Tokenizer, *, model: str, max_model_len: int,
                     default_max_tokens: int, max_prompt_tokens: int,
                     adapters: Container[str] = ()) -> GenRequest:
    """Check a request in vLLM 0.32's order: its pydantic model first (errors typed "Bad Request"),
    then the model name (404), the output budget against ``max_model_len``, the prompt's length, and
    the sampling parameters (``max_tokens`` clamped to what fits, as ``get_max_tokens`` does)."""
    check_object(body)
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise invalid("model", "'model' must be a string")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid("stream", "'stream' must be a boolean")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise invalid("stream_options", "'stream_options' must be an object")
    if stream_options and not stream:  # vLLM's validator tests truthiness: {} passes
        raise ShapeError("Stream options can only be defined when `stream=True`.", param="stream_options",
                         err_type=VALIDATION_TYPE)
    n = body.get("n", 1)
    if n is not None and not _is_int(n):
        raise invalid("n", "'n' must be an integer")
    if n is not None and n < 1:
        raise ShapeError(f"n must be at least 1, got {n}.", param="n")
    if n not in (None, 1):
        raise ShapeError("n > 1 is not supported by the simulator", param="n")
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        _opt(body, key, (int, float), "a number")
    for key in ("ignore_eos", "echo", "return_token_ids"):
        _opt(body, key, (bool,), "a boolean")
    for key in NOT_NULL_BOOLEANS[kind]:
        if key in body and body[key] is None:
            raise invalid(key, f"'{key}' must be a boolean")
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise invalid("kv_transfer_params", "'kv_transfer_params' must be an object or null")
    request_id = _opt(body, "request_id", (str,), "a string")
    salt = body.get("cache_salt")
    # validate_cache_salt (vllm/entrypoints/generate/base/protocol.py), run by a model validator: the
    # error is typed "Bad Request" and names the parameter itself
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ShapeError("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt",
                         err_type=VALIDATION_TYPE)
    if salt is not None and (len(salt) > 128 or any(ch in "@/\\\0" for ch in salt)):
        raise ShapeError("Parameter 'cache_salt' must be at most 128 characters and must not contain '@', "
                         "'/', '\\\\', or NUL.", param="cache_salt", err_type=VALIDATION_TYPE)
    max_tokens = _opt(body, "max_tokens", (int,), "an integer")
    budget_param = "max_tokens"
    if kind == "chat":
        mct = _opt(body, "max_completion_tokens", (int,), "an integer")
        if mct is not None:
            max_tokens, budget_param = mct, "max_completion_tokens"
    asked = max_tokens is not None   # the client set the budget: the simulated model never stops early
    if kind == "completion" and "max_tokens" not in body:
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS   # CompletionRequest.max_tokens = 16 (null: no limit)
    min_tokens = _opt(body, "min_tokens", (int,), "an integer") or 0

    # the serving layer: model, then TokenizeParams (output budget, prompt length), then SamplingParams
    if name not in (None, "", model) and name not in adapters:
        raise ShapeError(f"The model `{name}` does not exist. Valid aliases: {model}.", status=404, param="model")
    if max_tokens is not None and max_tokens > max_model_len:
        raise ShapeError(f"{budget_param}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
                         f"Please request fewer output tokens.", param=budget_param, value=max_tokens)
    text_prompt = kind == "chat" or not isinstance(body.get("prompt"), list) or (
        len(body["prompt"]) == 1 and isinstance(body["prompt"][0], str))
    ids = prompt_ids_of(body, tokenizer) if kind == "completion" else chat_ids_of(body, tokenizer)
    n_prompt = len(ids)
    if n_prompt > max_model_len:
        # a text prompt is tokenized with truncation to max_model_len + 1 tokens: "at least" that many
        said = f"at least {max_model_len + 1}" if text_prompt else str(n_prompt)
        raise ShapeError(f"This model's maximum context length is {max_model_len} tokens. However, your "
                         f"prompt contains {said} input tokens, which exceeds this limit even without any "
                         f"output tokens. Please reduce the length of the input prompt.", param="input_tokens",
                         value=max_model_len + 1 if text_prompt else n_prompt)
    room = max_model_len - n_prompt
    # get_max_tokens: what is asked, clamped to what fits (finishing 'length' there); nothing asked:
    # up to max_model_len, and the simulated model stops ('stop') after default_max_tokens
    limit = room if max_tokens is None else min(room, max_tokens)
    if limit < 1:
        raise ShapeError(f"max_tokens must be at least 1, got {limit}.", param="max_tokens")
    if min_tokens < 0:
        raise ShapeError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens > limit:
        raise ShapeError(f"min_tokens must be less than or equal to max_tokens={limit}, got {min_tokens}.")
    ignore_eos = bool(body.get("ignore_eos"))
    natural = max(default_max_tokens, min_tokens)   # where the simulated model samples its EOS
    if asked:
        max_tokens, capped = limit, True
    elif natural >= limit:
        max_tokens, capped = limit, True
    else:
        max_tokens, capped = natural, ignore_eos
    if n_prompt > max_prompt_tokens:
        raise ShapeError(f"The prompt ({n_prompt} tokens) needs more KV blocks than this pod has "
                         f"({max_prompt_tokens} tokens).", param="prompt")
    if n_prompt + max_tokens > max_prompt_tokens:
        raise ShapeError(f"The prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) needs more KV blocks "
                         f"than this pod has ({max_prompt_tokens} tokens).", param="max_tokens")
    # vLLM 0.32 should_include_usage: include_usage and continuous_usage_stats both default to false
    include_usage = bool(stream_options.get("include_usage")) if stream_options else False
    continuous = (include_usage and bool(stream_options.get("continuous_usage_stats", False))
                  if stream_options else False)
    return GenRequest(kind, ids, max_tokens, capped, stream, include_usage, continuous, kv, request_id,
                      ignore_eos=ignore_eos, min_tokens=min_tokens, cache_salt=salt,
                      lora=name if name in adapters else None, return_token_ids=bool(body.get("return_token_ids")))


# --- vLLM 0.32's token-in generation, ``POST /inference/v1/generate`` ------------------------------
# (vllm/entrypoints/scale_out/token_in_token_out/: protocol.py ``GenerateRequest`` and its response
# models, serving.py ``ServingTokens.serve_tokens``)
_BOOL_WORDS = {"0": False, "off": False, "f": False, "false": False, "n": False, "no": False,
               "1": True, "on": True, "t": True, "true": True, "y": True, "yes": True}


def _field_error(kind: str, loc: str, msg: str, value: Any, ctx: dict | None = None) -> dict:
    """One pydantic error as vLLM's validation handler prints it."""
    error: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": error_input(value)}
    if ctx is not None:
        error["ctx"] = ctx
    return error


def validation_errors(errors: list[dict]) -> ShapeError:
    """vLLM's 400 for a request its pydantic model refuses: every error (the first ten printed), the
    first one's ``loc`` as the param."""
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {e}\n" for e in errors[:10])
    if len(errors) > 10:
        message += f"  ...and {len(errors) - 10} more {label}\n"
    return ShapeError(message.rstrip(), param=errors[0]["loc"], err_type=VALIDATION_TYPE)


def _lax_int(value: Any, loc: str, errors: list[dict]) -> int | None:
    """An int as pydantic's lax mode reads JSON (booleans, integral floats, numeric strings)."""
    if isinstance(value, (bool, int)):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, float):
        errors.append(_field_error("int_from_float", loc, "Input should be a valid integer, got a number with a "
                                   "fractional part", value))
    elif isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            errors.append(_field_error("int_parsing", loc, "Input should be a valid integer, unable to parse "
                                       "string as an integer", value))
    else:
        errors.append(_field_error("int_type", loc, "Input should be a valid integer", value))
    return None


def _lax_bool(body: dict, key: str, errors: list[dict]) -> bool:
    """A ``bool | None`` field as pydantic's lax mode reads JSON (0/1, "yes", "off", ...); null: False."""
    value = body.get(key)
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _BOOL_WORDS:
        return _BOOL_WORDS[value.strip().lower()]
    if isinstance(value, (str, int, float)):
        errors.append(_field_error("bool_parsing", f"body.{key}", "Input should be a valid boolean, unable to "
                                   "interpret input", value))
    else:
        errors.append(_field_error("bool_type", f"body.{key}", "Input should be a valid boolean", value))
    return False


@dataclass
class TokenRequest:
    """A checked ``GenerateRequest``: ``view`` is the completion body with the same prompt (the token
    ids) and budget, for ``parse_generation``; the rest is what the route adds to it."""

    view: dict[str, Any]
    stream: bool
    request_id: str | None     # the body's; vLLM defaults it to a random_uuid
    text: bool                 # output_mode "text": the choices carry the detokenized text too
    reads_cache: bool          # False with prompt logprobs (SamplingParams.skip_reading_prefix_cache)
    late_error: str | None     # the engine's refusal of the prompt's length, raised once the request runs


def token_request(body: Any, *, model: str, max_model_len: int, adapters: Container[str] = ()) -> TokenRequest:
    """Check a token-in request in vLLM 0.32's order: ``validate_cache_salt`` (a "before" validator
    whose VLLMValidationError escapes pydantic as it is); the fields, every error collected ("Bad
    Request"), but ``SamplingParams.__post_init__``'s checks (``_verify_args``: n, max_tokens,
    min_tokens), which escape the same way when its object is well typed; the "after" validator
    (``output_mode`` "text" needs ``detokenize``); then ``serve_tokens``: the model (404), and, when
    ``max_tokens`` is not in ``sampling_params``, ``get_max_tokens`` (its ValueError: a 400 before any
    stream starts). Prompts of ``max_model_len`` tokens or more are the engine's refusal, raised once
    the request runs (``InputProcessor._validate_prompt_len``): ``late_error``."""
    check_object(body)
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise vllm_validation_error("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    if salt is not None and (len(salt) > 128 or any(ch in "@/\\\0" for ch in salt)):
        raise vllm_validation_error("Parameter 'cache_salt' must be at most 128 characters and must not contain "
                                    "'@', '/', '\\\\', or NUL.", "cache_salt")
    errors: list[dict] = []

    def not_string(key: str) -> None:
        if key in body and not isinstance(body[key], str) and (key == "request_id" or body[key] is not None):
            errors.append(_field_error("string_type", f"body.{key}", "Input should be a valid string", body[key]))

    not_string("request_id")
    ids: list[int] = []
    if "token_ids" not in body:
        errors.append(_field_error("missing", "body.token_ids", "Field required", body))
    elif not isinstance(body["token_ids"], list):
        errors.append(_field_error("list_type", "body.token_ids", "Input should be a valid list", body["token_ids"]))
    else:
        item_errors: list[dict] = []
        ids = [t for i, v in enumerate(body["token_ids"])
               if (t := _lax_int(v, f"body.token_ids.{i}", item_errors)) is not None]
        errors.extend(item_errors)
        if not item_errors and not ids:
            errors.append(_field_error("too_short", "body.token_ids", "List should have at least 1 item after "
                                       "validation, not 0", [], {"field_type": "List", "min_length": 1,
                                                                 "actual_length": 0}))
        elif not item_errors and min(ids) < 0:
            text = "token_ids must not contain negative values"
            errors.append(_field_error("value_error", "body.token_ids", f"Value error, {text}", body["token_ids"],
                                       {"error": ValueError(text)}))
    sp = body.get("sampling_params")
    ints: dict[str, int | None] = {}
    if "sampling_params" not in body:
        errors.append(_field_error("missing", "body.sampling_params", "Field required", body))
    else:
        # SamplingParams is a msgspec Struct: an instance of it, or a dict of its fields
        not_instance = _field_error("is_instance_of", "body.sampling_params", "Input should be an instance of "
                                    "SamplingParams", sp, {"class": "SamplingParams"})
        if not isinstance(sp, dict):
            errors += [not_instance, _field_error("dict_type", "body.sampling_params",
                                                  "Input should be a valid dictionary", sp)]
        else:
            sp_errors: list[dict] = []
            ints = {key: None if sp[key] is None and key == "max_tokens"
                    else _lax_int(sp[key], f"body.sampling_params.{key}", sp_errors)
                    for key in ("n", "max_tokens", "min_tokens") if key in sp}
            if sp_errors:
                errors += [not_instance, *sp_errors]
            else:   # the Struct is built: SamplingParams._verify_args
                n = ints.get("n", 1)
                if n is not None and n < 1:
                    raise ShapeError(f"n must be at least 1, got {n}.")
                limit = ints.get("max_tokens", 16)   # SamplingParams.max_tokens = 16 (null: none)
                if limit is not None and limit < 1:
                    raise vllm_validation_error(f"max_tokens must be at least 1, got {limit}.", "max_tokens", limit)
                least = ints.get("min_tokens") or 0
                if least < 0:
                    raise ShapeError(f"min_tokens must be greater than or equal to 0, got {least}.")
                if limit is not None and least > limit:
                    raise ShapeError(f"min_tokens must be less than or equal to max_tokens={limit}, got {least}.")
    not_string("model")
    return_ids = _lax_bool(body, "return_token_ids", errors)
    mode = body.get("output_mode", "tokens")
    if mode not in ("tokens", "text"):
        errors.append(_field_error("literal_error", "body.output_mode", "Input should be 'tokens' or 'text'", mode,
                                   {"expected": "'tokens' or 'text'"}))
    stream = _lax_bool(body, "stream", errors)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        errors.append(_field_error("model_attributes_type", "body.stream_options", "Input should be a valid "
                                   "dictionary or object to extract fields from", options))
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        errors.append(_field_error("dict_type", "body.kv_transfer_params", "Input should be a valid dictionary", kv))
    if errors:
        raise validation_errors(errors)
    assert isinstance(sp, dict)
    if mode == "text" and sp.get("detokenize") is False:
        text = "output_mode='text' requires sampling_params.detokenize to be true"
        raise validation_errors([_field_error("value_error", "body", f"Value error, {text}", body,
                                              {"error": ValueError(text)})])

    # serve_tokens
    name = body.get("model")
    if name not in (None, "", model) and name not in adapters:
        raise ShapeError(f"The model `{name}` does not exist. Valid aliases: {model}.", status=404, param="model")
    if ints.get("n", 1) != 1:
        raise ShapeError("n > 1 is not supported by the simulator", param="n")
    n_prompt, room = len(ids), max_model_len - len(ids)
    asked = "max_tokens" in sp   # the client's budget; otherwise get_max_tokens: what fits
    if not asked and room < 0:
        raise ShapeError(f"Input length ({n_prompt}) exceeds model's maximum context length ({max_model_len}).")
    late = None
    if room < 0:
        late = (f"The decoder prompt (length {n_prompt}) is longer than the maximum model length of "
                f"{max_model_len}. Make sure that `max_model_len` is no smaller than the number of text tokens.")
    elif room == 0:
        late = (f"The decoder prompt (length {n_prompt}) plus the number of requested output tokens (at least 1) "
                f"is longer than the maximum model length of {max_model_len}. Make sure that `max_model_len` is no "
                f"smaller than the number of text tokens (prompt + requested output tokens).")
    limit = ints.get("max_tokens") if asked else None
    # the engine stops at max_model_len ('length'): a budget past it is clamped to what fits
    view: dict[str, Any] = {"prompt": ids, "max_tokens": None if limit is None else min(limit, max(room, 1)),
                            "min_tokens": min(ints.get("min_tokens") or 0, max(room, 1)),
                            "ignore_eos": sp.get("ignore_eos") is True, "stream": stream,
                            "return_token_ids": return_ids}
    for key in ("model", "cache_salt", "kv_transfer_params"):
        if body.get(key) is not None:
            view[key] = body[key]
    if stream and options:
        view["stream_options"] = options
    skip = sp.get("skip_reading_prefix_cache")
    if skip is None:
        skip = sp.get("prompt_logprobs") is not None or sp.get("prompt_logprob_token_ids") is not None
    rid = body.get("request_id")
    return TokenRequest(view, stream, rid if isinstance(rid, str) else None, mode == "text", not skip, late)


def generate_body(request_id: str, model: str, created: int, text: str | None, token_ids: list[int],
                  finish_reason: str | None, use: dict, prompt_ids: list[int] | None, kv_params: dict | None) -> dict:
    """``GenerateTokensResponse`` (``text`` None) or ``GenerateTextResponse``, ``model_dump()``: every
    field, nulls included; a finish reason defaults to "stop"."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason or "stop", "stop_reason": None,
                              "token_ids": token_ids, "routed_experts": None, "sampling_mask": None,
                              "weight_versions": None}
    if text is not None:
        choice["text"] = text
    choice["logprobs"] = None
    return {"request_id": request_id, "model": model, "created": created, "usage": use, "prompt_logprobs": None,
            "prompt_token_id_logprobs": None, "prompt_token_ids": prompt_ids, "mm_placeholders": None,
            "metrics": None, "kv_transfer_params": kv_params, "ec_transfer_params": None,
            "output_mode": "tokens" if text is None else "text", "choices": [choice]}


def generate_chunk(request_id: str, text: str | None, token_ids: list[int], finish_reason: str | None,
                   use: dict | None = None, prompt_ids: list[int] | None = None) -> dict:
    """A ``GenerateTokensStreamResponse`` / ``GenerateTextStreamResponse`` token chunk: ``usage`` always
    there (null unless continuous usage), ``prompt_token_ids`` on the first chunk only, when asked."""
    out: dict[str, Any] = {"request_id": request_id, "usage": use}
    if prompt_ids is not None:
        out["prompt_token_ids"] = prompt_ids
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "stop_reason": None,
                              "token_ids": token_ids, "routed_experts": None, "sampling_mask": None,
                              "weight_versions": None}
    if text is not None:
        choice["text"] = text
    choice["logprobs"] = None
    out["output_mode"] = "tokens" if text is None else "text"
    out["choices"] = [choice]
    return out


def generate_usage_chunk(request_id: str, text_mode: bool, use: dict) -> dict:
    """The stream's final usage chunk (``include_usage``), dumped with ``exclude_none``."""
    return drop_none({"request_id": request_id, "usage": use, "output_mode": "text" if text_mode else "tokens",
                      "choices": []})


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, details: bool = True,
          created_cache_tokens: int | None = None) -> dict:
    """vLLM's ``UsageInfo`` as a whole answer dumps it (every field): ``prompt_tokens_details`` only
    with ``details`` (vLLM's --enable-prompt-tokens-details), else null; ``created_cache_tokens`` is
    set by the chat API only (vllm/entrypoints/openai/chat_completion/serving.py
    ``_make_prompt_tokens_details``), the completions API leaves it null."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens, "created_cache_tokens": created_cache_tokens,
                                      "multimodal_tokens": None} if details else None,
            "completion_tokens_details": None}


def drop_none(obj: Any) -> Any:
    """pydantic's ``exclude_none``: every null field left out, at any depth (lists kept as they are)."""
    if isinstance(obj, dict):
        return {k: drop_none(v) for k, v in obj.items() if v is not None}
    return obj


def running_usage(kind: str, prompt_tokens: int, completion_tokens: int) -> dict:
    """The ``usage`` of a chunk with ``continuous_usage_stats``: only the fields vLLM sets (dumped with
    ``exclude_unset``): the output tokens so far; the chat API also sets ``completion_tokens_details``."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                           "completion_tokens": completion_tokens}
    if kind == "chat":
        out["completion_tokens_details"] = None
    return out


def fingerprint(version: str, *parts: object) -> str:
    """vLLM's default (``--fingerprint-mode full``) ``system_fingerprint``: ``vllm-<version>-<hash8>``
    (vllm/entrypoints/serve/utils/fingerprint.py), the hash here over the pod's configuration."""
    import hashlib
    return f"vllm-{version}-{hashlib.sha256(repr(parts).encode()).hexdigest()[:8]}"


def completion_body(rid: str, model: str, text: str, finish_reason: str | None, use: dict,
                    kv_params: dict | None, created: int | None = None, fingerprint: str | None = None,
                    prompt_ids: list[int] | None = None, token_ids: list[int] | None = None) -> dict:
    """``CompletionResponse.model_dump()``: every field, nulls included."""
    return {"id": rid, "object": "text_completion", "created": created or int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                         "stop_reason": None, "token_ids": token_ids, "prompt_logprobs": None,
                         "prompt_token_ids": prompt_ids, "routed_experts": None}],
            "service_tier": None, "system_fingerprint": fingerprint, "usage": use,
            "kv_transfer_params": kv_params, "ec_transfer_params": None, "metrics": None}


def chat_body(rid: str, model: str, text: str, finish_reason: str | None, use: dict,
              kv_params: dict | None, created: int | None = None, fingerprint: str | None = None,
              prompt_ids: list[int] | None = None, token_ids: list[int] | None = None) -> dict:
    """``ChatCompletionResponse.model_dump()``: every field, nulls included, but the message's
    ``tool_calls`` left out when empty (``ChatMessage._serialize``); its reasoning is ``reasoning``."""
    return {"id": rid, "object": "chat.completion", "created": created or int(time.time()), "model": model,
            "choices": [chat_choice(0, text, finish_reason, token_ids)],
            "service_tier": None, "system_fingerprint": fingerprint, "usage": use, "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids, "prompt_text": None, "kv_transfer_params": kv_params,
            "ec_transfer_params": None, "metrics": None}


def chat_choice(index: int, text: str, finish_reason: str | None, token_ids: list[int] | None = None) -> dict:
    """One choice of a whole chat answer (``ChatCompletionResponseChoice``)."""
    return {"index": index,
            "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                        "function_call": None, "reasoning": None},
            "logprobs": None, "finish_reason": finish_reason, "stop_reason": None, "token_ids": token_ids,
            "routed_experts": None}


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                     prompt_ids: list[int] | None = None, token_ids: list[int] | None = None) -> dict:
    """A ``CompletionStreamResponse`` dumped with ``exclude_unset``: the choice's ``stop_reason``,
    ``prompt_token_ids`` and ``token_ids`` are set (null unless ``return_token_ids``)."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                         "stop_reason": None, "prompt_token_ids": prompt_ids, "token_ids": token_ids}]}


def chat_role_chunk(rid: str, model: str, created: int, prompt_ids: list[int] | None = None) -> dict:
    """The first chat chunk (``exclude_unset``): the role, empty content, and the response-level
    ``prompt_token_ids`` / ``prompt_text`` vLLM sets on it (null unless asked for)."""
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}],
            "prompt_token_ids": prompt_ids, "prompt_text": None}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None,
               token_ids: list[int] | None = None) -> dict:
    """A token chunk (``exclude_unset``): ``token_ids`` is set on every one, ``stop_reason`` on the
    one that finishes."""
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = None
    choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, created: int, kind: str, use: dict, fingerprint: str | None = None) -> dict:
    """The final usage chunk, dumped with ``exclude_none``: no null field at all (so no
    ``prompt_tokens_details`` without --enable-prompt-tokens-details); ``system_fingerprint`` on it."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return drop_none({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                      "usage": use, "system_fingerprint": fingerprint})


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


# --- the Responses API (vLLM 0.32: vllm/entrypoints/openai/responses/protocol.py) ------------------
# ``ResponsesResponse.from_request``: what a response echoes of its request, with the request's
# defaults (``ResponsesRequest``) where it sent nothing; the sampling fields are those of its
# SamplingParams (the model's defaults here: temperature and top_p 1.0, no penalties)
_RESPONSE_ECHO: tuple[tuple[str, Any], ...] = (
                  ("instructions", None), ("metadata", None), ("parallel_tool_calls", True), ("tools", []),
                  ("background", False), ("max_tool_calls", None), ("previous_response_id", None),
                  ("prompt", None), ("reasoning", None), ("service_tier", "auto"), ("text", None),
                  ("truncation", "disabled"), ("user", None))


def response_request_fields(body: dict) -> dict:
    """The fields of a response that come from its request ``body`` (sent or defaulted), computed once
    per request: ``tool_choice`` is "none" without tools when "auto" or "none" was asked
    (``ResponsesRequest.check_tool_usage``), the sampling numbers as floats."""
    out = {key: (default if body.get(key) is None else body[key]) for key, default in _RESPONSE_ECHO}
    if not out["tools"]:
        out["tools"] = []
    choice = body.get("tool_choice", "auto")
    out["tool_choice"] = "none" if not out["tools"] and choice in ("auto", "none") else choice

    def number(key: str, default: float) -> float:
        v = body.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default
    out.update(temperature=number("temperature", 1.0), top_p=number("top_p", 1.0),
               presence_penalty=number("presence_penalty", 0.0), frequency_penalty=number("frequency_penalty", 0.0))
    return out


def response_usage(input_tokens: int, output_tokens: int, cached_tokens: int, cache_write_tokens: int) -> dict:
    """``ResponseUsage`` as vLLM 0.32 fills it for a one-turn (plain text) response: the per-turn
    lists empty, no reasoning or tool tokens. Always there, whatever --enable-prompt-tokens-details."""
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": cache_write_tokens,
                                     "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
                                      "tool_output_tokens_per_turn": []},
            "total_tokens": input_tokens + output_tokens}


def output_text_part(text: str, logprobs: list | None = None) -> dict:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def output_message(item_id: str, text: str | None, status: str = "completed") -> dict:
    """The assistant message output item; ``text`` None: the item as a stream first adds it, no content."""
    return {"id": item_id, "content": [] if text is None else [output_text_part(text)], "role": "assistant",
            "status": status, "type": "message", "phase": None}


def response_object(rid: str, model: str, created_at: int, fields: dict, *, status: str, output: list,
                    use: dict | None, max_output_tokens: int | None) -> dict:
    """``ResponsesResponse.model_dump()`` in vLLM 0.32's field order (``fields``: from
    ``response_request_fields``); status "incomplete" (a length finish) carries its reason."""
    f = fields
    return {"id": rid, "created_at": created_at,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": f["instructions"], "metadata": f["metadata"], "model": model, "object": "response",
            "output": output, "parallel_tool_calls": f["parallel_tool_calls"], "temperature": f["temperature"],
            "tool_choice": f["tool_choice"], "tools": f["tools"], "top_p": f["top_p"], "background": f["background"],
            "max_output_tokens": max_output_tokens, "max_tool_calls": f["max_tool_calls"],
            "previous_response_id": f["previous_response_id"], "prompt": f["prompt"], "reasoning": f["reasoning"],
            "service_tier": f["service_tier"], "status": status, "text": f["text"], "top_logprobs": None,
            "truncation": f["truncation"], "usage": use, "user": f["user"],
            "presence_penalty": f["presence_penalty"], "frequency_penalty": f["frequency_penalty"],
            "kv_transfer_params": None, "ec_transfer_params": None, "input_messages": None, "output_messages": None}


def response_event(event: dict) -> bytes:
    """One server-sent event of a Responses stream: ``event: <type>`` then its JSON (no ``[DONE]`` ends
    the stream)."""
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


# a Responses stream's events, each with vLLM 0.32's exact field set (one output message, one text part)
def response_state_event(kind: str, response: dict, seq: int) -> dict:
    """``response.created`` / ``response.in_progress`` / ``response.completed``."""
    return {"response": response, "sequence_number": seq, "type": kind}


def output_item_event(kind: str, item: dict, seq: int) -> dict:
    """``response.output_item.added`` / ``.done``."""
    return {"item": item, "output_index": 0, "sequence_number": seq, "type": kind}


def content_part_event(kind: str, item_id: str, part: dict, seq: int) -> dict:
    """``response.content_part.added`` (text "", logprobs []) / ``.done`` (the text, logprobs null)."""
    return {"content_index": 0, "item_id": item_id, "output_index": 0, "part": part, "sequence_number": seq,
            "type": kind}


def text_delta_event(item_id: str, delta: str, seq: int) -> dict:
    return {"content_index": 0, "delta": delta, "item_id": item_id, "logprobs": [], "output_index": 0,
            "sequence_number": seq, "type": "response.output_text.delta"}


def text_done_event(item_id: str, text: str, seq: int) -> dict:
    return {"content_index": 0, "item_id": item_id, "logprobs": [], "output_index": 0, "sequence_number": seq,
            "text": text, "type": "response.output_text.done"}
