"""Request bodies, encoded once before the run so that sending is a write of ready bytes."""

from __future__ import annotations

from typing import Any, Literal

import orjson

from replay.workloads import RequestSpec

Endpoint = Literal["completions", "chat"]

PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def encode_body(spec: RequestSpec, *, endpoint: Endpoint, model: str, ignore_eos: bool = True,
                extra_body: dict[str, Any] | None = None) -> bytes:
    """The JSON body of one streaming request.

    Completions bodies carry the prompt as token ids, spliced in from the bank's cached JSON
    fragments (no per-token work); chat bodies carry the prompt as text messages.
    """
    fields: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        fields["ignore_eos"] = True
        fields["min_tokens"] = spec.output_len
    if extra_body:
        fields.update(extra_body)
    if endpoint == "chat":
        fields["messages"] = spec.messages()
        return orjson.dumps(fields)
    if endpoint != "completions":
        raise ValueError(f"unknown endpoint {endpoint!r}; choose completions or chat")
    head = orjson.dumps(fields)
    return head[:-1] + b',"prompt":' + spec.prompt_json() + b"}"
