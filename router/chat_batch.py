"""vLLM 0.32's batch of chat conversations (``POST /v1/chat/completions/batch``) in front of the fleet
(docs/router.md, "Batches of chat conversations").

The body is a chat request whose ``messages`` is a list of conversations. vLLM renders each
conversation as a chat request of its own, built from every other field of the body, and runs them
on one engine side by side; the answer is one ``chat.completion`` with a choice per conversation and
the usage summed. Facts from vLLM 0.32's source (``OpenAIServingChatBatch``) and a probe of the real
engine, which this module's planning follows:

* the answer is always whole JSON: a ``stream: true`` is accepted and ignored;
* ``tools`` are not rendered (the batch renders with no tool definitions), so the tokens of a
  conversation are those of the same chat request without them;
* the prompt tokens of a batch are the sum of its conversations' (three conversations of 170, 181
  and 10 tokens sent alone: 361 in the batch's usage).

The router plans it as a completion batch is planned: the first conversation routes the request
(its prefix is looked up on each pod, and its blocks are credited to the pod chosen), and the
others count, uncached, at an estimate of their length (``router.costs``), for the prediction and
the caller's prompt-token bucket. A P/D sidecar runs its two legs for the chat and completion routes
alone, so on a decode pod a batch is computed whole by the decode engine (``router.disagg.computed_whole``). What
reaches the pod is the client's body, as on the chat route (its
``kv_transfer_params`` dropped, a key's ``cache_salt`` derived into it).
"""

from __future__ import annotations

from typing import Any

import orjson

from router.costs import estimate_prompt_tokens
from router.disagg import computed_whole
from router.errors import APIError

PATH = "/v1/chat/completions/batch"
# fields of the body the router's rendering of a conversation leaves out: vLLM renders a batch's
# conversations without tool definitions, and never streams its answer
UNRENDERED = frozenset({"messages", "tools", "tool_choice", "stream", "stream_options"})


class BatchTurn:
    """One batch as the router plans it, as ``router.responses.Turn`` is one Responses request: the
    chat body its first conversation renders as (``view``), the estimated prompt tokens of the other
    conversations (``rest``), the pods it may go to and the bytes sent."""

    __slots__ = ("view", "rest", "_raw")
    planned = "chat"

    def __init__(self, body: dict[str, Any], raw: bytes, changed: bool, chars_per_token: float):
        conversations = body.get("messages")
        if not isinstance(conversations, list) or not conversations:
            raise APIError(400, "'messages' must be a non-empty list of conversations, each a non-empty list "
                                "of messages", param="messages")
        for i, conversation in enumerate(conversations):
            if not isinstance(conversation, list) or not conversation:
                raise APIError(400, f"messages[{i}] must be a non-empty list of messages", param=f"messages.{i}")
        view = {k: v for k, v in body.items() if k not in UNRENDERED}
        view["messages"] = conversations[0]
        self.view = view
        self.rest = sum(estimate_prompt_tokens("chat", {"messages": c}, chars_per_token) for c in conversations[1:])
        self._raw = orjson.dumps(body) if changed else raw

    pods = staticmethod(computed_whole)

    def sent(self, pod_id: str) -> bytes:
        return self._raw
