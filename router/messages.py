"""The Anthropic Messages API (``POST /v1/messages``) in front of vLLM 0.32 (docs/router.md, "The
Anthropic Messages API").

vLLM 0.32 turns a Messages request into a chat request and renders that;
``indexer.messages.chat_body`` builds the same chat body, and the router plans, books and relays
the request as it does a chat request (router/api.py ``proxy``), on any pod but a prefill pod (a
P/D sidecar runs its two legs for the chat and completion routes only: on a decode pod the decode
engine computes the whole request, ``router.disagg.computed_whole``). The body sent is the client's, as on the chat
route (its ``kv_transfer_params`` dropped, a key's ``cache_salt`` derived into it): vLLM keeps no
state for a Messages request, so any pod may serve the next. ``/v1/messages/count_tokens`` is a
pass-through route (router/passthrough.py).

Two of vLLM's renderings depend on the pods' chat template, which vLLM probes once at start-up:
whether a system message inside ``messages`` is merged into the leading one (a template that
refuses system messages after the first), and which ``reasoning_effort`` a disabled ``thinking``
takes. ``Rendering`` makes the same probes once, with the router's tokenizer and the pods' chat
settings, the first time a Messages request comes.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from indexer.messages import Unrenderable, chat_body, disabled_thinking_effort, merges_inline_system
from indexer.tokens import ChatTemplateError
from kvcommon.sse import MESSAGES_PATH
from router.costs import estimate_prompt_tokens
from router.disagg import computed_whole
from router.errors import APIError
from router.prompts import Unkeyed

PATH = MESSAGES_PATH
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
# a stream's first event: the message's id, its empty content and the prompt's token count (vLLM 0.32's
# ``message_stream_converter``), no token. vLLM builds it from the chat stream's first chunk, so it comes
# 0.1-5 ms before the first text delta (tiny CPU model); Anthropic's own API sends it as it takes the
# request. Either way the first token is the next event (router/dispatch.py)
STREAM_PREAMBLE = (b"event: message_start",)
log = logging.getLogger(__name__)


class Rendering:
    """The pods' two template decisions (``merge_inline_system``, ``disabled_thinking_effort``),
    probed once from the router's tokenizer; vLLM's defaults (kept in place, "none") when the router
    has no template of its own to probe (``tokenizer: remote``)."""

    def __init__(self) -> None:
        self.options: dict[str, Any] | None = None

    def probe(self, router: Any) -> dict[str, Any]:
        if self.options is None:
            tokenizer, flags = router.tokenizer, router.chat_flags
            options: dict[str, Any] = {"merge_inline_system": False, "disabled_thinking_effort": "none"}
            if hasattr(tokenizer, "resolve_template"):  # a template of its own (not ``tokenizer: remote``)
                try:
                    options = {"merge_inline_system": merges_inline_system(
                                   tokenizer, flags.chat_template if flags is not None else None),
                               "disabled_thinking_effort": disabled_thinking_effort(tokenizer, flags)}
                except Exception:  # a probe of the template is advice: keep vLLM's defaults
                    log.exception("probing the chat template for the Messages API failed; using vLLM's defaults")
            self.options = options
            log.info("Messages API rendering: %s", options)
        return self.options


class MessagesTurn:
    """One ``POST /v1/messages`` as the router plans it, as ``router.responses.Turn`` is one
    Responses request: the chat body it renders as (``view``), whether the router could render it
    (``keyed``), the pods it may go to, and the bytes sent (the client's, as the chat route sends
    them: ``body`` already holds the derived salt and no client ``kv_transfer_params``)."""

    __slots__ = ("body", "view", "keyed", "_raw")
    planned = "chat"  # the kind of request it is planned as
    rest = 0  # prompt tokens besides the rendered one (a chat batch's other conversations: router/chat_batch.py)

    def __init__(self, body: dict[str, Any], options: dict[str, Any], raw: bytes, changed: bool):
        self.body = body
        self._raw = orjson.dumps(body) if changed else raw
        try:
            self.view = chat_body(body, **options)
            self.keyed = True
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param=exc.param) from exc
        except Unrenderable:  # routed by its length alone (``estimate``)
            self.view = {k: body[k] for k in ("model", "cache_salt", "stream", "max_tokens") if k in body}
            self.keyed = False

    def estimate(self, chars_per_token: float) -> Unkeyed:
        """The prompt's length for a request the router cannot render (an image, say): its text at
        ``chars_per_token``, with no keys."""
        return Unkeyed([0] * estimate_prompt_tokens("messages", self.body, chars_per_token))

    pods = staticmethod(computed_whole)

    def sent(self, pod_id: str) -> bytes:
        return self._raw
