"""Prompt token ids from a pod's own ``POST /tokenize`` (setting ``tokenizer: remote``).

For fleets whose tokenizer files the router does not have: a healthy pod of the request's model
tokenizes the prompt (chat messages through the model's own chat template), so the router's block
keys are the ones the engine hashes. Answers are cached per pod (``indexer.tokens.RemoteTokenizer``,
a bounded LRU), and the pod asked is the first healthy one of the model by id, so a repeated system
prompt or conversation costs one round trip. Only pods of the configured fleet are ever asked; the
request's own fields choose nothing but the model, which must be one the fleet serves.

Tokenizing must never cost the client its answer: on a timeout or a bad answer the request is routed
on load alone (no prefix keys) with a length estimate, and ``kvroute_tokenize_failures`` counts it.
Token-id prompts are used as they are, with no round trip. Text prompts carry the request's
``add_special_tokens``; chat requests are checked as the local path checks them (a 400 for bad
input) and sent with every field that changes the rendered prompt (tools, chat_template_kwargs,
continue_final_message, add_special_tokens, chat_template; documents and reasoning_effort, which
vLLM's /tokenize lacks, inside chat_template_kwargs where the chat endpoint merges them):
``indexer.tokens.tokenize_chat_body``. The pod's ``/tokenize`` renders with its own
``--chat-template``, ``--chat-template-content-format`` and ``--default-chat-template-kwargs``, as
its chat endpoint does, so the router's settings of those names are not sent (checked against
vLLM 0.32: tests/real_vllm/test_tokenize_parity.py); of its serve flags only
``--exclude-tools-when-tool-choice-none`` is left out there, so the router leaves the tools out of
what it asks.

A request with a ``cache_salt`` (an API key's derived salt, or a client's own) has the pod's answer
cached under its salt too (``RemoteTokenizer._tokenize``): only requests of the same salt are answered from it
without a round trip, so no tenant can tell by the latency whether another sent the same prompt
(docs/reliability.md, "Tenants that never share a prefix cache"). The salt is not sent to the pod.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from indexer.tokens import RemoteTokenizer, is_media_part
from router.prompts import add_special_tokens, check_chat, completion_prompt, truncate, truncation
from router.upstream import UpstreamClient

log = logging.getLogger("kvroute")

CHARS_PER_TOKEN = 4  # length estimate when the pod could not tokenize: the usual English average


@dataclass
class PromptIds:
    """What plan needs: token ids, and whether they key the prompt's blocks as the pods do (the pods' own ids
    of a prompt without media: prefix lookup worth doing)."""

    tokens: list[int]
    exact: bool


class _Answer:
    """The slice of an httpx response RemoteTokenizer reads, filled from the router's client."""

    def __init__(self, status: int, body: bytes):
        self.status_code = status
        self._body = body

    @property
    def text(self) -> str:
        return self._body.decode("utf-8", "replace")

    def json(self) -> Any:
        try:
            return orjson.loads(self._body)
        except orjson.JSONDecodeError as exc:
            raise ValueError(str(exc)) from exc


class SessionPoster:
    """``post(url, content=, headers=)`` over the router's upstream client, with a deadline."""

    def __init__(self, client: Callable[[], UpstreamClient | None], timeout_s: float):
        self._client = client
        self._timeout_s = timeout_s

    async def post(self, url: str, content: bytes, headers: dict[str, str]) -> _Answer:
        client = self._client()
        if client is None:
            raise RuntimeError("the upstream client is not started")
        return await asyncio.wait_for(self._post(client, url, content, headers), self._timeout_s)

    @staticmethod
    async def _post(client: UpstreamClient, url: str, content: bytes, headers: dict[str, str]) -> _Answer:
        resp = await client.post(url, content, headers)
        try:
            body = await resp.read()
        except BaseException:
            resp.close()
            raise
        resp.release()
        return _Answer(resp.status, body)


