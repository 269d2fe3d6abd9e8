"""OpenAPI descriptions of the proxy routes' request bodies and answers.

The proxy routes read their body raw and never validate it with pydantic (that would cost every
request a model build and would reject fields newer vLLM versions accept); these schemas only
describe the API for clients and for schema-driven testing (``openapi_extra`` on the routes).
"""

from __future__ import annotations

from typing import Any

_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["integer", "string", "null"]}}}},
}

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}

_COMMON = {
    "model": {"type": "string", "description": "served model name"},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1},
    "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
    "stream": {"type": ["boolean", "null"]},
    "temperature": {"type": ["number", "null"], "minimum": 0},
    "top_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
    "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
    "seed": {"type": ["integer", "null"]},
}

COMPLETION_BODY = {
    "type": "object", "required": ["model", "prompt"], "additionalProperties": True,
    "properties": {**_COMMON, "prompt": {"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}, _TOKEN_IDS,
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1}]}},
}

CHAT_BODY = {
    "type": "object", "required": ["model", "messages"], "additionalProperties": True,
    "properties": {**_COMMON, "messages": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role"], "additionalProperties": True, "properties": {
            "role": {"type": "string", "enum": ["system", "user", "assistant", "tool", "developer"]},
            "content": {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
                "type": "object", "required": ["type"], "properties": {
                    "type": {"type": "string"}, "text": {"type": "string"}}}}]}}}}},
}

CHAT_BATCH_BODY = {
    "type": "object", "required": ["model", "messages"], "additionalProperties": True,
    "properties": {**_COMMON, "messages": {"type": "array", "minItems": 1,
                                           "description": "conversations, each answered as one choice",
                                           "items": CHAT_BODY["properties"]["messages"]}},  # type: ignore[index]
}

GENERATE_BODY = {
    "type": "object", "required": ["token_ids", "sampling_params"], "additionalProperties": True,
    "properties": {"model": _COMMON["model"], "stream": _COMMON["stream"],
                   "token_ids": {**_TOKEN_IDS, "description": "the prompt, as token ids"},
                   "sampling_params": {"type": "object", "description": "vLLM's SamplingParams",
                                       "properties": {"max_tokens": _COMMON["max_tokens"]}},
                   "cache_salt": {"type": ["string", "null"]}},
}

RESPONSES_BODY = {
    "type": "object", "required": ["model", "input"], "additionalProperties": True,
    "properties": {
        "model": _COMMON["model"], "stream": _COMMON["stream"], "temperature": _COMMON["temperature"],
        "top_p": _COMMON["top_p"], "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
        "instructions": {"type": ["string", "null"]},
        "previous_response_id": {"type": ["string", "null"],
                                 "description": "a response this router answered to the same API key"},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "object"}}]}},
}

_ANSWERS = {
    "200": "the pod's answer (JSON, or an SSE stream with `stream: true`)",
    "400": "malformed body or header", "401": "missing or wrong API key", "404": "unknown model",
    "413": "body over the size limit", "429": "objective unreachable or rate limit (see Retry-After)",
    "502": "pod unreachable or broken mid-answer", "503": "no healthy pod serves the model",
}


def openapi_body(kind: str) -> dict[str, Any]:
    """``openapi_extra`` for a route taking a completion (``completion``), chat (``chat``), chat batch
    (``chat_batch``), token-in (``generate``) or Responses (``responses``) body."""
    schema = {"chat": CHAT_BODY, "chat_batch": CHAT_BATCH_BODY, "generate": GENERATE_BODY,
              "responses": RESPONSES_BODY}.get(kind, COMPLETION_BODY)
    responses: dict[str, Any] = {}
    for code, text in _ANSWERS.items():
        media = ({"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}} if code == "200"
                 else {"application/json": {"schema": _ERROR}})
        responses[code] = {"description": text, "content": media}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": responses,
        "parameters": [
            {"name": "x-slo-ttft-ms", "in": "header", "required": False,
             "description": "this request's TTFT objective in milliseconds", "schema": {"type": "number"}},
            {"name": "x-priority", "in": "header", "required": False,
             "description": "critical or high: exempt from early rejection", "schema": {"type": "string"}},
        ],
    }
