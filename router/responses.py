"""The Responses API (``POST /v1/responses``, ``GET /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel``) in front of vLLM 0.32 (docs/router.md, "The Responses API").

A new Responses request is a generation like a chat request: ``indexer.responses.chat_body`` turns
it into the chat body that renders the same prompt, and the router plans, books and relays it as it
does a chat request (router/api.py ``proxy``), on any pod but a prefill pod (a P/D sidecar runs its
two legs for the chat and completion routes only: on a decode pod the decode engine computes the
whole turn, ``router.disagg.computed_whole``).

What a Responses request adds is state on one pod. vLLM stores a response in its own process (with
``VLLM_ENABLE_RESPONSES_API_STORE=1``), and a follow-up naming it (``previous_response_id``), a
retrieval or a cancellation must reach that pod: no other has it. The router keeps no table of
them; the response's id says where it is. vLLM takes a request's ``request_id`` as the response's
id, so the router sets it on every request it sends (a client's own ``request_id`` is replaced):
``resp_`` and 48 hex digits, the pod's tag, the caller's tag and 24 random digits (``ResponseIds``).
Any worker or replica can read it back, and a restart loses nothing.

The caller's tag binds a response to the API key that made it: a request naming another key's
response is answered 404, as vLLM answers an id it does not hold, whatever the id is worth
otherwise. Without it, one tenant holding another's response id could read that response, or
continue that conversation, through the router. A client may write any id it likes, but the
router reads its own tag from the key the request came with, so a forged id can only name a pod of
the fleet for the client's own requests, where vLLM answers 404 for an id it never stored.
Replacing the client's ``request_id`` also keeps one tenant from overwriting another's stored
response (vLLM's store is one dictionary by id).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import orjson

from indexer.responses import Unrenderable, chat_body
from indexer.tokens import ChatTemplateError
from router.costs import estimate_prompt_tokens
from router.errors import APIError
from router.pods import PodState
from router.prompts import Unkeyed

PATH = "/v1/responses"
POLICY = "responses"
ID_PREFIX = "resp_"
_TAG_HEX = 12
_RANDOM_HEX = 24
ID_CHARS = len(ID_PREFIX) + 2 * _TAG_HEX + _RANDOM_HEX
_HEX = frozenset("0123456789abcdef")
# a stream's events sent before the engine produces anything (vLLM 0.32 sends both at once, ~35 ms
# before the first token on the tiny CPU model): not the first token (router/dispatch.py)
STREAM_PREAMBLE = (b"event: response.created", b"event: response.in_progress", b"event: response.queued")


def _tag(domain: bytes, value: str) -> str:
    return hashlib.sha256(domain + value.encode("utf-8", "surrogatepass")).hexdigest()[:_TAG_HEX]


def pod_tag(pod_id: str) -> str:
    """A pod's tag in the ids of the responses it stores."""
    return _tag(b"kvroute/response-pod/v1\x00", pod_id)


def caller_tag(caller: str) -> str:
    """An API key's tag (its ``name``; the open router's one caller is one tenant)."""
    return _tag(b"kvroute/response-caller/v1\x00", caller)


def mint(pod_id: str, caller: str) -> str:
    """A new response id: stored on ``pod_id``, readable by ``caller`` alone."""
    return f"{ID_PREFIX}{pod_tag(pod_id)}{caller_tag(caller)}{os.urandom(_RANDOM_HEX // 2).hex()}"


def not_found(response_id: str) -> APIError:
    """vLLM's answer for a response it does not hold."""
    shown = response_id if len(response_id) <= 200 and response_id.isprintable() else "<invalid>"
    return APIError(404, f"Response with id '{shown}' not found.", param="response_id")


