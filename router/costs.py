"""What a request costs before and after tokenizing: a cheap estimate of its prompt tokens (charged
to the caller's bucket before any tokenizer runs) and the size of every prompt of a batch.

A completion may carry a batch of prompts (``"prompt": ["a", "<3M characters>"]``, or several
token-id lists); vLLM serves each as its own request, so all of them count for limits and for the
predicted prefill work, not only the first (which alone routes the request: its prefix is looked up).
Everything here is linear in the number of prompts, messages and JSON values, never in their
characters (``len`` of a str or a list is constant time).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from indexer.tokens import TEXT_PART_FIELD


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and (not v or isinstance(v[0], int))


def _text_chars(value: Any) -> int:
    """Characters of text in a chat message's content: a string, or a list of parts whose text the
    chat template renders (``text``, ``refusal``, ``thinking``, ...: the tokenizer's own table, so a
    part type it renders cannot slip past the estimate)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        total = 0
        for part in value:
            if isinstance(part, dict):
                kind = part.get("type")
                text = part.get(TEXT_PART_FIELD.get(kind, "text") if isinstance(kind, str) else "text")
                if isinstance(text, str):
                    total += len(text)
            elif isinstance(part, str):
                total += len(part)
        return total
    return 0


def _nested_chars(value: Any, depth: int = 6) -> int:
    """Characters of every string in ``value`` (tool calls, tool definitions: the template renders
    them as JSON), ``depth`` levels down; linear in the values, not their characters."""
    if isinstance(value, str):
        return len(value)
    if depth <= 0:
        return 0
    if isinstance(value, dict):
        return sum(len(k) + _nested_chars(v, depth - 1) for k, v in value.items() if isinstance(k, str))
    if isinstance(value, list):
        return sum(_nested_chars(v, depth - 1) for v in value)
    return 0


def _messages_chars(messages: Any) -> int:
    """Characters of text in a chat conversation's messages (their content, reasoning and tool calls)."""
    chars = 0
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict):
                chars += _text_chars(m.get("content"))
                for field in ("reasoning", "reasoning_content"):
                    if isinstance(m.get(field), str):
                        chars += len(m[field])
                if "tool_calls" in m:
                    chars += _nested_chars(m["tool_calls"])
    return chars


def estimate_prompt_tokens(kind: str, body: dict[str, Any], chars_per_token: float) -> int:
    """A cheap estimate of every prompt token of the request: token ids counted exactly, text at
    ``chars_per_token`` characters a token. Shapes the router will refuse count 0 (they get a 400)."""
    chars = 0
    ids = 0
    if kind == "responses":  # router/responses.py: instructions, input (a text or items) and tools
        for field in ("instructions", "input", "tools"):
            chars += _nested_chars(body.get(field))
    elif kind == "messages":  # router/messages.py: system, messages (their blocks) and tools
        for field in ("system", "messages", "tools"):
            chars += _nested_chars(body.get(field))
    elif kind == "chat":
        chars = _messages_chars(body.get("messages"))
        if "tools" in body:
            chars += _nested_chars(body["tools"])
    elif kind == "generate":  # router/generate.py: the prompt's token ids
        ids = len(body["token_ids"]) if isinstance(body.get("token_ids"), list) else 0
    elif kind == "chat_batch":  # router/chat_batch.py: conversations, rendered without tools
        conversations = body.get("messages")
        if isinstance(conversations, list):
            chars = sum(_messages_chars(c) for c in conversations)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            chars = len(prompt)
        elif isinstance(prompt, list):
            if _is_ids(prompt):
                ids = len(prompt)
            else:
                for p in prompt:
                    if isinstance(p, str):
                        chars += len(p)
                    elif isinstance(p, list):
                        ids += len(p)
    return ids + int(chars / chars_per_token)


def batch_rest(body: dict[str, Any]) -> list[Any]:
    """The prompts of a completion batch after the first (empty for a single prompt)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not _is_ids(prompt):
        return prompt[1:]
    return []


def batch_rest_tokens(body: dict[str, Any], encode: Callable[[str], list[int]] | None,
                      chars_per_token: float) -> int:
    """Prompt tokens of every prompt of a completion batch but the first: token-id lists by length,
    text through ``encode`` (the local tokenizer), or estimated when there is none (remote)."""
    total = 0
    for p in batch_rest(body):
        if isinstance(p, str):
            total += len(encode(p)) if encode is not None else int(len(p) / chars_per_token)
        elif isinstance(p, list):
            total += len(p)
    return total


def _input_size(value: Any, depth: int = 6) -> tuple[int, int]:
    """(token ids, characters) of every list of token ids and every string value in ``value``,
    ``depth`` levels down (keys not counted); linear in the values, not their characters."""
    if isinstance(value, str):
        return 0, len(value)
    if depth <= 0:
        return 0, 0
    if isinstance(value, list):
        if value and isinstance(value[0], int):
            return len(value), 0
        items: Any = value
    elif isinstance(value, dict):
        items = value.values()
    else:
        return 0, 0
    ids = chars = 0
    for v in items:
        i, c = _input_size(v, depth - 1)
        ids += i
        chars += c
    return ids, chars


def estimate_input_tokens(body: dict[str, Any], chars_per_token: float) -> int:
    """A cheap estimate of what a pooling request (vLLM's embeddings, pooling, classify, score and
    rerank routes) puts through the model: every list of token ids in the body by its length and
    every string at ``chars_per_token`` characters a token. The routes name their inputs in a dozen
    ways (``input``, ``messages``, ``text_1``/``text_2``, ``queries``, ``documents``, ...), so the
    whole body is counted, its few parameter strings with it."""
    ids, chars = _input_size({k: v for k, v in body.items() if k != "model"})
    return ids + int(chars / chars_per_token)
