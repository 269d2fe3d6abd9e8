"""The token ids of a request's prompt, tokenized the way the pods tokenize it.

Token-id prompts are used as they are. Text prompts and chat messages go through the configured
local tokenizer (chat via its chat template, then encoded without special tokens, as vLLM does for
chat), so the router's block keys match what the pods cache. For a batch of prompts the first one
routes the request.
"""

from __future__ import annotations

from typing import Any

from indexer.tokens import ChatTemplateError, Tokenizer
from router.errors import APIError


def is_token_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def completion_prompt(body: dict[str, Any]) -> list[int] | str:
    """The prompt that routes a completion: its token ids, or the text to tokenize (for a batch of
    prompts, the first one). Raises a 400 for anything else."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if is_token_list(prompt):
            return prompt
        first = prompt[0]
        if isinstance(first, str) and all(isinstance(p, str) for p in prompt):
            return first
        if is_token_list(first) and all(is_token_list(p) for p in prompt):
            return first
    if prompt is None:
        raise APIError(400, "'prompt' is required", param="prompt")
    raise APIError(400, "'prompt' must be a string, a list of strings, a list of token ids or a list of "
                   "token-id lists, and not empty", param="prompt")


def chat_messages(body: dict[str, Any]) -> list[Any]:
    """The chat messages of a request; a 400 unless they are a non-empty list."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    return messages


def completion_tokens(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    prompt = completion_prompt(body)
    return tokenizer.encode(prompt) if isinstance(prompt, str) else prompt


def chat_tokens(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    messages = chat_messages(body)
    add_generation_prompt = body.get("add_generation_prompt", True)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=bool(add_generation_prompt))
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_tokens(kind: str, body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    """``kind`` is "chat" or "completion"."""
    return chat_tokens(body, tokenizer) if kind == "chat" else completion_tokens(body, tokenizer)
