"""What one prefill leg can serve under vLLM's prefill/decode disaggregation, shared by the router
(which then plans the prefill on the decode pod) and the sidecar (which then runs no prefill leg)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _above_one(value: Any) -> bool:
    """Whether the engine (pydantic, lax) reads ``value`` as a count above 1: ``2``, ``2.0`` or ``"2"``."""
    if isinstance(value, bool):
        return False
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return False
    return isinstance(value, (int, float)) and value > 1


_TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})


def _true(value: Any) -> bool:
    """Whether the engine (pydantic, lax) reads ``value`` as ``true``: ``true``, ``1``, ``1.0`` or one
    of its words (``"true"``, ``"yes"``, ``"on"``, ... in any case)."""
    if isinstance(value, str):
        return value.lower() in _TRUE_WORDS
    return value is True or (isinstance(value, (int, float)) and value == 1)


def wants_prompt_logprobs(body: Mapping[str, Any], path: str) -> bool:
    """Whether vLLM computes prompt logprobs for ``body``, as its protocol sets them: ``prompt_logprobs``
    given, or ``echo`` with ``logprobs`` on a completion, ``echo`` alone on a chat completion (its
    ``top_logprobs`` defaults to 0, and null means 0). vLLM then reads no cached KV for the request,
    neither its own prefix cache nor a connector's (``skip_reading_prefix_cache``): the engine
    computes the whole prompt."""
    chat = path == "/v1/chat/completions"
    if not chat and path != "/v1/completions":
        return False
    if body.get("prompt_logprobs") is not None:
        return True
    return _true(body.get("echo")) and (chat or body.get("logprobs") is not None)


def drop_client_params(body: dict[str, Any]) -> bool:
    """Remove a client's ``kv_transfer_params`` from ``body`` (in place): the top-level one, whose
    ``remote_host`` would steer a NIXL read, and the one under ``vllm_xargs``. vLLM builds the
    engine's ``extra_args`` from ``vllm_xargs`` and puts the top-level ``kv_transfer_params`` over it
    only when that is truthy, so the nested one reaches the connector whenever no params are sent (a
    local or fallback prefill). vLLM's schema lets it be only a string, a number or a list, which no
    connector reads: with a NIXL connector ``[]``, ``""`` or ``0`` there stopped vLLM 0.32's engine
    core (one request, the whole pod down). ``ec_transfer_params`` under ``vllm_xargs`` too: vLLM
    reads it from the same ``extra_args`` and hands it to an encoder-cache connector, whose transfer
    the client must not steer either. True when anything was removed."""
    dropped = body.pop("kv_transfer_params", _ABSENT) is not _ABSENT
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and ("kv_transfer_params" in xargs or "ec_transfer_params" in xargs):
        body["vllm_xargs"] = {k: v for k, v in xargs.items() if k not in _CONNECTOR_KEYS}
        dropped = True
    return dropped


_CONNECTOR_KEYS = frozenset({"kv_transfer_params", "ec_transfer_params"})


_ABSENT = object()


def one_prefill_cannot_serve(body: Mapping[str, Any], path: str) -> str | None:
    """Why the prefill's one ``kv_transfer_params`` cannot serve ``body``, or None when it can.

    vLLM answers a completion with the ``kv_transfer_params`` of its first prompt only
    (``final_res_batch[0]`` in its serving_completion), and of one sequence, so the decoder would
    decode every prompt or choice on one prompt's KV blocks. ``several_prompts``: on
    ``/v1/completions`` a ``prompt`` list of more than one prompt (its first item a string or a list
    of token ids; a flat list of ints is one prompt), or more than one ``prompt_embeds``.
    ``several_choices``: ``n`` or ``best_of`` above 1. ``prompt_logprobs``: the request asks for
    prompt logprobs (``wants_prompt_logprobs``), so the decode engine reads none of the prefill's KV
    and computes the whole prompt again (vLLM 0.32, seen on real engines: ``external_kv_transfer`` 0,
    ``local_compute`` the prompt), and a prefill leg would only add its own prefill to the TTFT."""
    if path == "/v1/completions":
        prompt, embeds = body.get("prompt"), body.get("prompt_embeds")
        if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
            return "several_prompts"
        if isinstance(embeds, list) and len(embeds) > 1:
            return "several_prompts"
    if _above_one(body.get("n")) or _above_one(body.get("best_of")):
        return "several_choices"
    if wants_prompt_logprobs(body, path):
        return "prompt_logprobs"
    return None
