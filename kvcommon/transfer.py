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


def one_prefill_cannot_serve(body: Mapping[str, Any], path: str) -> str | None:
    """Why the prefill's one ``kv_transfer_params`` cannot serve ``body``, or None when it can.

    vLLM answers a completion with the ``kv_transfer_params`` of its first prompt only
    (``final_res_batch[0]`` in its serving_completion), and of one sequence, so the decoder would
    decode every prompt or choice on one prompt's KV blocks. ``several_prompts``: on
    ``/v1/completions`` a ``prompt`` list of more than one prompt (its first item a string or a list
    of token ids; a flat list of ints is one prompt), or more than one ``prompt_embeds``.
    ``several_choices``: ``n`` or ``best_of`` above 1."""
    if path == "/v1/completions":
        prompt, embeds = body.get("prompt"), body.get("prompt_embeds")
        if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
            return "several_prompts"
        if isinstance(embeds, list) and len(embeds) > 1:
            return "several_prompts"
    if _above_one(body.get("n")) or _above_one(body.get("best_of")):
        return "several_choices"
    return None