def _estimate(text_or_messages: Any) -> list[int]:
    """A stand-in prompt of about the right length (ids are never looked up: exact=False)."""
    if isinstance(text_or_messages, str):
        chars = len(text_or_messages)
    else:
        chars = sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else len(orjson.dumps(m))
                    for m in text_or_messages if isinstance(m, dict))
    return [0] * max(1, chars // CHARS_PER_TOKEN)


def _has_media(messages: list[Any]) -> bool:
    """Whether a chat request has an image, audio, video or embeddings part (``is_media_part``)."""
    return any(isinstance(m, dict) and isinstance(m.get("content"), list) and any(map(is_media_part, m["content"]))
               for m in messages)


class RemotePrompts:
    def __init__(self, registry: Any, client: Callable[[], UpstreamClient | None], timeout_s: float,
                 cache_size: int, on_failure: Callable[[str], None], exclude_tools_when_tool_choice_none: bool = False):
        self._registry = registry
        self._poster = SessionPoster(client, timeout_s)
        self._timeout_s = timeout_s
        self._cache_size = cache_size
        self._on_failure = on_failure
        # the pods' --exclude-tools-when-tool-choice-none: their chat endpoint leaves the tools out of
        # the template for tool_choice "none", their /tokenize does not, so the router leaves them out
        # of what it asks /tokenize
        self._exclude_tools = exclude_tools_when_tool_choice_none
        self._by_pod: dict[tuple[str, str, str], RemoteTokenizer] = {}

    def _tokenizer_for(self, model: str) -> RemoteTokenizer | None:
        pods = sorted((p for p in self._registry.healthy()
                       if p.config.model == model or model in p.adapters), key=lambda p: p.id)
        if not pods:
            return None
        pod = pods[0].config
        key = (pod.id, pod.url, model)
        tok = self._by_pod.get(key)
        if tok is None:
            if len(self._by_pod) > 4 * max(1, len(self._registry.pods)):  # pods came and went: start afresh
                self._by_pod.clear()
            tok = self._by_pod[key] = RemoteTokenizer(pod.url, model, self._poster, self._cache_size)
        return tok

    async def prompt_ids(self, kind: str, body: dict[str, Any], model: str) -> PromptIds:
        """Token ids for ``body``; raises APIError only for a malformed prompt, never for the pod."""
        cut = truncation(body) if body.get("truncate_prompt_tokens") is not None else None
        exact = True
        if kind == "chat":
            check_chat(body)
            ask: Any = body["messages"]
            special = body.get("add_special_tokens") is True
            # vLLM keys a block that holds media tokens with the media's hashes too; the pod's ids
            # alone would key two requests that differ only in their image alike (a false credit)
            exact = not _has_media(ask)
            if self._exclude_tools and body.get("tool_choice") == "none" and "tools" in body:
                body = {k: v for k, v in body.items() if k != "tools"}
        else:
            ask = completion_prompt(body)
            if isinstance(ask, list):
                return PromptIds(list(truncate(ask, *cut)) if cut is not None else ask, exact=True)
            special = add_special_tokens(body)
        tok = self._tokenizer_for(model)
        if tok is None:
            self._on_failure("no_pod")
            return PromptIds(_estimate(ask), exact=False)
        salt = body.get("cache_salt")  # a salted request's answer is cached apart (RemoteTokenizer)
        try:
            return PromptIds(await asyncio.wait_for(self._tokens(tok, kind, body, ask, special, cut,
                                                                 salt if isinstance(salt, str) else None),
                                                    self._timeout_s), exact=exact)
        except TimeoutError:
            self._on_failure("timeout")
        except Exception as exc:  # an error answer, a refused connection, a body without tokens
            log.debug("remote tokenize on %s failed: %s", tok.base_url, exc)
            self._on_failure("error")
        return PromptIds(_estimate(ask), exact=False)

    @staticmethod
    async def _tokens(tok: RemoteTokenizer, kind: str, body: dict[str, Any], ask: Any, special: bool,
                      cut: tuple[int, str | None] | None, salt: str | None = None) -> list[int]:
        """The pod's tokens, cut as vLLM cuts them for ``truncate_prompt_tokens`` (its /tokenize does
        not truncate). Cut from the tokenizer's side with special tokens added, the text's own tokens
        are asked for too (``router.prompts.truncate``). ``salt``: the request's, its answers cached
        under it."""
        if kind == "chat":
            tokens = await tok.encode_chat_request(body, salt)
        else:
            tokens = await tok.encode(ask, special, salt)
        if cut is None or len(tokens) <= cut[0]:
            return tokens
        plain = None
        if special and cut[1] is None:
            plain = await (tok.encode_chat_request({**body, "add_special_tokens": False}, salt) if kind == "chat"
                           else tok.encode(ask, False, salt))
        return list(truncate(tokens, *cut, plain))