def pod_of(response_id: Any, caller: str, pod_ids: Iterable[str]) -> str:
    """The pod among ``pod_ids`` that stores ``response_id`` for ``caller``; the 404 vLLM gives for
    an unknown id when the id is not one the router made, is another caller's, or names no pod of
    the fleet (a pod that left took its store with it)."""
    if not isinstance(response_id, str):
        raise APIError(400, "'previous_response_id' must be a string", param="previous_response_id")
    if (len(response_id) != ID_CHARS or not response_id.startswith(ID_PREFIX)
            or not _HEX.issuperset(response_id[len(ID_PREFIX):])):
        raise not_found(response_id)
    pod, owner = response_id[5:5 + _TAG_HEX], response_id[5 + _TAG_HEX:5 + 2 * _TAG_HEX]
    if owner != caller_tag(caller):
        raise not_found(response_id)
    for pod_id in pod_ids:
        if pod_tag(pod_id) == pod:
            return pod_id
    raise not_found(response_id)


class Turn:
    """One ``POST /v1/responses`` as the router plans it: the chat body it renders as (``view``),
    whether that rendering is its whole prompt (``keyed``: not when it continues a stored response,
    which only its pod holds, or when the router cannot render it), the one pod a continuation must
    go to (``pinned``), and the bytes sent to each pod, with the response id minted for that pod."""

    __slots__ = ("body", "caller", "view", "keyed", "pinned")
    planned = "chat"  # the kind of request it is planned as
    rest = 0  # prompt tokens besides the rendered one (a chat batch's other conversations: router/chat_batch.py)

    def __init__(self, body: dict[str, Any], caller: str, pod_ids: Callable[[], Iterable[str]]):
        self.body = body
        self.caller = caller
        previous = body.get("previous_response_id")
        self.pinned = pod_of(previous, caller, pod_ids()) if previous is not None else None
        try:
            self.view = chat_body(body)
            self.keyed = self.pinned is None
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param=exc.param) from exc
        except Unrenderable:  # routed by its length alone (``estimate``)
            self.view = {k: body[k] for k in ("model", "cache_salt", "stream") if k in body}
            if body.get("max_output_tokens") is not None:
                self.view["max_tokens"] = body["max_output_tokens"]
            self.keyed = False
        if body.get("background"):  # answered at once while the pod generates: its answer times no token
            self.view.pop("max_tokens", None)

    def estimate(self, chars_per_token: float) -> Unkeyed:
        """What the decision takes for the prompt of a turn it cannot key: its length in tokens at
        ``chars_per_token`` (for a continuation, of what the request carries: the stored
        conversation is on its pod, and its prefix is cached there anyway)."""
        return Unkeyed([0] * estimate_prompt_tokens("responses", self.body, chars_per_token))

    def pods(self, pod: PodState) -> bool:
        """Whether the turn may go to ``pod``: not a prefill pod (``router.disagg.computed_whole``),
        and for a continuation the one that stores the response."""
        return pod.config.role != "prefill" and (self.pinned is None or pod.id == self.pinned)

    def sent(self, pod_id: str) -> bytes:
        """The request as sent to ``pod_id``: with the response id the router made for it there."""
        self.body["request_id"] = mint(pod_id, self.caller)
        return orjson.dumps(self.body)


def stored_query(params: Mapping[str, str]) -> str:
    """The query of a retrieval as sent to the pod: vLLM's two parameters, checked and written
    afresh (``stream`` a boolean, ``starting_after`` a whole number), nothing else."""
    out = []
    stream = params.get("stream")
    if stream is not None:
        if stream.lower() not in ("true", "false", "1", "0"):
            raise APIError(400, "'stream' must be a boolean", param="stream")
        out.append(f"stream={'true' if stream.lower() in ('true', '1') else 'false'}")
    after = params.get("starting_after")
    if after is not None:
        if not (after.isascii() and after.isdigit() and len(after) <= 18):
            raise APIError(400, "'starting_after' must be a whole number", param="starting_after")
        out.append(f"starting_after={int(after)}")
    return "?" + "&".join(out) if out else ""
