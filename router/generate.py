"""vLLM 0.32's token-in generation API (``POST /inference/v1/generate``) in front of the fleet
(docs/router.md, "Token-in generation").

A client that renders its prompts itself (vLLM's ``/v1/chat/completions/render`` and
``/v1/completions/render``, or its own tokenizer) sends the prompt as ``token_ids``, with vLLM's
``sampling_params`` object, an optional ``model``, ``stream``, ``cache_salt`` and
``kv_transfer_params``. Token ids are the prompt vLLM runs, as they are, so the router keys them
exactly, with no tokenizer: it plans the request as the completion whose prompt is those ids
(``GenerateTurn.view``), books, credits and relays it as it does one, and sends the client's body.
The P/D sidecar runs its two legs for the chat and completion routes only and passes this route to
its decode engine, so on a decode pod the decode engine computes it whole
(``router.disagg.computed_whole``).
"""

from __future__ import annotations

from typing import Any

import orjson

from router.disagg import computed_whole
from router.errors import APIError
from router.prompts import is_token_list

PATH = "/inference/v1/generate"


class GenerateTurn:
    """One token-in request as the router plans it, as ``router.chat_batch.BatchTurn`` is a batch:
    the completion body with the same prompt (``view``, planned as kind ``planned``), the pods it may
    go to and the bytes sent."""

    __slots__ = ("view", "_raw")
    planned = "completion"
    rest = 0  # one prompt

    def __init__(self, body: dict[str, Any], raw: bytes, changed: bool):
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids or not is_token_list(ids) or min(ids) < 0:
            raise APIError(400, "'token_ids' must be a non-empty list of non-negative token ids", param="token_ids")
        params = body.get("sampling_params")
        if not isinstance(params, dict):
            raise APIError(400, "'sampling_params' must be an object (vLLM's SamplingParams)",
                           param="sampling_params")
        view: dict[str, Any] = {"prompt": ids}
        for key in ("model", "cache_salt", "stream"):
            if key in body:
                view[key] = body[key]
        for key in ("max_tokens", "prompt_logprobs"):  # what the plan reads of the sampling parameters
            if key in params:
                view[key] = params[key]
        self.view = view
        self._raw = orjson.dumps(body) if changed else raw

    pods = staticmethod(computed_whole)

    def sent(self, pod_id: str) -> bytes:
        return self._raw
